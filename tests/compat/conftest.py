"""``conftest.clear_cuda_cache``, which FlashInfer 0.2.14's test_deepseek_mla.py imports from the conftest.py of
FlashInfer's repository (the sdist does not ship it; like ``jit_utils.py``, attncore's own stand-in for a
missing test helper).  It frees cached GPU memory between cases when little is left.  As a conftest of
tests/compat it defines no fixtures or hooks: check_shim.py runs as before."""

from __future__ import annotations

import gc

import torch


def clear_cuda_cache(device, threshold: float = 0.9) -> None:
    """Release the caching allocator's unused blocks when more than ``threshold`` of the GPU is in use."""
    if not torch.cuda.is_available():
        return
    free, total = torch.cuda.mem_get_info(device)
    if total and (total - free) / total > threshold:
        gc.collect()
        torch.cuda.empty_cache()
