"""attncore: a modular, backend-plugin attention framework with a FlashInfer-compatible API.

``import attncore as flashinfer`` works for the prefill, decode, POD, cascade, page and
quantization APIs.  Every entry point takes ``backend=`` ("auto" or a backend name); see
``attncore.explain`` and ``attncore info`` for what is chosen and why.
"""

__version__ = "0.1.0"

from attncore import cascade, decode, mla, page, pod, prefill, quantization, rope  # noqa: E402
from attncore.core.backend import AttnParams, Backend, BatchMeta, RunArgs  # noqa: E402
from attncore.core.capabilities import Capabilities, Reason  # noqa: E402
from attncore.cascade import merge_state, merge_state_in_place, merge_states  # noqa: E402
from attncore.cascade.wrappers import (  # noqa: E402
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from attncore.decode import (  # noqa: E402
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    single_decode_with_kv_cache,
    xqa_batch_decode_with_kv_cache,
)
from attncore.core.hooks import hookimpl  # noqa: E402
from attncore.mla import BatchMLAPagedAttentionWrapper  # noqa: E402
from attncore.page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens  # noqa: E402
from attncore.pod import BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper  # noqa: E402
from attncore.prefill import (  # noqa: E402
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from attncore.core.problem import AttentionProblem  # noqa: E402
from attncore.quantization import packbits, segment_packbits  # noqa: E402
from attncore.rope import (  # noqa: E402
    apply_llama31_rope,
    apply_llama31_rope_inplace,
    apply_llama31_rope_pos_ids,
    apply_llama31_rope_pos_ids_inplace,
    apply_rope,
    apply_rope_inplace,
    apply_rope_pos_ids,
    apply_rope_pos_ids_inplace,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)
from attncore.core.registry import available_backends, get_backend, register_backend, unregister_backend  # noqa: E402
from attncore.core.selector import BackendSelectionError, explain, select  # noqa: E402

__all__ = [
    "AttentionProblem", "AttnParams", "Backend", "BackendSelectionError", "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "BatchMeta", "BatchPODWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper", "Capabilities", "PODWithPagedKVCacheWrapper", "Reason", "RunArgs",
    "append_paged_kv_cache", "available_backends", "explain", "get_backend", "get_batch_indices_positions",
    "get_seq_lens", "hookimpl", "merge_state", "merge_state_in_place", "merge_states", "packbits",
    "register_backend", "segment_packbits", "select", "single_decode_with_kv_cache", "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse", "unregister_backend", "xqa_batch_decode_with_kv_cache",
    "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace", "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
]
__all__ += ["BatchMLAPagedAttentionWrapper"]
__all__ += ["BatchDecodeWithSharedPrefixPagedKVCacheWrapper", "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
            "MultiLevelCascadeAttentionWrapper"]
