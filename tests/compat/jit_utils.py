"""``jit_utils`` for FlashInfer's test files run through the attncore shim (the sdist does not ship one).

FlashInfer's tests import ``gen_decode_attention_modules`` / ``gen_prefill_attention_modules`` from a
helper module next to them and hand the result to ``flashinfer.jit.build_jit_specs`` in a warm-up
fixture.  attncore compiles kernels on first use, so there is nothing to list: both return an empty
list, whatever the arguments (dtypes, head dims, positional-encoding modes, feature flags).
"""

from __future__ import annotations

from typing import Any, List


def gen_decode_attention_modules(*args: Any, **kwargs: Any) -> List[Any]:
    return []


def gen_prefill_attention_modules(*args: Any, **kwargs: Any) -> List[Any]:
    return []
