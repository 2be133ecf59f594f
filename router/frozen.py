"""A faster `__init__` for the frozen, slotted dataclasses made on every request.

A frozen dataclass's generated `__init__` sets each field with `object.__setattr__(self, name,
value)` (a global lookup, an attribute lookup and a call with a name to resolve): ~80 ns a
field, so 1.4 µs for the ledger's 18-field `RequestRecord` against 0.5 µs unfrozen.
`fast_init` replaces it with one that calls each slot's own descriptor (`Class.field.__set__`,
bound once), ~2.5 × faster, with the same signature, defaults and result: the class stays
frozen (assigning a field afterwards still raises), equal, hashable, `replace`-able.

Only for what it can keep exact: a slotted dataclass whose fields are all `init` fields without
a `default_factory`, with no `__post_init__` and no `InitVar`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["fast_init"]

T = TypeVar("T", bound=type[Any])


def fast_init(cls: T) -> T:
    """Give the frozen slotted dataclass `cls` the faster `__init__` (a class decorator, above
    `@dataclass`)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: fast_init needs a frozen, slotted dataclass")
    if hasattr(cls, "__post_init__") or any(
        isinstance(v, dataclasses.InitVar) for v in cls.__annotations__.values()
    ):
        raise TypeError(f"{cls.__name__}: fast_init does not run __post_init__ or InitVars")
    namespace: dict[str, Any] = {}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for f in dataclasses.fields(cls):
        if not f.init or f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: fast_init needs plain init fields")
        param = f.name
        if f.default is not dataclasses.MISSING:
            namespace[f"_default_{f.name}"] = f.default
            param = f"{f.name}=_default_{f.name}"
        (keyword if f.kw_only else positional).append(param)
        namespace[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        body.append(f"    _set_{f.name}(self, {f.name})\n")
    params_text = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({params_text}):\n" + ("".join(body) or "    pass\n")
    exec(source, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    cls.__init__ = init
    return cls
