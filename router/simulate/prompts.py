"""Prompt text of about a requested number of tokens, from random words.

With the model's `tokenizer.json` (the `tokenizers` library), `PromptMaker` encodes random words
and cuts the ids at the requested count, so the content is that many tokens (re-encoding after
the chat template may shift it by a token or two at the joins). Without one it writes
`n / tokens_per_word` words, with `tokens_per_word` measured on a tokenizer or calibrated
from an endpoint's `usage.prompt_tokens` (`benchmarks.compare.calibrate_prompts`).

Chat requests also carry template tokens around each message (a few for Llama-style
templates: `message_overhead_tokens`, calibrated the same way, `TEMPLATE_TOKENS_PER_MESSAGE`
until then); `content_tokens` subtracts them so the prompt the engine counts lands near the
requested size. Random words keep prompts from sharing prefixes, so the prefix cache does
not flatter one target over another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "TEMPLATE_TOKENS_PER_MESSAGE",
    "VOCABULARY",
    "PromptMaker",
    "find_tokenizer",
]

# <|start_header_id|> role <|end_header_id|> "\n\n" ... <|eot_id|> (the BOS once more).
TEMPLATE_TOKENS_PER_MESSAGE = 7

_WORDS = (
    "the of and to in is that for it as with was on be by this are or from at an which have "
    "not but had they all were there been one has more their if will would about can other "
    "into some these than time only its when what up out could so may two such them first "
    "over model token cache block pool agent tool request response stream server engine "
    "router memory latency batch prefill decode context prompt queue tenant run step result "
    "error function call search file read write list open close python json value key name "
    "type data user system assistant message content answer question please thanks hello "
    "world return import class self none true false print range while else try report "
    "table chart build test check plan code line page note task team city river green blue "
    "light sound water paper music story night morning house garden window street market"
)
VOCABULARY: tuple[str, ...] = tuple(_WORDS.split(" "))


def find_tokenizer(model: str, explicit: str | None = None) -> str | None:
    """The tokenizer.json to size prompts with: `explicit`, else the dev model's, else None."""
    if explicit:
        return explicit
    candidate = Path(".gpupool/models") / model / "tokenizer.json"
    return str(candidate) if candidate.is_file() else None


class PromptMaker:
    """Writes random-word text of ~n tokens. Deterministic for a given rng state."""

    def __init__(
        self,
        tokenizer_path: str | None = None,
        tokens_per_word: float = 1.3,
        message_overhead_tokens: int = TEMPLATE_TOKENS_PER_MESSAGE,
        *,
        write_text: bool = True,
    ) -> None:
        """`write_text=False` (no tokenizer only): draw the same random numbers, so a plan
        gets the same sizes and times, but write no words (the simulator needs only sizes,
        and a day of traffic's text takes longer to write than to simulate)."""
        if tokenizer_path and not write_text:
            raise ValueError("write_text=False needs the words-based estimate (no tokenizer)")
        self._write_text = write_text
        self._tokenizer: Any = None
        self.tokens_per_word = tokens_per_word
        self.message_overhead_tokens = message_overhead_tokens
        if tokenizer_path:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(tokenizer_path)
            self.tokens_per_word = self._measure_tokens_per_word()

    def content_tokens(self, prompt_tokens: int, messages: int = 1) -> int:
        """Content tokens to write so a `messages`-message chat prompt counts ~`prompt_tokens`
        (the template's tokens per message and the BOS subtracted)."""
        return max(1, prompt_tokens - self.message_overhead_tokens * messages - 1)

    @property
    def exact(self) -> bool:
        """True when a tokenizer cuts the text at exactly the requested count."""
        return self._tokenizer is not None

    def _words(self, rng: np.random.Generator, n_words: int) -> str:
        idx = rng.integers(0, len(VOCABULARY), size=max(1, n_words))
        return " ".join(VOCABULARY[i] for i in idx) if self._write_text else ""

    def _measure_tokens_per_word(self) -> float:
        sample = self._words(np.random.default_rng(12345), 2000)
        return self.count_tokens(sample) / 2000.0

    def count_tokens(self, text: str) -> int:
        """Tokens in `text` (the tokenizer's count, or the words-based estimate)."""
        if self._tokenizer is None:
            return round(len(text.split()) * self.tokens_per_word)
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, rng: np.random.Generator, n_tokens: int) -> str:
        """Random words of ~`n_tokens` tokens (exactly that many ids with a tokenizer)."""
        n_tokens = max(1, n_tokens)
        if self._tokenizer is None:
            return self._words(rng, max(1, round(n_tokens / self.tokens_per_word)))
        # 10 % more words than needed, then cut the ids.
        text = self._words(rng, int(n_tokens / self.tokens_per_word * 1.1) + 2)
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        while len(ids) < n_tokens:  # rare: the sample ran short
            text += " " + self._words(rng, n_tokens)
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        out: str = self._tokenizer.decode(ids[:n_tokens])
        return out
