"""The engine side of `admission.prefill_slice_tokens` (docs/admission.md section 8, issue 26
item 2): bound how many prompt tokens one request prefills in an engine step, so a chat
prompt that arrives while a long agent prefill runs shares steps with slices of it, not with
2,048-token chunks.

vLLM V1 schedules its RUNNING requests first in every step: a running chunked prefill takes
up to the step's whole token budget (`--max-num-batched-tokens`, 2,048 on a CPU server) step
after step, and a newly arrived prompt gets what is left. `--long-prefill-token-threshold N`
caps what one request prefills per step at N while another request is scheduled (vLLM lifts
the cap when a request is alone), so every step leaves budget for the newcomer and ends
sooner. Decodes are unaffected; a long prefill takes more, smaller steps.

The engines gpupool starts (`local`, `ray`) get the flag on every instance: which instance is
split between pools changes at run time (the rebalancer), a vLLM argument does not. Engines
gpupool does not start (`static`, `kubernetes`) are refused by the config
(`pools/config/schema.py`): give them the flag where they are started.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SLICE_FLAG", "prefill_slice_args", "with_prefill_slice"]

SLICE_FLAG = "--long-prefill-token-threshold"


def prefill_slice_args(tokens: int | None) -> tuple[str, ...]:
    """The vLLM arguments for `admission.prefill_slice_tokens` (none for None)."""
    return () if tokens is None else (SLICE_FLAG, str(tokens))


def with_prefill_slice(vllm_args: Sequence[str], tokens: int | None) -> tuple[str, ...]:
    """`vllm_args` with the slice's arguments added before the user's own (the config refuses
    a slice when they set the flag themselves: `Config._prefill_slice_engines`)."""
    return (*prefill_slice_args(tokens), *vllm_args)
