"""The rebalancer feature (docstring written with the layering rules)."""
