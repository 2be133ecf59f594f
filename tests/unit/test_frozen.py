"""router/frozen.py: the faster __init__ of frozen slotted dataclasses keeps their behaviour."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest

from router.accounting.ledger import RequestRecord
from router.admission.estimate import Estimate
from router.frozen import fast_init


def _made() -> type[Any]:
    @dataclass(frozen=True, slots=True)
    class Made:
        a: int
        b: str = "b"
        c: tuple[int, ...] = field(default=(), compare=False)
        d: float | None = field(default=None, kw_only=True)

    return Made


_Plain = _made()
_Fast = fast_init(_made())


def test_the_same_signature_defaults_and_values_as_the_dataclass_s() -> None:
    assert str(inspect.signature(_Fast)) == str(inspect.signature(_Plain))
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}),
        ((1, "x", (2,)), {"d": 0.5}),
        ((), {"a": 3, "b": "y"}),
    ]
    for args, kwargs in cases:
        made, plain = _Fast(*args, **kwargs), _Plain(*args, **kwargs)
        assert dataclasses.astuple(made) == dataclasses.astuple(plain)
        assert hash(made) == hash(_Fast(*args, **kwargs))
    assert _Fast(1, c=(1,)) == _Fast(1, c=(2,))  # compare=False kept
    with pytest.raises(TypeError):
        _Fast()
    with pytest.raises(TypeError):
        _Fast(1, "x", (), 0.5)  # d is keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        _Fast(1).a = 2
    assert dataclasses.replace(_Fast(1), b="z") == _Fast(1, "z")


def test_the_request_path_s_records_keep_their_fields() -> None:
    assert Estimate(3, 4, "heuristic").total_tokens == 7
    record = {f.name: i for i, f in enumerate(dataclasses.fields(RequestRecord))}
    assert dataclasses.asdict(RequestRecord(**record)) == record  # type: ignore[arg-type]


def test_what_it_cannot_keep_exact_is_refused() -> None:
    @dataclass(frozen=True, slots=True)
    class WithFactory:
        a: list[int] = field(default_factory=list)

    @dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclass(frozen=True, slots=True)
    class WithPostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    for cls in (WithFactory, NotFrozen, WithPostInit):
        with pytest.raises(TypeError):
            fast_init(cls)
