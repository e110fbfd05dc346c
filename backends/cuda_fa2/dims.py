"""The head dims cuda_fa2's kernels are built for: one home for the build (specs.py) and the capabilities
(backend.py), which imports this at start-up without the build module."""

HEAD_DIMS = (64, 128, 256)  # the FA2 tiles (prefill, prefill64, decode)
POD90_HEAD_DIMS = (64, 128)  # pod90, the Hopper POD kernel
PREFILL90_HEAD_DIMS = POD90_HEAD_DIMS + (256,)  # prefill90, the Hopper prefill kernel
# head dims qk / vo that differ: prefill90's warp-specialized builds only (specs.Fa2Key.head_dim_vo)
PREFILL90_QK_VO = ((192, 128),)
