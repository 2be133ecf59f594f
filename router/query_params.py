"""Query parameters of the HTTP API, read one way for every route: numbers that SQLite's
integers hold and whole numbers in a range. Each raises `BadRequest` naming the parameter."""

from __future__ import annotations

import math

from router.errors import BadRequest

__all__ = ["float_param", "int_param"]


def float_param(raw: str | None, name: str) -> float | None:
    """A number of magnitude at most 2**53 (SQLite's integers hold it, and it is finite) from a
    query parameter; None when absent. Raises `BadRequest`."""
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not abs(value) <= 2**53:  # nan fails too
        raise BadRequest(
            f"query parameter {name} must be a finite number (at most 2**53 either side of 0),"
            f" got {raw[:40]!r}",
            "invalid_param",
            param=name,
        )
    return value


def int_param(raw: str | None, name: str, *, default: int, low: int, high: int) -> int:
    """A whole number in [low, high] from a query parameter (`1e2` is 100); `default` when
    absent. Raises `BadRequest`."""
    value = float_param(raw, name)
    if value is None:
        return default
    if value != int(value) or not low <= value <= high:
        raise BadRequest(
            f"query parameter {name} must be a whole number from {low} to {high}",
            "invalid_param",
            param=name,
        )
    return int(value)
