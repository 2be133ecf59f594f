"""Every instance's prefix-cache index: one `EngineEvents` per engine that publishes KV events.

`PrefixCache.cached_blocks(token_ids)` answers, for each instance whose index is usable, how
many leading full blocks of a prompt with those token ids the engine holds (vLLM reuses a
cached prefix up to its first missing block). Instances left out have no usable index
(started without KV events, not connected, hashing differently): callers treat them as they
did before the index existed, not as holding nothing. `view(instance_id)` is what
`GET /admin/pools` shows per instance (`IndexView`), `snapshot()` every followed instance's.
One ZMQ context, owned here; `start()`/`aclose()`; `add`/`remove` follow instances that come
and go, and `follow(specs)` makes the followed set one whole answer of a discovering launcher
(Ray, Kubernetes): new publishers followed, gone ones dropped, and an instance whose endpoint
moved (a Ray engine restarted on another node or port) followed at its new one, index dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import zmq.asyncio

from pools.launchers.base import InstanceSpec, KvEventsSpec
from router.prefix.hashing import DEFAULT_SEED, chain_keys
from router.prefix.subscriber import EngineEvents, SubscriberSettings

__all__ = ["IndexView", "PrefixCache"]


@dataclass(frozen=True, slots=True)
class IndexView:
    """One instance's index as `GET /admin/pools` and the status page show it."""

    instance_id: str
    usable: bool  # connected, hashing as the router does: placement and admission use it
    connected: bool
    cached_blocks: int
    block_size_tokens: int | None
    exact: bool  # False: under-reports since a lost batch
    index_age_s: float | None  # since the last batch applied; None: none since (re)connecting
    batches_received: int  # decoded since the router started following it, replays included
    replays: int  # gaps seen (replay requests)
    resyncs: int  # gaps the engine's replay buffer could not fill
    restarts: int  # new publishers and lost connections (the index dropped each time)

    def as_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "instance_id"}
        if self.index_age_s is not None:
            out["index_age_s"] = round(self.index_age_s, 3)
        return out


