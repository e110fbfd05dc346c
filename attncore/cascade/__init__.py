"""Cascade attention, FlashInfer's ``flashinfer.cascade``: merging partial attention states
(:mod:`attncore.cascade.merge`, with its fused kernel) and the cascade wrappers built on those merges
(:mod:`attncore.cascade.wrappers`)."""

from attncore.cascade.merge import merge_state, merge_state_in_place, merge_states

__all__ = [
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper", "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper", "merge_state", "merge_state_in_place", "merge_states",
]

_WRAPPERS = ("MultiLevelCascadeAttentionWrapper", "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
             "BatchPrefillWithSharedPrefixPagedKVCacheWrapper")


def __getattr__(name):  # the wrappers, imported on first use (they import the prefill/decode modules)
    if name in _WRAPPERS:
        from attncore.cascade import wrappers

        return getattr(wrappers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
