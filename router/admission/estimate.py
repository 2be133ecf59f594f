"""The request estimate admission works from (docs/admission.md, "1. Estimate"): prompt tokens,
expected output tokens, and the KV blocks the two need together.

Prompt tokens come from one of two sources, fixed when the estimator is built:

- `tokenizer`: the model's own `tokenizer.json` (the `tokenizers` library). Encoding is slow
  next to the 1 ms the router may add to a request (about 1 µs a token on the dev model's
  byte-level BPE, almost all of it in the pre-tokenizer regex), so counts are memoised twice:
  per space-separated chunk (a word and the punctuation glued to it; with the space in front,
  a chunk is always a pre-token boundary for byte-level and SentencePiece tokenizers, so
  chunk counts add up to the text's count up to runs of spaces; a piece's first chunk, with
  no space in front, gets its own memoised correction) and per whole piece of text of
  `PIECE_CACHE_MIN_CHARS` or more (an agent resends its whole history every step). Only the
  chunks not seen before are encoded, all at once. With the dev tokenizer text counts are exact.
- `heuristic`: UTF-8 bytes divided by a bytes-per-token ratio that starts at
  `HEURISTIC_BYTES_PER_TOKEN` and is corrected online.

What the engine counts on top of the text (the chat template's header and end tokens around
every message and tool call, the tool-list preamble, BOS) depends on the model's template, so
it is learned too: the prompt estimate is `exact + θ·x`, with `x` the `FEATURES` (message text
and JSON text, in tokens or bytes: tool schemas and arguments tokenize denser than prose, so
the heuristic gets a ratio for each; 1 for a chat request; messages; tool calls; 1 if the
request has tools; text prompts of a completions request) and `exact` the token-id prompts,
which are counted as given. `θ` is
tracked by a small Kalman filter with random-walk coefficients (`_OnlineLinear`): its steady
state is an EWMA of the residual, and while few requests have been seen it spreads the residual
over the coefficients by how sure it is of each, so the error falls within a few requests
instead of a few dozen; past its first 64 observations it takes them by blocks of 128 (one
numpy step, the same filter: ~0.7 µs a response instead of 7-12). `observe()` feeds it the
`usage.prompt_tokens` vLLM returned.

Output tokens: the request's `max_completion_tokens` (or `max_tokens`; 16 on /v1/completions
when absent, as vLLM and OpenAI default), capped by the class's observed p95 of completion
tokens (the class's `expected_output_tokens` until `MIN_P95_SAMPLES` were observed), the p95
alone when the request names no limit, raised to `min_tokens`, never more than
`max_model_len - prompt`; times the sequences the request asks for (`n`, batched prompts).

Never raises on a malformed body: what can be read is estimated, the rest counts as absent.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import mul
from pathlib import Path
from typing import Any

import numpy as np

from kvcache_model import blocks_for_tokens
from pools.config import Config
from router.admission.decision import CachedPrefix
from router.frozen import fast_init

__all__ = [
    "ASYNC_TEXT_CHARS",
    "DEFAULT_OUTPUT_TOKENS",
    "FEATURES",
    "HEURISTIC_BYTES_PER_TOKEN",
    "MIN_P95_SAMPLES",
    "Estimate",
    "EstimateInput",
    "TokenEstimator",
    "content_texts",
    "estimate_input",
    "positive_int",
    "read_openai",
    "template_json",
]

log = logging.getLogger(__name__)

# OpenAI's rule of thumb ("one token is about 4 characters of English text", the tokenizer
# help page); Llama 3's 128k vocabulary lands near it on English prose (~4.2). Code, JSON and
# other languages differ, which the online correction absorbs.
HEURISTIC_BYTES_PER_TOKEN = 4.0
MIN_P95_SAMPLES = 20  # completion samples a class needs before its p95 replaces the default
P95_RECOMPUTE_EVERY = 16  # observations between two p95 recomputations (a sorted copy)
# Never-seen text above this is encoded in a worker thread by `estimate_async` (encoding costs
# 0.3-0.8 µs a character on the dev tokenizer here, so under 1 ms; `encode` drops the GIL).
ASYNC_TEXT_CHARS = 1024
DEFAULT_OUTPUT_TOKENS = 256  # a class missing from `expected_output_tokens` (the config default)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's and OpenAI's default on /v1/completions
MAX_SEQUENCES = 256  # `n` beyond this is read as this (vLLM rejects such requests anyway)
PIECE_CACHE_MIN_CHARS = 64  # pieces this long are memoised whole
PIECE_CACHE_ENTRIES = 16_384
CHUNK_CACHE_ENTRIES = 200_000  # ~15 MB at most; cleared when full
CHUNK_MAX_CHARS = 64  # longer chunks (base64, minified JSON) are counted but not memoised

_MISS = 1 << 32  # a chunk-cache miss in a summed lookup: misses = total >> 32

# What `Estimate.features` holds, in order, and what `TokenEstimator.coefficients` weighs.
FEATURES = ("text", "json", "chat_request", "message", "tool_call", "tools", "text_prompt")
# Priors: a Llama-3-style template (BOS + the assistant header per request, a header, "\n\n"
# and an end token per message, tags around a JSON object per tool call, a preamble for tools).
_OVERHEAD_PRIOR = (5.0, 5.0, 8.0, 12.0)
_OVERHEAD_PRIOR_SD = (50.0, 30.0, 30.0, 100.0)  # wide: templates differ a lot between models
_OVERHEAD_DRIFT_SD = 0.1  # per observation: the template does not change


@fast_init
@dataclass(frozen=True, slots=True)
class Estimate:
    """One request's estimate. `output_tokens` covers all its sequences (`n`, batched prompts).

    `exact_prompt_tokens` (token-id prompts, counted as given) and `features` (what the rest of
    `prompt_tokens` was predicted from) are what `TokenEstimator.observe` learns from.
    """

    prompt_tokens: int
    output_tokens: int
    source: str  # "tokenizer" or "heuristic"
    sequences: int = 1
    exact_prompt_tokens: int = 0
    features: tuple[float, ...] = field(default=(), repr=False, compare=False)
    # the output limit the request names, per sequence, uncapped (None: it names none)
    requested_output_tokens: int | None = None
    # what each instance's prefix cache holds of the prompt, by the KV-event indexes (set on
    # the request path, router/prefix; None: no lookup)
    prefix: CachedPrefix | None = field(default=None, compare=False)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def blocks(self, block_size_tokens: int) -> int:
        """KV blocks for prompt + output: ceil(total / block_size_tokens)."""
        return blocks_for_tokens(self.total_tokens, block_size_tokens)


class _OnlineLinear:
    """y ≈ θ·x with θ a random walk, tracked by a Kalman filter (pure arithmetic, no I/O).

    Observation noise is `noise_abs_sd² + (noise_rel_sd · y)²`, so big prompts do not drown
    small ones and the fit minimises relative error. A residual beyond 4 predicted standard
    deviations is clipped (an image part or a template surprise moves θ, but not wildly). A
    coefficient's variance never grows past its prior, so unused features do not wind up.

    `observe` feeds `update` one observation at a time for the first `sequential` ones (the
    error falls within a few requests); after that it keeps them and applies every `batch` of
    them in one step (`update_batch`: the same filter's update by a block of observations,
    numpy; a 7×7 update in Python on every response cost 7-12 µs, a block of 128 ~60 µs). So
    past the first ones, θ lags by up to `batch` responses: the template it learns is fixed.
    """

    sequential = 64  # observations applied one by one before batching starts
    batch = 128  # observations kept before a block update

    def __init__(
        self,
        prior: Sequence[float],
        prior_sd: Sequence[float],
        drift_sd: Sequence[float],
        *,
        noise_abs_sd: float,
        noise_rel_sd: float,
        bounds: Sequence[tuple[float, float]],
    ) -> None:
        n = len(prior)
        self.theta = [float(v) for v in prior]
        self._p = [[(prior_sd[i] ** 2 if i == j else 0.0) for j in range(n)] for i in range(n)]
        self._p_max = [s * s for s in prior_sd]
        self._q = [s * s for s in drift_sd]
        self._noise_abs = noise_abs_sd**2
        self._noise_rel = noise_rel_sd**2
        self._bounds = list(bounds)
        self._seen = 0
        self._pending_x: list[Sequence[float]] = []
        self._pending_y: list[float] = []

    def predict(self, x: Sequence[float]) -> float:
        return float(sum(map(mul, self.theta, x)))

    def observe(self, x: Sequence[float], y: float) -> None:
        """`update`, one by one at first, then by blocks of `batch` observations."""
        if self._seen < self.sequential:
            self._seen += 1
            self.update(x, y)
            return
        if len(x) != len(self.theta) or not any(x):
            return
        self._pending_x.append(x)
        self._pending_y.append(y)
        if len(self._pending_y) >= self.batch:
            self.flush()

    def flush(self) -> None:
        """Apply the observations `observe` kept."""
        xs, ys = self._pending_x, self._pending_y
        if ys:
            self._pending_x, self._pending_y = [], []
            self.update_batch(xs, ys)

    def update_batch(self, xs: Sequence[Sequence[float]], ys: Sequence[float]) -> None:
        """The Kalman update by all of `xs`/`ys` at once (exact for a block without drift): the
        residuals clipped at 4 predicted standard deviations from the block's start, the drift
        of the block's observations added after it. Each x has the model's length."""
        x = np.array(xs, dtype=float)
        y = np.array(ys, dtype=float)
        p = np.array(self._p)
        theta = np.array(self.theta)
        r = self._noise_abs + self._noise_rel * y * y
        var = ((x @ p) * x).sum(axis=1) + r  # each one's predicted variance
        if not var.min() > 0.0 or not math.isfinite(var.max()):
            return
        limit = 4.0 * np.sqrt(var)
        e = np.clip(y - x @ theta, -limit, limit)
        xw = x.T / r  # Xᵀ R⁻¹: the information form, 7×7 inverses whatever the block's size
        try:
            p = np.linalg.inv(np.linalg.inv(p) + xw @ x)
        except np.linalg.LinAlgError:
            return
        theta = theta + p @ (xw @ e)
        p = 0.5 * (p + p.T)
        if not (math.isfinite(theta.sum()) and math.isfinite(p.sum())):
            return
        lo, hi = zip(*self._bounds, strict=True)
        self.theta = np.clip(theta, lo, hi).tolist()
        rows = p.tolist()
        drift = len(ys)
        for i in range(len(rows)):
            if rows[i][i] < self._p_max[i]:
                rows[i][i] = min(rows[i][i] + drift * self._q[i], self._p_max[i])
        self._p = rows

    def update(self, x: Sequence[float], y: float) -> None:
        n = len(self.theta)
        if len(x) != n:
            return
        nz = [i for i in range(n) if x[i]]
        if not nz:
            return
        p = self._p
        px = [sum(p[i][j] * x[j] for j in nz) for i in range(n)]
        s = sum(x[i] * px[i] for i in nz) + self._noise_abs + self._noise_rel * y * y
        if not s > 0.0 or not math.isfinite(s):
            return
        limit = 4.0 * math.sqrt(s)
        e = min(max(y - self.predict(x), -limit), limit)
        for i in range(n):
            if px[i]:
                lo, hi = self._bounds[i]
                self.theta[i] = min(max(self.theta[i] + px[i] * e / s, lo), hi)
                row = p[i]
                k = px[i] / s
                for j in range(n):
                    if px[j]:
                        row[j] -= k * px[j]
        for i in range(n):
            if p[i][i] < self._p_max[i]:
                p[i][i] = min(p[i][i] + self._q[i], self._p_max[i])


def _utf8_bytes(text: str) -> int:
    if text.isascii():  # O(1) in CPython
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


class _TokenCounter:
    """Token counts of text pieces from a `tokenizers.Tokenizer`, memoised per chunk and piece.

    Safe to call from a worker thread while the event loop calls it too: the caches are plain
    dicts changed by single (GIL-atomic) operations, and a lost race costs a recount.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._chunks: dict[str, int] = {"": 0}
        self._pieces: dict[tuple[int, int], float] = {}
        # Tokens a string prompt gains from the post-processor (BOS on Llama-style models).
        self.special_tokens = self._encode_len("", special=True)
        # A run of spaces splits into empty chunks; what one extra space costs.
        self._space_tokens = max(0.0, (self._encode_len("x     y") - self._encode_len("x y")) / 4)
        # A piece's first chunk has no space before it: tokens alone minus tokens after a
        # space. A leading space is not an extra one: it joins the first word.
        self._first_delta: dict[str, float] = {"": -self._space_tokens}

    def encode_len(self, text: str) -> int:
        """Tokens of `text` encoded whole, no special tokens (not memoised)."""
        return self._encode_len(text)

    def _encode_len(self, text: str, special: bool = False) -> int:
        try:
            return len(self._tok.encode(text, add_special_tokens=special).ids)
        except Exception:  # lone surrogates and the like: the tokenizer refuses them
            return -(-_utf8_bytes(text) // 4)

    def count(
        self, groups: Sequence[Sequence[str]], max_new_chars: int | None = None
    ) -> list[float] | None:
        """Tokens in each group of text pieces, each piece as encoded on its own (no special
        tokens), with one encoding of all never-seen chunks. Pieces under
        `PIECE_CACHE_MIN_CHARS` are counted joined by spaces (the same chunks). With
        `max_new_chars`, None instead when more text than that has never been seen (the caller
        then counts in a worker thread): lookups are cheap, encoding is not."""
        totals = [0.0] * len(groups)
        work: list[tuple[int, tuple[int, int] | None, list[str], list[str]]] = []
        pieces_seen = self._pieces
        chunk_counts = self._chunks
        first_delta = self._first_delta
        for group, pieces in enumerate(groups):
            small = []
            for piece in pieces:
                if len(piece) < PIECE_CACHE_MIN_CHARS:
                    small.append(piece)
                    continue
                piece_key = (hash(piece), len(piece))
                known = pieces_seen.get(piece_key)
                if known is None:
                    work.append((group, piece_key, piece.split(" "), [piece.partition(" ")[0]]))
                else:
                    totals[group] += known
            if small:
                firsts = [piece.partition(" ")[0] for piece in small]
                chunks = " ".join(small).split(" ")
                # the common case, every chunk and first chunk seen before: summed here, in
                # C calls (a miss is _MISS among the chunks, NaN among the first chunks)
                summed = sum(map(chunk_counts.get, chunks, repeat(_MISS)))
                deltas = sum(map(first_delta.get, firsts, repeat(math.nan)))
                if summed < _MISS and deltas == deltas:
                    totals[group] += summed + self._space_tokens * chunks.count("") + deltas
                else:
                    work.append((group, None, chunks, firsts))
        if not work:
            return totals
        pending: list[tuple[int, tuple[int, int] | None, float, list[str], list[str]]] = []
        new: dict[str, int] = {}
        new_firsts: dict[str, None] = {}
        for group, key, chunks, firsts in work:
            misses, hits = divmod(sum(map(chunk_counts.get, chunks, repeat(_MISS))), _MISS)
            partial = hits + self._space_tokens * chunks.count("")
            missing = [c for c in chunks if c not in chunk_counts] if misses else []
            if missing:
                new.update(dict.fromkeys(missing, 0))
            first_missing = []
            for first in firsts:
                delta = first_delta.get(first)
                if delta is None:
                    first_missing.append(first)
                else:
                    partial += delta
            new_firsts.update(dict.fromkeys(first_missing))
            if missing or first_missing or key is not None:
                pending.append((group, key, partial, missing, first_missing))
            else:
                totals[group] += partial
        if max_new_chars is not None and (new or new_firsts):
            new_chars = sum(map(len, new)) + len(new) + sum(map(len, new_firsts))
            if new_chars > max_new_chars:
                return None
        if new:
            new = self._encode_chunks(list(new))
        for group, key, partial, missing, first_missing in pending:
            if missing:
                partial += sum(map(new.__getitem__, missing))
            for first in first_missing:
                partial += self._learn_first(first, new)
            if key is not None:
                if len(pieces_seen) >= PIECE_CACHE_ENTRIES:
                    # FIFO eviction; another thread may have evicted first
                    with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                        del pieces_seen[next(iter(pieces_seen))]
                pieces_seen[key] = partial
            totals[group] += partial
        return totals

    def _learn_first(self, chunk: str, fresh: Mapping[str, int]) -> float:
        """What a piece's first chunk costs alone minus what it costs after a space."""
        known = self._first_delta.get(chunk)
        if known is not None:
            return known
        spaced = self._chunks.get(chunk)
        if spaced is None:
            spaced = fresh.get(chunk)
        if spaced is None:
            spaced = self._encode_len(" " + chunk)
        delta = float(self._encode_len(chunk) - spaced)
        if len(chunk) <= CHUNK_MAX_CHARS:
            if len(self._first_delta) >= CHUNK_CACHE_ENTRIES:
                self._first_delta.clear()
                self._first_delta[""] = -self._space_tokens
            self._first_delta[chunk] = delta
        return delta

    def _encode_chunks(self, chunks: list[str]) -> dict[str, int]:
        """Counts of `chunks`, each as preceded by a space, from one encoding of them all: a
        token belongs to the chunk its first character is in."""
        try:
            encoding = self._tok.encode(" " + " ".join(chunks), add_special_tokens=False)
            offsets = encoding.offsets
            if len(offsets) < 256:  # a few new words: plain Python is quicker than numpy
                ends = list(accumulate(len(c) + 1 for c in chunks))
                counts = [0] * len(chunks)
                last = len(chunks) - 1
                for start, _ in offsets:
                    counts[min(bisect.bisect_right(ends, start), last)] += 1
            else:
                ends_np = np.cumsum(np.fromiter(map(len, chunks), np.int64, len(chunks)) + 1)
                starts = np.asarray(offsets, dtype=np.int64)[:, 0]
                owners = np.minimum(np.searchsorted(ends_np, starts, side="right"), len(chunks) - 1)
                counts = np.bincount(owners, minlength=len(chunks)).tolist()
        except Exception:  # a chunk it refuses (a lone surrogate): one by one, if few
            if len(chunks) > 256:
                return {c: -(-_utf8_bytes(" " + c) // 4) for c in chunks}
            counts = [self._encode_len(" " + c) for c in chunks]
        if len(self._chunks) >= CHUNK_CACHE_ENTRIES:
            self._chunks.clear()
            self._chunks[""] = 0
        fresh = dict(zip(chunks, counts, strict=True))
        for chunk, n in fresh.items():
            if len(chunk) <= CHUNK_MAX_CHARS:
                self._chunks[chunk] = n
        return fresh


@dataclass(slots=True)
class EstimateInput:
    """What an estimate needs from a body, read once: each protocol's adapter reads its own
    body shape into this (`read_openai` for chat and completions; `router.gateway.protocols`)."""

    pieces: list[str]  # message text and prompts
    json_pieces: list[str]  # tool-call names and arguments, the tools list as JSON
    chars: int
    exact_tokens: int
    chat: bool
    messages: int
    tool_calls: int
    has_tools: bool
    text_prompts: int
    prompts: int
    sequences: int
    requested_output: int | None
    min_output: int


def _positive_int(value: object) -> int | None:
    if value is None:  # the common case: a field the body leaves out
        return None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, float) and value.is_integer() and value > 0:
        return int(value)
    return None


def _dumps(value: object) -> str:
    try:  # as transformers' `tojson` filter renders it
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return ""


def _read_chat(
    body: dict[str, Any], pieces: list[str], json_pieces: list[str]
) -> tuple[int, int, bool]:
    messages = body.get("messages")
    n_messages = n_calls = 0
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            n_messages += 1
            content_texts(message.get("content"), pieces)
            calls = message.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    if not isinstance(call, dict):
                        continue
                    n_calls += 1
                    function = call.get("function")
                    if not isinstance(function, dict):
                        continue
                    name = function.get("name")
                    if isinstance(name, str) and name:
                        json_pieces.append(name)
                    arguments = function.get("arguments")
                    if isinstance(arguments, str):
                        if arguments:
                            json_pieces.append(arguments)
                    elif isinstance(arguments, dict | list):
                        json_pieces.append(_dumps(arguments))
    tools = body.get("tools")
    has_tools = isinstance(tools, list) and bool(tools)
    if has_tools:
        json_pieces.append(_dumps(tools))
    return n_messages, n_calls, has_tools


def _read_prompt(body: dict[str, Any], pieces: list[str]) -> tuple[int, int, int]:
    """(text prompts, prompts, token ids given as ids) of a completions body."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        pieces.append(prompt)
        return 1, 1, 0
    if not isinstance(prompt, list) or not prompt:
        return 0, 0, 0
    if not isinstance(prompt[0], str | list):  # one prompt as token ids
        return 0, 1, len(prompt)
    texts = prompts = ids = 0
    for item in prompt:
        if isinstance(item, str):
            pieces.append(item)
            texts += 1
            prompts += 1
        elif isinstance(item, list):
            ids += len(item)
            prompts += 1
    return texts, prompts, ids


def estimate_input(
    pieces: list[str],
    json_pieces: list[str],
    *,
    messages: int,
    tool_calls: int,
    has_tools: bool,
    requested_output: int | None,
    min_output: int = 0,
) -> EstimateInput:
    """The input of one chat-templated conversation (a chat, responses or messages request)."""
    return EstimateInput(
        pieces=pieces,
        json_pieces=json_pieces,
        chars=sum(map(len, pieces)) + sum(map(len, json_pieces)),
        exact_tokens=0,
        chat=True,
        messages=messages,
        tool_calls=tool_calls,
        has_tools=has_tools,
        text_prompts=0,
        prompts=1,
        sequences=1,
        requested_output=requested_output,
        min_output=min_output,
    )


def content_texts(content: object, pieces: list[str]) -> None:
    """Append the text of a message content to `pieces`: a string, or a list of parts (each a
    string or an object with `text`: OpenAI's `text` / `input_text` / `output_text`)."""
    if isinstance(content, str):
        if content:
            pieces.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str) and text:
                    pieces.append(text)
            elif isinstance(part, str) and part:
                pieces.append(part)


def template_json(value: object) -> str:
    """`value` as a chat template renders it (transformers' `tojson`; "" when it cannot)."""
    return _dumps(value)


def positive_int(value: object) -> int | None:
    """A whole number above 0 (an integral float too), else None."""
    return _positive_int(value)


def read_openai(body: object, *, chat: bool) -> EstimateInput:
    """A /v1/chat/completions (`chat`) or /v1/completions body's estimate input (any JSON
    value: one that is not an object reads as an empty object)."""
    return _read(body, chat)


def _read(value: object, chat: bool) -> EstimateInput:
    body: dict[str, Any] = value if isinstance(value, dict) else {}
    pieces: list[str] = []
    json_pieces: list[str] = []
    n_messages = n_calls = texts = ids = 0
    has_tools = False
    if chat:
        n_messages, n_calls, has_tools = _read_chat(body, pieces, json_pieces)
        prompts = 1
        requested = _positive_int(body.get("max_completion_tokens")) or _positive_int(
            body.get("max_tokens")
        )
    else:
        texts, prompts, ids = _read_prompt(body, pieces)
        requested = _positive_int(body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS))
    n = _positive_int(body.get("n")) or 1
    best_of = _positive_int(body.get("best_of")) or 1
    sequences = min(max(n, best_of), MAX_SEQUENCES) * max(prompts, 1)
    return EstimateInput(
        pieces=pieces,
        json_pieces=json_pieces,
        chars=sum(map(len, pieces)) + sum(map(len, json_pieces)),
        exact_tokens=ids,
        chat=chat,
        messages=n_messages,
        tool_calls=n_calls,
        has_tools=has_tools,
        text_prompts=texts,
        prompts=max(prompts, 1),
        sequences=sequences,
        requested_output=requested,
        min_output=_positive_int(body.get("min_tokens")) or 0,
    )


class TokenEstimator:
    """Estimates requests before admission and learns from the usage vLLM returns.

    One per router, built in `create_app`. `estimate()` is synchronous: tens of µs for a chat
    request whose words were seen before, about 1 µs a token of never-seen text (the
    tokenizer's own speed here); `estimate_async()` hands more than `ASYNC_TEXT_CHARS` of
    never-seen text to a worker thread. `observe()` and the estimates belong to one event loop.
    """

    def __init__(
        self,
        *,
        tokenizer_path: Path | None,
        expected_output_tokens: Mapping[str, int],
        max_model_len_tokens: int | None,
        window: int = 1000,
    ) -> None:
        self._counter: _TokenCounter | None = None
        if tokenizer_path is not None:
            self._counter = _load_counter(Path(tokenizer_path))
        self._expected = dict(expected_output_tokens)
        self._max_model_len = max_model_len_tokens
        self._window = max(1, window)
        self._samples: dict[str, deque[int]] = {}
        self._since_p95: dict[str, int] = {}
        self._p95: dict[str, int] = {}
        if self._counter is not None:
            content_prior, content_sd, content_drift = 1.0, 0.02, 0.002
            content_bounds = (0.5, 2.0)
            prompts_prior = 0.0  # the post-processor's tokens are counted exactly
            noise_abs, noise_rel = 1.0, 0.01
        else:
            content_prior = 1.0 / HEURISTIC_BYTES_PER_TOKEN
            content_sd, content_drift = 0.1, 0.005
            content_bounds = (1.0 / 16.0, 1.0)  # 1 to 16 bytes a token
            prompts_prior = 1.0  # BOS, on most models
            noise_abs, noise_rel = 2.0, 0.1
        self._model = _OnlineLinear(
            prior=(content_prior, content_prior, *_OVERHEAD_PRIOR, prompts_prior),
            prior_sd=(content_sd, content_sd, *_OVERHEAD_PRIOR_SD, 5.0),
            drift_sd=(content_drift, content_drift, *([_OVERHEAD_DRIFT_SD] * 5)),
            noise_abs_sd=noise_abs,
            noise_rel_sd=noise_rel,
            bounds=(content_bounds, content_bounds, *([(-1e4, 1e4)] * 5)),
        )

    @classmethod
    def from_config(cls, config: Config) -> TokenEstimator:
        """The model's `tokenizer.json` under `config.model.path` if it exists, else heuristic."""
        path = config.model.path / "tokenizer.json"
        return cls(
            tokenizer_path=path if path.is_file() else None,
            expected_output_tokens={c.name: c.expected_output_tokens for c in config.classes},
            max_model_len_tokens=config.model.max_model_len_tokens
            or _model_context_tokens(config.model.path),
        )

    def context_exceeded_early(self, parsed: EstimateInput) -> int | None:
        """A long input's lower bound on the context it needs, when that is already over
        `max_model_len` (else None): the tokens of its first characters, `2 × max_model_len`
        at a time up to `8 × max_model_len`, plus one output token. Counts that much
        text at most (a few ms) where the whole estimate of a 50,000-word prompt would encode
        all of it (a few hundred ms); the chat template's tokens are left out, and a cut
        word counts as its parts (never fewer tokens than whole), so it never refuses what
        fits."""
        limit = self._max_model_len
        counter = self._counter
        if limit is None or counter is None or parsed.chars <= 4 * limit:
            return None
        budget = 8 * limit
        step = 2 * limit  # encoded a step at a time: most long prompts are over after one
        tokens = 0
        for piece in (*parsed.pieces, *parsed.json_pieces):
            for start in range(0, min(len(piece), budget), step):
                part = piece[start : start + min(step, budget)]
                tokens += counter.encode_len(part)
                budget -= len(part)
                if tokens >= limit:  # no room for one output token (see context_needed)
                    return tokens + 1
                if budget <= 0:
                    return None
        return None

    def context_needed(self, estimate: Estimate) -> int | None:
        """The context the request needs (its prompt plus one output token) when that is over
        `max_model_len`, else None. Such a prompt can never be served, whatever the load. A
        prompt that fits with an output limit that does not is served as vLLM serves it: the
        output stops at the end of the context (vLLM 0.32 answers 200 on chat, completions,
        responses and messages alike; Claude Code asks `max_tokens` 32,000 of any model), and
        the estimate's output is capped there already. Without the tokenizer the byte heuristic
        may be off by a fifth, so the prompt counts 0.8 of its estimate."""
        limit = self._max_model_len
        if limit is None:
            return None
        prompt = estimate.prompt_tokens
        counted = prompt if estimate.source == "tokenizer" else int(prompt * 0.8)
        if counted >= limit:
            return prompt + 1
        return None

    @property
    def source(self) -> str:
        """Where prompt counts come from: "tokenizer" or "heuristic"."""
        return "tokenizer" if self._counter is not None else "heuristic"

    @property
    def coefficients(self) -> dict[str, float]:
        """The learned θ: tokens per unit of each of `FEATURES` (per token or byte of content)."""
        self._model.flush()
        return dict(zip(FEATURES, self._model.theta, strict=True))

    def estimate(self, body: object, *, chat: bool, class_name: str) -> Estimate:
        """Estimate a /v1/chat/completions (`chat`) or /v1/completions body: any JSON value a
        client sent (one that is not an object counts as an empty one). Never raises."""
        parsed = _read(body, chat)
        return self._finish(parsed, self._content(parsed), class_name)

    async def estimate_async(self, body: object, *, chat: bool, class_name: str) -> Estimate:
        """`estimate`, with the tokenizer's work in a worker thread when more than
        `ASYNC_TEXT_CHARS` of the body's text has not been counted before."""
        return await self.estimate_input_async(_read(body, chat), class_name=class_name)

    @property
    def max_model_len_tokens(self) -> int | None:
        """The engines' context length (prompt + output), None when unknown."""
        return self._max_model_len

    async def estimate_input_async(self, parsed: EstimateInput, *, class_name: str) -> Estimate:
        """`estimate_async` of an input a protocol adapter read (`EstimateInput`)."""
        estimate = self.estimate_input_now(parsed, class_name=class_name)
        if estimate is not None:
            return estimate
        return await self.estimate_input_thread(parsed, class_name=class_name)

    async def estimate_input_thread(self, parsed: EstimateInput, *, class_name: str) -> Estimate:
        """The estimate with its text counted in a worker thread (what `estimate_input_now`
        declined)."""
        return self._finish(parsed, await asyncio.to_thread(self._content, parsed), class_name)

    def estimate_input_now(self, parsed: EstimateInput, *, class_name: str) -> Estimate | None:
        """`estimate_input_async` without a coroutine when it needs no worker thread (no more
        than `ASYNC_TEXT_CHARS` of never-counted text, the request path's common case); None
        when it does: then await `estimate_input_thread`."""
        counter = self._counter
        if counter is None or parsed.chars <= ASYNC_TEXT_CHARS:
            return self._finish(parsed, self._content(parsed), class_name)
        counts = counter.count((parsed.pieces, parsed.json_pieces), ASYNC_TEXT_CHARS)
        if counts is None:
            return None
        return self._finish(parsed, (counts[0], counts[1]), class_name)

    def observe(
        self,
        estimate: Estimate,
        *,
        class_name: str,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> float | None:
        """Learn from the usage vLLM returned: corrects the heuristic / chat overhead, records the
        completion tokens for the class p95. Returns the prompt estimate's relative error
        (estimated - actual) / actual, or None when actual is 0."""
        if completion_tokens >= 0:
            per_sequence = -(-completion_tokens // max(1, estimate.sequences))
            self._record_output(class_name, per_sequence)
        if prompt_tokens <= 0:
            return None
        if estimate.source == self.source and estimate.features:
            self._model.observe(estimate.features, prompt_tokens - estimate.exact_prompt_tokens)
        return (estimate.prompt_tokens - prompt_tokens) / prompt_tokens

    def output_p95(self, class_name: str) -> int | None:
        """The class's p95 of completion tokens per sequence, once `MIN_P95_SAMPLES` were seen."""
        return self._p95.get(class_name)

    # -- internals ---------------------------------------------------------------------------

    def _content(self, parsed: EstimateInput) -> tuple[float, float]:
        """(text, JSON) in tokens, or in UTF-8 bytes without a tokenizer."""
        if self._counter is not None:
            counts = self._counter.count((parsed.pieces, parsed.json_pieces)) or [0.0, 0.0]
            return counts[0], counts[1]
        return (
            float(sum(map(_utf8_bytes, parsed.pieces))),
            float(sum(map(_utf8_bytes, parsed.json_pieces))),
        )

    def _finish(
        self, parsed: EstimateInput, content: tuple[float, float], class_name: str
    ) -> Estimate:
        text_prompts = parsed.text_prompts
        exact = parsed.exact_tokens
        if self._counter is not None:
            exact += text_prompts * self._counter.special_tokens
        features = (
            *content,
            1.0 if parsed.chat else 0.0,
            float(parsed.messages),
            float(parsed.tool_calls),
            1.0 if parsed.has_tools else 0.0,
            float(text_prompts),
        )
        predicted = self._model.predict(features)
        prompt = exact + max(0, round(predicted)) if math.isfinite(predicted) else exact

        typical = self._p95.get(class_name)
        if typical is None:
            typical = self._expected.get(class_name, DEFAULT_OUTPUT_TOKENS)
        requested = parsed.requested_output
        output = typical if requested is None else min(requested, typical)
        if parsed.min_output > output:
            output = min(parsed.min_output, requested or parsed.min_output)
        sequences = parsed.sequences
        if self._max_model_len is not None:
            per_prompt = -(-prompt // parsed.prompts)
            output = min(output, max(0, self._max_model_len - per_prompt))
        return Estimate(
            prompt_tokens=prompt,
            output_tokens=output * sequences,
            source=self.source,
            sequences=sequences,
            exact_prompt_tokens=exact,
            features=features,
            requested_output_tokens=requested,
        )

    def _record_output(self, class_name: str, tokens: int) -> None:
        samples = self._samples.get(class_name)
        if samples is None:
            samples = self._samples[class_name] = deque(maxlen=self._window)
        samples.append(tokens)
        since = self._since_p95.get(class_name, 0) + 1
        enough = len(samples) >= MIN_P95_SAMPLES
        if enough and (since >= P95_RECOMPUTE_EVERY or class_name not in self._p95):
            ordered = sorted(samples)
            self._p95[class_name] = ordered[math.ceil(0.95 * len(ordered)) - 1]
            since = 0
        self._since_p95[class_name] = since


def _model_context_tokens(model_path: Path) -> int | None:
    """The model's own context length (`max_position_embeddings` in its `config.json`), which
    vLLM uses when `--max-model-len` is not given; None when unreadable."""
    try:
        value = json.loads((Path(model_path) / "config.json").read_text()).get(
            "max_position_embeddings"
        )
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _load_counter(path: Path) -> _TokenCounter | None:
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        return _TokenCounter(Tokenizer.from_file(str(path)))
    except Exception as exc:  # a corrupt or unsupported file: estimate by bytes instead
        log.warning("cannot load tokenizer %s (%s); estimating prompt tokens by bytes", path, exc)
        return None
