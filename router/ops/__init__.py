"""The ops feature (docstring written with the layering rules)."""
