"""The prefix lookup's memos give exactly what they memoise: `Pieces.encode` equals the
tokenizer's whole-text encode, and `ChainMemo.keys` equals `chain_keys`, however often a long
prefix repeats and whatever text surrounds the cut points."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from pools.devmodel import make_dev_model
from router.prefix.chain_memo import ChainMemo
from router.prefix.hashing import chain_keys
from router.prefix.prompt import MEMO_PIECE_CHARS, Pieces, _cut_tokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model = make_dev_model(tmp_path_factory.mktemp("model") / "tiny")
    return Tokenizer.from_file(str(model / "tokenizer.json"))


SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"]
LONG = [
    "You are a careful agent. " * 40,
    " leading space, ünïcode ✓ and 12345 digits\n\n" * 20,
    'tool schema {"name": "grep", "q": "<|eot"} ' * 30,  # a special token's start
]
fragment = st.one_of(
    st.sampled_from(SPECIAL),
    st.sampled_from(LONG),
    st.text(alphabet=st.sampled_from(list(" \n\tab<|>_eotü1")), max_size=30),
)


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.lists(fragment, max_size=10).map("".join), min_size=1, max_size=4))
def test_pieces_equal_the_whole_encode(tokenizer: Tokenizer, texts: list[str]) -> None:
    pieces = Pieces(tokenizer, max_tokens=2_000)  # small: evictions happen too
    for text in texts + texts:  # every text twice: the second time its long pieces are kept
        expected = tokenizer.encode(text, add_special_tokens=False).ids
        assert pieces.encode(text) == expected
    assert pieces.memo_tokens <= 2_000


def test_a_seen_prefix_is_not_encoded_again(tokenizer: Tokenizer) -> None:
    system = "<|start_header_id|>system<|end_header_id|>\n\n" + LONG[0] + "<|eot_id|>"
    pieces = Pieces(tokenizer)
    pieces.encode(system + "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
    kept = pieces.memo_tokens
    assert kept >= len(tokenizer.encode(LONG[0], add_special_tokens=False).ids)
    text = system + "<|start_header_id|>user<|end_header_id|>\n\nbye<|eot_id|>"
    assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
    assert pieces.memo_tokens == kept  # the user turn is short: nothing new kept
    assert len(LONG[0]) >= MEMO_PIECE_CHARS


def test_cut_points_only_where_the_split_is_certain() -> None:
    plain = AddedToken("<|a|>", special=True, normalized=False)
    stripping = AddedToken("<|b|>", special=True, normalized=False, lstrip=True)
    normalized = AddedToken("<|c|>", special=True, normalized=True)
    not_special = AddedToken("<|d|>", special=False, normalized=False)
    assert _cut_tokens([plain, stripping, normalized, not_special]) == ["<|a|>"]
    # another added token holding it past its start, or ending in a prefix of it
    assert _cut_tokens([plain, AddedToken("x<|a|>", special=True, normalized=False)]) == ["x<|a|>"]
    assert "<|a|>" not in _cut_tokens([plain, AddedToken("q<|", special=False)])
    # one starting with it that strips on its left reaches into the piece before
    longer = AddedToken("<|a|>z", special=True, normalized=False, lstrip=True)
    assert _cut_tokens([plain, longer]) == []


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 300_000), max_size=64),
    tails=st.lists(st.lists(st.integers(0, 300_000), max_size=40), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.sampled_from(["vllm-none-hash", "0", "1234"]),
)
def test_chain_memo_equals_the_chain(
    prefix: list[int], tails: list[list[int]], block_size: int, seed: str
) -> None:
    memo = ChainMemo(max_tokens=64)  # small: evictions happen too
    for tail in tails + tails:
        ids = prefix + tail
        assert memo.keys(ids, block_size, seed) == chain_keys(ids, block_size, seed)
    assert memo.memo_tokens <= 64
    assert memo.keys([2**40] * 4, 2, seed) == chain_keys([2**40] * 4, 2, seed)
