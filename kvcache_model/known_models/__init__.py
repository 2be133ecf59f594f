"""HF `config.json` files of well-known models, shipped so planning needs no download.

Read them through `kvcache_model.known`; this package only holds the JSON data.
"""
