"""One engine's KV event stream into its `BlockIndex` (the async shell around `index.py`).

`EngineEvents` owns a ZMQ SUB socket connected to the engine's publisher, the socket's monitor,
and one task (`start()`/`aclose()`). It handles:

- gaps: a batch whose number is past the next expected one asks the engine's replay socket
  for everything from the expected number (one DEALER request, `replay_timeout_s`); what the
  buffer no longer has is lost for good: the index starts over inexact (`BlockIndex.resync`)
  from the first batch after the loss, found live or by a replay;
- batches lost with nothing after them (published before the subscription took, or the last
  before a quiet spell): on connecting and after `catch_up_s` without a batch it asks the
  replay socket for anything past the last batch applied;
- reconnects and restarts: when the monitor reports the connection lost (read only once no
  batch is queued: those came before it), the index is dropped (the engine may be a new
  process with an empty cache); the first batch after reconnecting is
  then a gap from 0, which a live publisher's replay buffer fills, and a restarted engine's
  sequence (back at 0) says it is new;
- engines that publish nothing: no connection within `connect_warn_s` logs one warning and
  the engine stays unusable (`usable` False: placement falls back to what it did without);
- a hash chain that disagrees (another hash algo or seed): the first plain parentless
  `BlockStored` is recomputed with the router's seed; a mismatch logs a warning and makes the
  engine unusable until it reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pools.launchers.base import KvEventsSpec
from router.prefix.hashing import DEFAULT_SEED, block_key, chain_keys
from router.prefix.index import DEFAULT_MAX_BLOCKS, Accepted, BlockIndex
from router.prefix.wire import (
    END_SEQ,
    Batch,
    BlockStored,
    WireError,
    decode_batch,
    decode_seq,
    encode_seq,
)

__all__ = ["EngineEvents", "SubscriberSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SubscriberSettings:
    connect_warn_s: float = 30.0  # no connection this long: warn, leave the engine out
    replay_timeout_s: float = 2.0  # a replay's end marker is awaited this long
    catch_up_s: float = 5.0  # no batch this long: ask the replay socket for newer ones
    max_blocks: int = DEFAULT_MAX_BLOCKS  # per engine; past it the index starts over


class EngineEvents:
    """Subscriber of one engine (`spec`: where it publishes, the seed its hashes use).
    `index` is read by the event loop's other tasks between awaits; only this component's
    task writes it."""

    def __init__(
        self,
        instance_id: str,
        spec: KvEventsSpec,
        *,
        ctx: zmq.asyncio.Context,
        clock: Callable[[], float],
        settings: SubscriberSettings = SubscriberSettings(),
    ) -> None:
        self.instance_id = instance_id
        self.spec = spec
        self.index = BlockIndex(max_blocks=settings.max_blocks)
        self.connected = False
        self.hash_mismatch = False
        self.batches_received = 0  # batches decoded, live and replayed (duplicates too)
        self.replays = 0  # replay requests sent (gaps seen)
        self.resyncs = 0  # gaps the replay could not fill
        self.restarts = 0  # new publishers seen (sequence back to 0) and lost connections
        self.silent = False  # nothing to connect to after connect_warn_s (warned once)
        self._ctx = ctx
        self._clock = clock
        self._seed = DEFAULT_SEED if spec.hash_seed is None else spec.hash_seed
        self._connect_warn_s = settings.connect_warn_s
        self._replay_timeout_s = settings.replay_timeout_s
        self._catch_up_s = settings.catch_up_s
        self._verified = False
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()

    @property
    def usable(self) -> bool:
        """Its index says what the engine holds (a lower bound when `index.exact` is False)."""
        return self.connected and not self.hash_mismatch

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.instance_id}")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait_for(self, cond: Callable[[EngineEvents], bool]) -> None:
        """Return once `cond(self)` holds, checked after every change (tests, status)."""
        async with self._changed:
            await self._changed.wait_for(lambda: cond(self))

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.spec.endpoint)
            await self._loop(sub, monitor)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _loop(self, sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        started_s = heard_s = self._clock()
        ever_connected = False
        catch_up = False
        while True:
            ready = dict(await poller.poll(timeout=1000))
            # Batches already queued come before a connection event: those received before
            # the connection dropped belong to the index being dropped (applied after the
            # drop they would stand for a gone publisher's blocks and put the expected
            # sequence ahead of a restarted engine's); the monitor waits while sub has any.
            if sub in ready:
                heard_s = self._clock()
                await self._on_live(await sub.recv_multipart())
                await self._notify()
            elif monitor in ready:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_CONNECTED:
                    ever_connected = self.connected = catch_up = True
                    self.silent = False
                    log.info("kv events: %s connected", self.instance_id)
                elif event == zmq.EVENT_DISCONNECTED and self.connected:
                    log.info("kv events: %s disconnected; its index is dropped", self.instance_id)
                    self.connected = self.hash_mismatch = self._verified = False
                    self.index.drop()
                    self.restarts += 1
                await self._notify()
            # A batch published before the subscription reached the publisher, or the last one
            # before a quiet spell, is lost without a later one to show the gap: on connecting
            # and after catch_up_s without a batch, ask the replay socket for anything newer.
            if self.connected and (catch_up or self._clock() - heard_s >= self._catch_up_s):
                catch_up, heard_s = False, self._clock()
                await self._replay(until_seq=None)
                await self._notify()
            silent_s = self._clock() - started_s
            if not ever_connected and not self.silent and silent_s >= self._connect_warn_s:
                self.silent = True
                await self._notify()
                log.warning(
                    "kv events: %s: nothing at %s after %.0f s (engine started without"
                    " --kv-events-config?); placing without its cache",
                    self.instance_id,
                    self.spec.endpoint,
                    silent_s,
                )

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _on_live(self, frames: list[bytes]) -> None:
        parsed = self._parse(frames)
        if parsed is None:
            return
        seq, batch = parsed
        now_s = self._clock()
        verdict = self.index.accept_live(seq, batch, now_s)
        if verdict is Accepted.RESTARTED:
            self.restarts += 1
            self._verified = self.hash_mismatch = False
            log.info("kv events: %s restarted (sequence back to %d)", self.instance_id, seq)
        if verdict is Accepted.GAP:
            await self._replay(seq)
            if self.index.accept_replayed(seq, batch, self._clock()) is Accepted.GAP:
                self._resync(seq, batch)
        if verdict is not Accepted.DUPLICATE:
            self._verify(batch)

    def _resync(self, seq: int, batch: Batch) -> None:
        self.resyncs += 1
        log.warning(
            "kv events: %s: batches %d..%d lost for good; its index starts over"
            " (under-reports until the engine clears its cache)",
            self.instance_id,
            self.index.expected_seq,
            seq - 1,
        )
        self.index.resync(seq, batch, self._clock())

    def _parse(self, frames: list[bytes]) -> tuple[int, Batch] | None:
        try:
            if len(frames) != 3:
                raise WireError(f"{len(frames)} frames, not 3")
            parsed = decode_seq(frames[1]), decode_batch(frames[2])
            self.batches_received += 1
            return parsed
        except WireError as err:
            log.warning("kv events: %s: dropped a message: %s", self.instance_id, err)
            return None

    async def _replay(self, until_seq: int | None) -> None:
        """Ask the replay socket for every batch from the expected one; apply those in order,
        up to `until_seq` (excluded; None: all)."""
        if self.spec.replay_endpoint is None:
            return
        if until_seq is not None:
            self.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.spec.replay_endpoint)
            await dealer.send_multipart([b"", encode_seq(self.index.expected_seq)])
            async with asyncio.timeout(self._replay_timeout_s):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) == 4 and frames[2] == encode_seq(END_SEQ):
                        return
                    parsed = self._parse(frames[1:])
                    if parsed is None or (until_seq is not None and parsed[0] >= until_seq):
                        continue
                    seq, batch = parsed
                    if self.index.accept_replayed(seq, batch, self._clock()) is Accepted.GAP:
                        # the buffer starts past what is missing: lost for good (without
                        # this, a catch-up that finds no live batch would leave the index
                        # waiting for them for ever)
                        self._resync(seq, batch)
                    self._verify(batch)
        except TimeoutError:
            log.warning("kv events: %s: replay got no end marker in time", self.instance_id)
        finally:
            dealer.close(linger=0)

    def _verify(self, batch: Batch) -> None:
        """Check the router's hash chain against the engine's on one parentless block."""
        if self._verified:
            return
        for event in batch.events:
            if not isinstance(event, BlockStored) or not event.plain:
                continue
            size = event.block_size_tokens
            if event.parent_block_hash is not None or not size or not event.block_hashes:
                continue
            mine = chain_keys(event.token_ids[:size], size, self._seed)
            self._verified = True
            if mine != [block_key(event.block_hashes[0])]:
                self.hash_mismatch = True
                log.warning(
                    "kv events: %s hashes blocks differently from the router (engine not on"
                    " --prefix-caching-hash-algo sha256_cbor, or another PYTHONHASHSEED);"
                    " placing without its cache",
                    self.instance_id,
                )
            return
