"""The API side of "the workspace is the only scratch" (issue 15 item 2): every wrapper hands its float
workspace and its own int workspace to the backend (BatchMeta.workspace / int_workspace),
reset_workspace_buffer replaces both, the one-call functions use a cached per-device workspace (xqa: the
caller's workspace_buffer), a workspace too small is WorkspaceTooSmall at plan() naming the bytes, and a
carving backend allocates nothing across plan/run cycles after the first plan."""

import gc

import pytest
import torch

import attncore
from attncore.core import plan_cache
from attncore.core.workspace import WorkspaceTooSmall

from _carving_backend import CarvingBackend

H, HKV, D, PAGE = 4, 2, 16, 4


@pytest.fixture
def carving(clean_registry):
    be = CarvingBackend()
    clean_registry.register_backend(be, origin="test")
    return be


def _table(b, seed=0, max_pages=3):
    g = torch.Generator().manual_seed(seed)
    npages = torch.randint(1, max_pages + 1, (b,), generator=g)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), npages.cumsum(0)]).to(torch.int32)
    indices = torch.randperm(int(indptr[-1]), generator=g).to(torch.int32)
    last = torch.randint(1, PAGE + 1, (b,), generator=g).to(torch.int32)
    return indptr, indices, last


def _within(view, buf):
    return buf.data_ptr() <= view.data_ptr() < buf.data_ptr() + buf.numel()


def _plan(kind, w, b, seed=0, **kw):
    indptr, indices, last = _table(b, seed)
    if kind == "decode":
        w.plan(indptr, indices, last, H, HKV, D, PAGE, q_data_type=torch.float16, **kw)
    elif kind == "paged":
        qo = torch.arange(b + 1, dtype=torch.int32) * 2
        w.plan(qo, indptr, indices, last, H, HKV, D, PAGE, q_data_type=torch.float16, **kw)
    else:
        qo = torch.arange(b + 1, dtype=torch.int32) * 2
        kv = torch.arange(b + 1, dtype=torch.int32) * 5
        w.plan(qo, kv, H, HKV, D, q_data_type=torch.float16, **kw)


WRAPPERS = {"decode": attncore.BatchDecodeWithPagedKVCacheWrapper,
            "paged": attncore.BatchPrefillWithPagedKVCacheWrapper,
            "ragged": attncore.BatchPrefillWithRaggedKVCacheWrapper}


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_wrapper_hands_both_workspaces_to_the_backend(carving, kind):
    ws = torch.empty(1 << 16, dtype=torch.uint8)
    w = WRAPPERS[kind](ws, "NHD", backend="carving_test")
    own = w._int_workspace_buffer
    assert own.dtype == torch.uint8 and own.numel() == 8 << 20 and own.device == ws.device
    _plan(kind, w, 3)
    meta = carving.metas[-1]
    assert meta.workspace is ws and meta.int_workspace is not None and _within(meta.int_workspace, own)
    part, work = carving.carved[-1]
    assert _within(part, ws) and _within(work, own)
    # reset_workspace_buffer replaces both; the next plan carves from the new ones
    ws2, int2 = torch.empty(1 << 16, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8)
    w.reset_workspace_buffer(ws2, int2)
    _plan(kind, w, 2, seed=1)
    part, work = carving.carved[-1]
    assert carving.metas[-1].workspace is ws2 and _within(part, ws2) and _within(work, int2)
    assert not _within(work, own)
    # float only: the int workspace stays
    ws3 = torch.empty(1 << 16, dtype=torch.uint8)
    w.reset_workspace_buffer(ws3)
    _plan(kind, w, 2, seed=2)
    assert _within(carving.carved[-1][0], ws3) and _within(carving.carved[-1][1], int2)


