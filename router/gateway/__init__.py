"""The gateway feature (docstring written with the layering rules)."""
