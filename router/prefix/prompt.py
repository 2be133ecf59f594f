"""The token ids a chat request's prompt becomes in vLLM, so its block hash chain can be looked
up in the engines' indexes (pure apart from reading the model's files once).

vLLM (0.32, renderers/hf.py `safe_apply_chat_template`, renderers/chat_utils.py) renders the
messages with the model's chat template the way transformers does (a sandboxed jinja2
environment with `trim_blocks`, `lstrip_blocks`, a `tojson` that keeps non-ASCII, the
tokenizer's special tokens as variables, `add_generation_prompt=True`), then encodes the text
with `add_special_tokens=False` (the template writes BOS itself). Before rendering it:
- gives each message's content in the template's format: "openai" (a list of
  `{"type": "text", "text": ...}` parts) when the template loops over a message's content,
  else "string" (the text parts joined with newlines);
- parses an assistant message's `tool_calls[].function.arguments` from JSON text to a mapping.

`ChatPrompt.token_ids(body)` returns None where the router cannot know the ids exactly (no chat
template or tokenizer, a non-text part such as an image, a request naming its own
`chat_template`, `continue_final_message`, a `cache_salt`, which changes vLLM's hashes): such
a request is placed without the index.

Encoding is nearly all of the cost (a 32k-character prompt: 0.25 ms to render, ~16-30 ms to
encode), and a chat's long part (a system prompt, tool schemas, the turns so far) repeats from
request to request. `Pieces` memoises it exactly: a Hugging Face tokenizer splits the text at
its added tokens *before* normalising, pre-tokenising and modelling, and encodes each stretch
between them on its own; so the rendered text cut just before an occurrence of a special token
the chat template writes (`<|start_header_id|>`, `<|im_start|>`, ...) encodes as the
concatenation of its pieces' encodings, and a long piece seen before (keyed by its text) costs
a dict probe. A token is a cut point only where that holds whatever surrounds it (`_cut_tokens`:
matched on the raw text, not stripping or word-bound on its left, no other added token
overlapping its start), and only for a tokenizer without truncation or padding; otherwise the
text is encoded whole, as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

__all__ = ["ChatPrompt", "Pieces"]

log = logging.getLogger(__name__)

_OPENAI_FORMAT = re.compile(
    r"for\s+\w+\s+in\s+(?:\w+\s*\[\s*['\"]content['\"]\s*\]|\w+\.content\b|content\b)"
)
_REFUSED_KEYS = ("chat_template", "continue_final_message", "cache_salt", "prompt_embeds")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


MEMO_PIECE_CHARS = 512  # a piece shorter than this is encoded with its neighbours, not kept
MEMO_TOKENS = 1 << 20  # the memo's bound, in tokens kept (~40 MB: 36 bytes a token + text)


def _cut_tokens(added: Sequence[AddedToken]) -> list[str]:
    """The special tokens before whose every occurrence the tokenizer's own split falls,
    whatever the text around it: matched on the raw text (not `normalized`), not stripping or
    word-bound on its left (which would reach into the piece before), and no other added token
    that could take a match across its first character (one holding it past its start, or
    ending in a proper prefix of it), or that starts with it and strips or is word-bound."""
    out = []
    for token in added:
        text = token.content
        if not token.special or token.normalized or token.lstrip or token.single_word or not text:
            continue
        clash = any(
            text in o[1:]
            or any(o.endswith(text[:k]) for k in range(1, len(text)))
            or (o.startswith(text) and (other.lstrip or other.single_word))
            for other in added
            if other is not token and (o := other.content)
        )
        if not clash:
            out.append(text)
    return out


class Pieces:
    """A tokenizer's `encode(text, add_special_tokens=False).ids`, memoising long pieces of the
    text between cut points (`_cut_tokens`). Thread safe: worker threads share it."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int = MEMO_TOKENS) -> None:
        self._tokenizer = tokenizer
        cuts = (
            []
            if tokenizer.truncation or tokenizer.padding
            else _cut_tokens(list(tokenizer.get_added_tokens_decoder().values()))
        )
        self._split = (
            re.compile("(?=" + "|".join(map(re.escape, sorted(cuts, key=len))) + ")")
            if cuts
            else None
        )
        self._memo: OrderedDict[str, list[int]] = OrderedDict()
        self._memo_tokens = 0
        self._max_tokens = max_tokens
        self._lock = threading.Lock()

    @property
    def memo_tokens(self) -> int:
        return self._memo_tokens

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._encode(text)
        out: list[int] = []
        pending: list[str] = []  # short or unseen pieces in a row: one encode call
        for piece in self._split.split(text):
            if len(piece) < MEMO_PIECE_CHARS:
                pending.append(piece)
                continue
            with self._lock:
                ids = self._memo.get(piece)
                if ids is not None:
                    self._memo.move_to_end(piece)
            if ids is None:
                ids = self._encode(piece)
                self._keep(piece, ids)
            if pending:
                out += self._encode("".join(pending))
                pending.clear()
            out += ids
        if pending:
            out += self._encode("".join(pending))
        return out

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids) if text else []

    def _keep(self, piece: str, ids: list[int]) -> None:
        if len(ids) > self._max_tokens:
            return
        with self._lock:
            if piece in self._memo:
                return
            self._memo[piece] = ids
            self._memo_tokens += len(ids)
            while self._memo_tokens > self._max_tokens:
                _, dropped = self._memo.popitem(last=False)
                self._memo_tokens -= len(dropped)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])  # an AddedToken written out
    return None