class PrefixCache:
    def __init__(
        self,
        instances: Iterable[InstanceSpec] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        settings: SubscriberSettings | None = None,
    ) -> None:
        self._clock = clock
        self._settings = settings or SubscriberSettings()
        self._ctx: zmq.asyncio.Context | None = None
        self._engines: dict[str, EngineEvents] = {}
        self._initial = [(s.instance_id, s.kv_events) for s in instances if s.kv_events]
        self._closing: set[asyncio.Task[None]] = set()  # subscribers `follow` dropped

    @property
    def engines(self) -> dict[str, EngineEvents]:
        return self._engines

    async def start(self) -> None:
        """Follow the instances given at construction that publish KV events."""
        self._ctx = self._ctx or zmq.asyncio.Context()
        for instance_id, spec in self._initial:
            self.add(instance_id, spec)

    def add(self, instance_id: str, spec: KvEventsSpec) -> None:
        """Follow an instance's events (an instance that joined); no-op if followed."""
        if self._ctx is None:
            raise RuntimeError("PrefixCache.add before start")
        if instance_id in self._engines:
            return
        engine = EngineEvents(
            instance_id, spec, ctx=self._ctx, clock=self._clock, settings=self._settings
        )
        self._engines[instance_id] = engine
        engine.start()

    async def remove(self, instance_id: str) -> None:
        """Stop following an instance (it left) and forget its index."""
        engine = self._engines.pop(instance_id, None)
        if engine is not None:
            await engine.aclose()

    def follow(self, instances: Iterable[InstanceSpec]) -> None:
        """Follow exactly the publishing instances of `instances` (one whole answer of the
        discovery loop; synchronous like its receiver: dropped subscribers close in tasks of
        their own, awaited by `aclose`). No-op before `start`."""
        if self._ctx is None:
            return
        wanted = {s.instance_id: s.kv_events for s in instances if s.kv_events is not None}
        for instance_id, engine in list(self._engines.items()):
            if wanted.get(instance_id) != engine.spec:  # gone, or publishing elsewhere now
                del self._engines[instance_id]
                task = asyncio.get_running_loop().create_task(engine.aclose())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        for instance_id, spec in wanted.items():
            self.add(instance_id, spec)

    async def aclose(self) -> None:
        for instance_id in list(self._engines):
            await self.remove(instance_id)
        if self._closing:
            await asyncio.gather(*self._closing)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes any socket left, never blocks
            self._ctx = None

    @property
    def usable(self) -> bool:
        """Some instance's index is usable now (else a lookup would find nothing to ask)."""
        return any(engine.usable for engine in self._engines.values())

    def chain_params(self) -> set[tuple[int, str]]:
        """The (block size, seed) pairs of the usable instances' chains: what
        `chain_keys(token_ids, size, seed)` must be computed for (off the event loop for a long
        prompt: ~0.1 ms a 128-token block) before `cached_tokens(token_ids, chains)`."""
        return {
            (size, engine.spec.hash_seed or DEFAULT_SEED)
            for engine in self._engines.values()
            if engine.usable and (size := engine.index.block_size_tokens) is not None
        }

    def cached_tokens(
        self,
        token_ids: Sequence[int],
        chains: Mapping[tuple[int, str], Sequence[int]] | None = None,
    ) -> dict[str, int]:
        """Leading prompt tokens each usable instance holds: `cached_blocks` × its block size
        (0 before it stored anything since (re)connecting)."""
        blocks = self.cached_blocks(token_ids, chains)
        out = {}
        for instance_id, n in blocks.items():
            size = self._engines[instance_id].index.block_size_tokens
            out[instance_id] = n * size if size else 0
        return out

    def exact_ids(self) -> frozenset[str]:
        """The usable instances whose index is exact (no batch lost since it started over)."""
        return frozenset(i for i, e in self._engines.items() if e.usable and e.index.exact)

    def cached_blocks(
        self,
        token_ids: Sequence[int],
        chains: Mapping[tuple[int, str], Sequence[int]] | None = None,
    ) -> dict[str, int]:
        """Leading blocks of the prompt each usable instance holds; the chain is computed
        once per (block size, seed) among them, unless given in `chains`."""
        chains = dict(chains or {})
        out: dict[str, int] = {}
        for instance_id, engine in self._engines.items():
            size = engine.index.block_size_tokens
            if not engine.usable:
                continue
            if size is None:  # nothing stored since (re)connecting: nothing cached
                out[instance_id] = 0
                continue
            seed = engine.spec.hash_seed or DEFAULT_SEED
            chain = chains.get((size, seed))
            if chain is None:
                chain = chains[(size, seed)] = chain_keys(token_ids, size, seed)
            out[instance_id] = engine.index.longest_prefix_blocks(chain)
        return out

    def view(self, instance_id: str) -> dict[str, Any] | None:
        """`/admin/pools`' `prefix_cache` of one instance (`IndexView.as_json`); None when it
        is not followed."""
        engine = self._engines.get(instance_id)
        return None if engine is None else self._view(instance_id, engine, self._clock()).as_json()

    def snapshot(self) -> list[IndexView]:
        now_s = self._clock()
        return [self._view(i, e, now_s) for i, e in sorted(self._engines.items())]

    @staticmethod
    def _view(instance_id: str, engine: EngineEvents, now_s: float) -> IndexView:
        index = engine.index
        return IndexView(
            instance_id=instance_id,
            usable=engine.usable,
            connected=engine.connected,
            cached_blocks=len(index.keys),
            block_size_tokens=index.block_size_tokens,
            exact=index.exact,
            index_age_s=None if index.updated_at_s is None else now_s - index.updated_at_s,
            batches_received=engine.batches_received,
            replays=engine.replays,
            resyncs=engine.resyncs,
            restarts=engine.restarts,
        )
