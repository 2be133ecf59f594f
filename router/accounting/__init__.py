"""The accounting feature (docstring written with the layering rules)."""
