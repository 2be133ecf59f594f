"""The admission feature (docstring written with the layering rules)."""