class ChatPrompt:
    """A model's chat template and tokenizer. `token_ids` is CPU work (~1 us a character with
    the dev tokenizer): call it through `asyncio.to_thread` for long prompts."""

    def __init__(self, template: str, tokenizer: Tokenizer, special: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(template)
        self._openai_format = bool(_OPENAI_FORMAT.search(template))
        self._pieces = Pieces(tokenizer)
        self._special = dict(special)

    @classmethod
    def from_model_dir(cls, path: Path) -> ChatPrompt | None:
        """From an HF folder's `tokenizer.json` and `tokenizer_config.json` (`chat_template`,
        or a `chat_template.jinja` beside it); None, with the reason logged, without them."""
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
            template = config.get("chat_template")
            jinja_file = path / "chat_template.jinja"
            if not isinstance(template, str) and jinja_file.is_file():
                template = jinja_file.read_text()
            if not isinstance(template, str):
                log.info("prefix cache: %s has no single chat template; not hashing chats", path)
                return None
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as err:  # OSError, bad JSON; tokenizers raises plain Exception
            log.info("prefix cache: no chat prompts from %s (%s)", path, err)
            return None
        special = {
            key: text
            for key, value in config.items()
            if key.endswith("_token") and (text := _token_text(value)) is not None
        }
        return cls(template, tokenizer, special)

    def token_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt token ids vLLM's chat endpoint makes of this request body, or None."""
        messages = body.get("messages")
        if not isinstance(messages, list) or any(k in body for k in _REFUSED_KEYS):
            return None
        if body.get("add_generation_prompt", True) is not True:
            return None
        conversation = []
        for message in messages:
            converted = self._message(message)
            if converted is None:
                return None
            conversation.append(converted)
        kwargs = body.get("chat_template_kwargs")
        extra = dict(kwargs) if isinstance(kwargs, Mapping) else {}
        try:
            text = self._template.render(
                **{
                    **self._special,
                    **extra,
                    "messages": conversation,
                    "tools": body.get("tools") or None,
                    "documents": None,
                    "add_generation_prompt": True,
                }
            )
        except jinja2.TemplateError:
            return None
        return self._pieces.encode(text)

    def _message(self, message: Any) -> dict[str, Any] | None:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return None
        out = dict(message)
        content = message.get("content")
        texts: list[str] = []
        if isinstance(content, str):
            texts = [content]
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                    texts.append(str(part.get("text", "")))
                else:
                    return None  # an image, audio, a file: vLLM adds placeholders and hashes
        elif content is not None:
            return None
        if content is not None:
            if self._openai_format:
                out["content"] = [{"type": "text", "text": t} for t in texts]
            else:
                out["content"] = "\n".join(texts)
        calls = message.get("tool_calls")
        if out["role"] == "assistant" and isinstance(calls, list):
            if not calls:
                out.pop("tool_calls")
            else:
                out["tool_calls"] = [self._call(c) for c in calls]
        return out

    @staticmethod
    def _call(call: Any) -> Any:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            return call
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                function["arguments"] = json.loads(arguments)
        return {**call, "function": function}
