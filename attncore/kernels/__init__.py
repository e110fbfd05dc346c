"""Triton kernels behind the public modules (not backends): the fused state merge of
:mod:`attncore.cascade` and the rotary embedding of :mod:`attncore.rope`.  Each is imported on first use,
so that ``TRITON_INTERPRET`` can still be set before ``@triton.jit`` decorates it."""