def test_reset_workspace_buffer_checks_the_int_buffer():
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8))
    with pytest.raises(TypeError, match="int_workspace_buffer: got dtype fp32, expected u?int8|int_workspace_buffer"):
        w.reset_workspace_buffer(torch.empty(64, dtype=torch.uint8), torch.empty(16, dtype=torch.float32))
    with pytest.raises(TypeError, match="float_workspace_buffer"):
        w.reset_workspace_buffer("not a tensor")


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_too_small_workspace_is_an_error_at_plan_naming_the_bytes(carving, kind):
    carving.float_bytes = 1 << 14
    w = WRAPPERS[kind](torch.empty(1024, dtype=torch.uint8), "NHD", backend="carving_test")
    with pytest.raises(WorkspaceTooSmall, match=r"float_workspace_buffer: carving_test needs \d+ bytes .* the buffer "
                                                r"has 1024 .*partials"):
        _plan(kind, w, 3)
    assert w._planned is None  # nothing half-planned
    carving.float_bytes, carving.int_entries_per_req = 256, 1000
    w.reset_workspace_buffer(torch.empty(1 << 12, dtype=torch.uint8), torch.empty(4096, dtype=torch.uint8))
    with pytest.raises(WorkspaceTooSmall, match=r"int_workspace_buffer: carving_test needs \d+ bytes .*work \[3, 1000\]"):
        _plan(kind, w, 3)
    w.reset_workspace_buffer(torch.empty(1 << 12, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8))
    # the index tables (or, where the caller's int32 tensors on the device are read in place, the backend's
    # own tables in what is left) do not fit: the error names the buffer and the bytes
    with pytest.raises(WorkspaceTooSmall, match=r"int_workspace_buffer: (the batch's index tables need \d+ bytes .*the "
                                                r"buffer has 16|carving_test needs \d+ bytes .*the buffer has \d+ )"):
        _plan(kind, w, 3)


def test_one_call_functions_use_the_cached_device_workspace(carving):
    q, k = torch.randn(3, H, D).half(), torch.randn(9, HKV, D).half()
    attncore.single_prefill_with_kv_cache(q, k, k, causal=True, backend="carving_test")
    meta = carving.metas[-1]
    ws = plan_cache.one_call_workspace(torch.device("cpu"))
    assert meta.workspace is ws and meta.int_workspace is None  # a cached one-call plan owns its tables
    attncore.single_decode_with_kv_cache(q[0], k, k, backend="carving_test")
    assert carving.metas[-1].workspace is ws


def test_one_call_workspace_grows_when_a_plan_needs_more(carving, monkeypatch):
    dev = torch.device("cpu")
    monkeypatch.setitem(plan_cache._ONE_CALL_WS, dev, torch.empty(1024, dtype=torch.uint8))
    carving.float_bytes = 3000
    q, k = torch.randn(2, H, D).half(), torch.randn(5, HKV, D).half()
    out = attncore.single_prefill_with_kv_cache(q, k, k, backend="carving_test")
    assert plan_cache.one_call_workspace(dev).numel() == 4096 and carving.metas[-1].workspace.numel() == 4096
    ref = attncore.single_prefill_with_kv_cache(q, k, k, backend="reference")
    assert torch.equal(out, ref)


def test_xqa_uses_the_callers_workspace_buffer(carving):
    b, pages = 2, 3
    cache = torch.randn(b * pages, 2, PAGE, HKV, D).half()
    bt = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    q = torch.randn(b, H, D).half()
    ws = torch.zeros(1 << 14, dtype=torch.uint8)
    out = attncore.xqa_batch_decode_with_kv_cache(q, cache, ws, bt, seq, 12, backend="carving_test")
    assert carving.metas[-1].workspace is ws and _within(carving.carved[-1][0], ws)
    ref = attncore.xqa_batch_decode_with_kv_cache(q, cache, torch.zeros(1 << 14, dtype=torch.uint8), bt, seq, 12,
                                                  backend="reference")
    assert torch.equal(out, ref)
    with pytest.raises(WorkspaceTooSmall, match=r"float_workspace_buffer: carving_test needs \d+ bytes"):
        attncore.xqa_batch_decode_with_kv_cache(q, cache, torch.zeros(64, dtype=torch.uint8), bt, seq, 12,
                                                backend="carving_test")


