"""``flashinfer.jit.attention.pytorch`` in the attncore shim.

``gen_pod_module(...)`` (and ``gen_batch_mla_module``, ``gen_batch_prefill_module``,
``gen_single_prefill_module``, for test_deepseek_mla.py) is called by FlashInfer's tests only to list a module for
``build_jit_specs`` (a no-op here).  It returns an inert placeholder that records the request; it is
never a kernel, and nothing runs it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Tuple


class WarmupPlaceholder(NamedTuple):
    """What a FlashInfer test asked to pre-build; attncore builds on first use instead."""

    generator: str
    args: Tuple[Any, ...]
    kwargs: Tuple[Tuple[str, Any], ...]


def gen_pod_module(*args, **kwargs) -> WarmupPlaceholder:
    return WarmupPlaceholder("gen_pod_module", tuple(args), tuple(sorted(kwargs.items())))


# test_deepseek_mla.py's warm-up fixture imports these three from flashinfer.jit.attention (same role)
def gen_batch_mla_module(*args, **kwargs) -> WarmupPlaceholder:
    return WarmupPlaceholder("gen_batch_mla_module", tuple(args), tuple(sorted(kwargs.items())))


def gen_batch_prefill_module(*args, **kwargs) -> WarmupPlaceholder:
    return WarmupPlaceholder("gen_batch_prefill_module", tuple(args), tuple(sorted(kwargs.items())))


def gen_single_prefill_module(*args, **kwargs) -> WarmupPlaceholder:
    return WarmupPlaceholder("gen_single_prefill_module", tuple(args), tuple(sorted(kwargs.items())))


def __getattr__(name: str):
    raise AttributeError(f"flashinfer.jit.attention.pytorch.{name}: not provided by the attncore shim "
                         f"(FlashInfer JIT internals; attncore compiles on demand)")
