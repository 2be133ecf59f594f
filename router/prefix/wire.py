"""vLLM's KV event messages off the wire (pure; no vLLM import).

What an engine started with `--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": ..., "replay_endpoint": ...}'` sends (vllm
distributed/kv_events.py `ZmqEventPublisher`):

- PUB, one multipart message per scheduler step that changed the cache:
  `(topic, seq, payload)`; `topic` the config's (default ""), `seq` an 8-byte big-endian
  counter from 0 per publisher (it starts again at 0 when the engine restarts), `payload` a
  msgpack `KVEventBatch` = array `[ts, events, data_parallel_rank?]`; each event a map tagged
  `"type"`: `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys?, group_idx?, ...}`, `BlockRemoved {block_hashes, medium,
  group_idx?}`, `AllBlocksCleared {}`.
- ROUTER (replay): a DEALER sends `(b"", start_seq as 8 bytes big-endian)` and gets back
  `(b"", topic, seq, payload)` for every batch still in the engine's buffer (`buffer_steps`,
  default 10 000) with seq >= start_seq, then `(b"", b"", END_SEQ, b"")`, END_SEQ = -1 as
  8 signed bytes.

Events are decoded untyped and read by name, so fields vLLM adds later pass through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "Batch",
    "BlockRemoved",
    "BlockStored",
    "WireError",
    "decode_batch",
    "decode_seq",
    "encode_seq",
]

END_SEQ = -1


class WireError(ValueError):
    """A message that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes | int, ...]
    parent_block_hash: bytes | int | None
    token_ids: tuple[int, ...]
    block_size_tokens: int | None
    medium: str | None
    group_idx: int | None
    plain: bool  # no extra keys and no LoRA: the hash is the router's plain-text chain


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes | int, ...]
    medium: str | None
    group_idx: int | None


# None stands for AllBlocksCleared
Event = BlockStored | BlockRemoved | None


@dataclass(frozen=True, slots=True)
class Batch:
    ts_s: float  # the engine's wall clock when it published
    events: tuple[Event, ...]


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def _hashes(value: Any) -> tuple[bytes | int, ...]:
    if not isinstance(value, list) or not all(isinstance(h, bytes | int) for h in value):
        raise WireError("block_hashes is not a list of bytes or ints")
    return tuple(value)


def _event(raw: Any) -> Event:
    if not isinstance(raw, dict):
        raise WireError("an event is not a map")
    kind = raw.get("type")
    medium = raw.get("medium")
    group = raw.get("group_idx")
    if kind == "BlockStored":
        size = raw.get("block_size")
        return BlockStored(
            block_hashes=_hashes(raw.get("block_hashes")),
            parent_block_hash=raw.get("parent_block_hash"),
            token_ids=tuple(raw.get("token_ids") or ()),
            block_size_tokens=size if isinstance(size, int) else None,
            medium=medium,
            group_idx=group,
            plain=not raw.get("extra_keys") and raw.get("lora_name") is None,
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(raw.get("block_hashes")), medium, group)
    if kind == "AllBlocksCleared":
        return None
    raise WireError(f"unknown event type {kind!r}")


def decode_batch(payload: bytes) -> Batch:
    """A msgpack `KVEventBatch`; `WireError` if it is not one."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as err:
        raise WireError(f"not msgpack: {err}") from err
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireError("not a [ts, events, ...] array")
    ts = raw[0]
    return Batch(
        ts_s=float(ts) if isinstance(ts, int | float) else 0.0, events=tuple(map(_event, raw[1]))
    )