class _CountAllocs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that create storage."""

    NEW = {"empty.memory_format", "empty_strided.default", "new_empty.default", "new_empty_strided.default",
           "zeros.default", "ones.default", "full.default", "empty_like.default", "clone.default",
           "_to_copy.default", "cat.default", "new_zeros.default", "lift_fresh.default"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if "." in func.__name__ else f"{func.__name__}.default"
        if name in self.NEW or func._overloadpacket.__name__ in ("empty", "empty_strided"):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["decode", "paged"])
def test_carving_backend_allocates_nothing_after_the_first_plan(carving, kind):
    """Host index tensors, outputs given: plan()/run() over batches of other sizes and lengths create no
    tensor storage (the batch's index tables live in the wrapper's int workspace)."""
    w = WRAPPERS[kind](torch.empty(1 << 16, dtype=torch.uint8), "NHD", backend="carving_test")
    cache = torch.randn(64, 2, PAGE, HKV, D).half()
    outs = {b: torch.empty(b * (1 if kind == "decode" else 2), H, D).half() for b in range(1, 6)}
    qs = {b: torch.randn_like(o) for b, o in outs.items()}
    carving.compute = False
    _plan(kind, w, 3)
    w.run(qs[3], cache, out=outs[3])
    for i in range(12):
        b = 1 + i % 5
        table = _table(b, seed=i)
        qo = torch.arange(b + 1, dtype=torch.int32) * 2
        with _CountAllocs() as c:
            if kind == "decode":
                w.plan(*table, H, HKV, D, PAGE, q_data_type=torch.float16)
            else:
                w.plan(qo, *table, H, HKV, D, PAGE, q_data_type=torch.float16)
            w.run(qs[b], cache, out=outs[b])
        assert c.seen == [], f"cycle {i} (batch {b}) allocated: {c.seen}"


# ----------------------------------------------------------------------------- GPU
GPU_BACKENDS = ["auto", "triton", "cuda_fa2", "xqa"]


def _gpu_backend(name, op):
    from attncore.core import registry

    if name != "auto" and name not in registry.available_backends():
        pytest.skip(f"{name} is not available here")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "paged", "ragged"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_memory_flat_across_plan_run_cycles(backend, kind):
    """After the first plan, 100 plan/run cycles with other batch sizes and lengths allocate no device memory
    (host index tensors, outputs given): every buffer comes from the workspaces."""
    if backend == "xqa" and kind != "decode":
        pytest.skip("xqa serves decode only")
    _gpu_backend(backend, kind)
    dev, dt, hq, hkv, d, page = "cuda", torch.bfloat16, 32, 8, 128, 16
    w = WRAPPERS[kind](torch.zeros(256 << 20, dtype=torch.uint8, device=dev), "NHD", backend=backend)
    cache = torch.randn(64 * 128, 2, page, hkv, d, device=dev, dtype=dt)  # room for 64 requests of 2047 tokens
    kv_all = torch.randn(64 * 2048, hkv, d, device=dev, dtype=dt)
    rows = 2 if kind != "decode" else 1
    outs = {b: torch.empty(b * rows, hq, d, device=dev, dtype=dt) for b in range(1, 65)}
    qs = {b: torch.randn_like(o) for b, o in outs.items()}
    g = torch.Generator().manual_seed(0)

    def cycle(b):
        lens = torch.randint(1, 2048, (b,), generator=g)
        if kind == "ragged":
            kv = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
            w.plan(torch.arange(b + 1, dtype=torch.int32) * rows, kv, hq, hkv, d, causal=True, q_data_type=dt)
            w.run(qs[b], kv_all[:int(kv[-1])], kv_all[:int(kv[-1])], out=outs[b])
            return
        npages = (lens + page - 1) // page
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), npages.cumsum(0)]).to(torch.int32)
        indices = torch.randperm(cache.shape[0], generator=g)[:int(indptr[-1])].to(torch.int32)
        last = (lens - (npages - 1) * page).to(torch.int32)
        if kind == "decode":
            w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dt)
        else:
            w.plan(torch.arange(b + 1, dtype=torch.int32) * rows, indptr, indices, last, hq, hkv, d, page,
                   causal=True, q_data_type=dt)
        w.run(qs[b], cache, out=outs[b])

    for b in (64, 1, 17):  # first plans: JIT builds, kernel caches, one-time buffers
        cycle(b)
    gc.collect()  # earlier tests' garbage (wrappers in reference cycles) must not be freed inside the window
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for i in range(100):
        cycle(1 + (i * 37) % 64)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_plan_with_host_index_tensors_does_not_synchronize(backend):
    """plan() with host-side index tensors (FlashInfer's convention) makes no device synchronization."""
    _gpu_backend(backend, "decode")
    dev, dt = "cuda", torch.bfloat16
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(128 << 20, dtype=torch.uint8, device=dev),
                                                    backend=backend)
    indptr, indices, last = _table(8, seed=3, max_pages=8)
    w.plan(indptr, indices, last, 32, 8, 128, PAGE, q_data_type=dt)  # first plan: builds, caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w.plan(*_table(8, seed=4, max_pages=8), 32, 8, 128, PAGE, q_data_type=dt)
    finally:
        torch.cuda.set_sync_debug_mode("default")
