"""The Triton backend's workspaces and CUDA-graph mode (issue 15 items 2 and 3).

CPU (Triton's interpreter): a graph-mode re-plan keeps every address, grid and scalar a captured
launch baked in, and the first plan's launchers ("the captured graph") run on the re-planned batch
pass the golden check; capacity errors; every plan buffer is a view of the caller's workspaces; the
gather yields to a small float workspace; a plan whose tables another plan overwrote re-sends them.
GPU (``-m gpu``): replay == eager on every op x feature (attncore.testing's graph runner), no device
allocation in plan()/run() over 100 cycles, and the public wrappers' memory stays flat.
"""

import itertools
import os
import random
import zlib

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from attncore.core.problem import AttentionProblem  # noqa: E402
from attncore.core.workspace import WorkspaceTooSmall  # noqa: E402
from attncore.backends.triton.backend import TritonBackend  # noqa: E402
from attncore.testing import inputs, runner  # noqa: E402

cpu_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests")
TILES16 = dict(block_m=16, block_n=16, num_warps=1, num_stages=1)


def _problem(op, device="cpu", **kw):
    dt = kw.pop("dtype", torch.float16)
    base = dict(op=op, device_type=device, q_dtype=dt, kv_dtype=kw.pop("kv_dtype", dt), out_dtype=dt,
                num_qo_heads=4, num_kv_heads=2, head_dim_qk=32, head_dim_vo=32, cuda_graph=True,
                page_size=16 if op in ("batch_decode", "batch_prefill_paged") else None,
                mask="causal" if op == "batch_prefill_paged" else "none")
    if device == "cuda":
        base.update(compute_capability=tuple(torch.cuda.get_device_capability()), num_qo_heads=8,
                    head_dim_qk=128, head_dim_vo=128)
    base.update(kw)
    return AttentionProblem(**base)


FEATURES = {  # problem fields of each feature the backend declares
    "base": {}, "lse": dict(return_lse=True), "window": dict(window_left=5), "softcap": dict(soft_cap=True),
    "alibi": dict(pos_encoding="ALIBI"), "rope": dict(pos_encoding="ROPE_LLAMA"), "sinks": dict(sinks=True),
    "fp8": dict(kv_dtype=torch.float8_e4m3fn, fp8_scales=True), "custom": dict(mask="custom"),
}
OPS = ("batch_decode", "batch_prefill_paged", "batch_prefill_ragged", "single_prefill")


def _record(monkeypatch, modules=None):
    """Every kernel launch of ``modules`` (default: attention and merge) as (kernel, grid, args with tensors as
    data pointers, constexprs)."""
    from attncore.backends.triton.kernels import attention, merge

    log = []
    for mod in modules or (attention, merge):
        real = mod.fast_launcher

        def wrapped(fn, grid, cx, _real=real):
            inner = _real(fn, grid, cx)

            def launch(*args):
                log.append((fn.__name__ if hasattr(fn, "__name__") else str(fn), tuple(grid), tuple(
                    ("ptr", a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args),
                    tuple(sorted(cx.items()))))
                return inner(*args)
            return launch
        monkeypatch.setattr(mod, "fast_launcher", wrapped)
    return log


def _emulated_replay(be, p, seed, monkeypatch):
    """The graph runner on the CPU: plan A, run (launchers prepared: what a capture bakes in), re-plan B
    into A's buffers, write B's inputs into A's tensors, rerun A's launchers; they must pass the
    golden check of B, and plan B's own launches must bake in the same grids, pointers and scalars."""
    log = _record(monkeypatch)
    a, b, _, _ = runner._graph_pair(p, "edge", seed, "cpu")  # as the conformance suite's graph cases
    bases: dict = {}
    runner._into_fixed(a.meta, bases)
    plan_a = be.plan(p, a.meta)
    be.run(plan_a, a.args)
    launch_a = list(log)
    fwd, mrg = next(iter(plan_a.launch_cache.values()))
    plan_b = be.plan(p, runner._into_fixed(b.meta, bases))
    for dst, src in zip(a.storages, b.storages):
        dst.copy_(src)
    if a.args.sinks is not None and b.args.sinks is not None:
        a.args.sinks.copy_(b.args.sinks)
    a.out_buf.fill_(float("nan"))
    if a.lse_buf is not None:
        a.lse_buf.fill_(float("nan"))
    mb = plan_a.meta.packed_mask if plan_a.mask_mode == 2 else None
    fwd(a.args.q, a.args.k, a.args.v, a.args.out, a.args.lse, mb, a.args.sinks)  # the "replay"
    mrg(a.args.out, a.args.lse, a.args.sinks)
    errs = runner.check_result(b, inputs.expected(b), out_buf=a.out_buf.clone(),
                               lse_buf=None if a.lse_buf is None else a.lse_buf.clone(),
                               what=f"replay of plan A (kv {a.kv_lens}) after re-plan B (kv {b.kv_lens}): ")
    assert not errs, errs
    del log[:]
    be.run(plan_b, a.args)
    assert log == launch_a, "plan B's launches differ from the captured plan A's"
    for name in ("work", "counts", "merge_table", "part_o", "part_lse", "slopes"):
        ta, tb = getattr(plan_a, name), getattr(plan_b, name)
        assert (ta is None) == (tb is None) and (ta is None or ta.data_ptr() == tb.data_ptr()), name
    assert plan_a.cfg == plan_b.cfg and plan_a.graph is plan_b.graph
    return plan_a, plan_b


@cpu_only
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("feature", ["base", "lse", "window", "alibi", "sinks", "custom"])
def test_graph_replan_replays_on_cpu(op, feature, monkeypatch):
    p = _problem(op, **FEATURES[feature])
    _emulated_replay(TritonBackend(config=TILES16), p, seed=zlib.crc32(f"{op}{feature}".encode()) % 1000,
                     monkeypatch=monkeypatch)


@cpu_only
@pytest.mark.parametrize("feature", ["softcap", "rope", "fp8"])
def test_graph_replan_replays_on_cpu_more_features(feature, monkeypatch):
    _emulated_replay(TritonBackend(config=TILES16), _problem("batch_decode", **FEATURES[feature]), seed=7,
                     monkeypatch=monkeypatch)


@cpu_only
def test_graph_mode_split_kv_and_merge_from_device_counts(monkeypatch):
    # a long decode splits (kv_chunk): partial rows and the merge table come from the schedule, the
    # persistent merge runs over the device row count; the re-plan splits differently
    be = TritonBackend(config=TILES16, kv_chunk=16)
    plan_a, plan_b = _emulated_replay(be, _problem("batch_decode", return_lse=True, sinks=True), seed=3,
                                      monkeypatch=monkeypatch)
    assert plan_a.stats["graph"]["grid"] == plan_b.stats["graph"]["grid"]
    assert plan_a.num_merge_rows > 0 or plan_b.num_merge_rows > 0
    assert plan_a.schedule.part_rows <= plan_a.graph.cap_part


@cpu_only
def test_graph_capacity_error_names_it():
    be = TritonBackend(config=TILES16)
    p = _problem("batch_prefill_ragged")
    small = inputs.build(p, "", 1, "cpu", shapes=([1, 1], [5, 5]))
    bases: dict = {}
    be.plan(p, runner._into_fixed(small.meta, bases))
    big = inputs.build(p, "", 2, "cpu", shapes=([40, 40], [50, 50]))
    with pytest.raises(ValueError, match=r"needs \d+ work items \(row tiles\), more than the capacity \d+"):
        be.plan(p, runner._into_fixed(big.meta, bases))


def _build(p, shapes, seed=1):
    return inputs.build(p, "", seed, "cpu", shapes=shapes)


@cpu_only
def test_graph_mode_splits_only_as_far_as_the_float_workspace_holds():
    be = TritonBackend(config=TILES16, kv_chunk=16)
    p = _problem("batch_decode", return_lse=True)
    b = _build(p, ([1, 1], [80, 64]))
    runner._into_fixed(b.meta, {})
    b.meta.workspace = torch.zeros(1024, dtype=torch.uint8)  # no room for two partial rows
    plan = be.plan(p, b.meta)
    assert plan.graph.cap_part == 0 and plan.num_merge_rows == 0 and plan.max_splits == 1
    be.run(plan, b.args)
    assert not runner.check_result(b, inputs.expected(b))


@cpu_only
@pytest.mark.parametrize("graph", [False, True])
def test_plan_buffers_are_views_of_the_workspaces(graph):
    be = TritonBackend(config=TILES16, kv_chunk=16)
    p = _problem("batch_decode", cuda_graph=graph, pos_encoding="ALIBI", return_lse=True)
    fws = torch.zeros(1 << 20, dtype=torch.uint8)
    iws = torch.zeros(1 << 16, dtype=torch.uint8)
    addrs = None
    for kv in ([40, 3, 70], [17, 90, 1]):
        b = _build(p, ([1, 1, 1], kv))
        b.meta.workspace, b.meta.int_workspace = fws, iws
        plan = be.plan(p, b.meta)

        def inside(t, buf):
            return buf.data_ptr() <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= \
                buf.data_ptr() + buf.numel()
        for name in ("work", "counts", "merge_table", "slopes"):
            assert inside(getattr(plan, name), iws), name
        for name in ("part_o", "part_lse"):
            assert inside(getattr(plan, name), fws), name
        be.run(plan, b.args)
        errs = runner.check_result(b, inputs.expected(b))
        assert not errs, errs
        now = tuple(getattr(plan, n).data_ptr() for n in ("work", "counts", "merge_table", "slopes", "part_o"))
        assert addrs is None or now == addrs  # regions at fixed offsets of the caller's buffers
        addrs = now


@cpu_only
def test_too_small_workspace_is_an_error_naming_the_bytes():
    be = TritonBackend(config=TILES16, kv_chunk=16)
    p = _problem("batch_decode", cuda_graph=False)
    b = _build(p, ([1, 1], [80, 64]))
    b.meta.int_workspace = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(WorkspaceTooSmall, match=r"int_workspace_buffer: triton needs \d+ bytes .*work \["):
        be.plan(p, b.meta)
    b.meta.int_workspace = None
    b.meta.workspace = torch.zeros(300, dtype=torch.uint8)
    with pytest.raises(WorkspaceTooSmall, match=r"float_workspace_buffer: triton needs \d+ bytes .*part_o \["):
        be.plan(p, b.meta)


@cpu_only
def test_gather_yields_to_a_small_float_workspace():
    # the paged gather is an optimisation: where it does not fit, the generic kernel reads the pages
    dense = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False)
    be = TritonBackend(dense=dense, gather=True)
    p = _problem("batch_prefill_paged", cuda_graph=False, head_dim_qk=64, head_dim_vo=64)  # dense: d 64/128
    b = _build(p, ([20, 9], [33, 40]))
    b.meta.workspace = torch.zeros(4096, dtype=torch.uint8)
    plan = be.plan(p, b.meta)
    assert plan.gather is None and not plan.dense and "float workspace" in plan.stats["gather_skipped"]
    be.run(plan, b.args)
    assert not runner.check_result(b, inputs.expected(b))
    b.meta.workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    plan = be.plan(p, b.meta)
    assert plan.gather is not None and plan.dense and "gather_skipped" not in plan.stats
    be.run(plan, b.args)
    assert not runner.check_result(b, inputs.expected(b))


@cpu_only
def test_plan_overwritten_by_another_plan_resends_its_tables():
    be = TritonBackend(config=TILES16, kv_chunk=16)
    p = _problem("batch_decode", cuda_graph=False, return_lse=True)
    iws = torch.zeros(1 << 16, dtype=torch.uint8)
    a, b = _build(p, ([1, 1], [70, 5]), seed=1), _build(p, ([1, 1, 1], [3, 50, 20]), seed=2)
    a.meta.int_workspace = b.meta.int_workspace = iws
    plan_a = be.plan(p, a.meta)
    plan_b = be.plan(p, b.meta)  # same int workspace: overwrites plan A's tables
    assert plan_a.work.data_ptr() == plan_b.work.data_ptr()
    for built, plan in ((a, plan_a), (b, plan_b), (a, plan_a)):
        built.out_buf.fill_(float("nan"))
        be.run(plan, built.args)
        errs = runner.check_result(built, inputs.expected(built))
        assert not errs, errs


# ------------------------------------------------------------------------------ GPU
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")


@gpu
@needs_cuda
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_graph_replay_equals_eager_gpu(op, feature):
    from attncore.testing.cases import Case

    dt = torch.bfloat16
    p = _problem(op, device="cuda", dtype=dt, **FEATURES[feature])
    be = TritonBackend()
    if not be.supports(p):
        pytest.skip(f"not claimed: {be.reasons(p)}")
    runner.run_cuda_graph(Case(family="cuda_graph", id=f"triton-{op}-{feature}-graph", backend=be, problem=p,
                               device="cuda", tag="edge", seed=zlib.crc32(f"{op}{feature}".encode()) % 997))


@gpu
@needs_cuda
@pytest.mark.parametrize("op", ["batch_decode", "batch_prefill_paged", "batch_prefill_ragged"])
@pytest.mark.parametrize("graph", [False, True])
def test_no_device_allocation_in_plan_or_run_gpu(op, graph):
    """100 plan/run cycles of different batch sizes and lengths through the caller's workspaces: plan()
    and run() make no device allocation (the metas are built outside the counted region)."""
    be = TritonBackend()
    p = _problem(op, device="cuda", dtype=torch.bfloat16, cuda_graph=graph)
    fws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    iws = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    rng = random.Random(0)
    bases: dict = {}
    for i in range(101):
        bsz = 4 if graph else rng.randint(1, 8)  # graph mode: the batch size is fixed
        qo = [1] * bsz if op == "batch_decode" else [rng.randint(1, 64) for _ in range(bsz)]
        if graph and op != "batch_decode":
            qo = [32] * bsz
        kv = [rng.randint(q, 2000) for q in qo]
        if graph and op == "batch_prefill_ragged":
            kv = runner._recompose(4000, bsz, i)
            kv = [max(k, 0) for k in kv]
        b = inputs.build(p, "", i, "cuda", shapes=(qo, kv), min_pages=300 if graph else 0)
        if graph:
            runner._into_fixed(b.meta, bases)
        b.meta.workspace, b.meta.int_workspace = fws, iws
        plan = None  # the previous plan (and the inputs it references) is freed outside the measured window
        torch.cuda.synchronize()
        n0 = torch.cuda.memory_stats()["allocation.all.allocated"]
        m0 = torch.cuda.memory_allocated()
        plan = be.plan(p, b.meta)
        be.run(plan, b.args)
        torch.cuda.synchronize()
        if i > 0:  # the first cycle may compile and warm up
            assert torch.cuda.memory_stats()["allocation.all.allocated"] == n0, f"cycle {i}: plan/run allocated"
            assert torch.cuda.memory_allocated() == m0
        if i % 25 == 0:
            assert not runner.check_result(b, inputs.expected(b))


@gpu
@needs_cuda
def test_public_wrappers_memory_flat_gpu():
    """Public decode and paged-prefill wrappers, 100 plan/run cycles of varying batches: memory flat."""
    import attncore as flashinfer

    fws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(fws, "NHD", backend="triton")
    pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(fws, "NHD", backend="triton")
    page, hq, hkv, d, pool = 16, 32, 8, 128, 2048
    cache = torch.randn(pool, 2, page, hkv, d, dtype=torch.bfloat16, device="cuda")
    rng = random.Random(1)
    base = None
    for i in range(101):
        bsz = rng.randint(1, 16)
        npages = [rng.randint(1, 64) for _ in range(bsz)]
        # host index tensors (FlashInfer's convention): the API copies them into the int workspace, so
        # what stays on the device between cycles is the wrappers' own, not the caller's varying inputs
        indptr = torch.tensor([0, *itertools.accumulate(npages)], dtype=torch.int32)
        indices = torch.randperm(pool)[:int(indptr[-1])].to(torch.int32)
        last = torch.tensor([rng.randint(1, page) for _ in range(bsz)], dtype=torch.int32)
        dec.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16)
        out = dec.run(torch.randn(bsz, hq, d, dtype=torch.bfloat16, device="cuda"), cache)
        qo = [rng.randint(1, 32) for _ in range(bsz)]
        qo_indptr = torch.tensor([0, *itertools.accumulate(qo)], dtype=torch.int32)
        pre.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=True, q_data_type=torch.bfloat16)
        out = pre.run(torch.randn(sum(qo), hq, d, dtype=torch.bfloat16, device="cuda"), cache)
        del out
        torch.cuda.synchronize()
        if i == 1:
            base = torch.cuda.memory_allocated()
        elif i > 1:
            assert torch.cuda.memory_allocated() == base, f"cycle {i}: {torch.cuda.memory_allocated() - base} bytes"


_COMPILE = r'''
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attncore.backends.triton.kernels.attention import _attn_fwd
from attncore.backends.triton.kernels.merge import _merge_splits

def sig_of(fn, cx, ptrs, floats):
    sig = {}
    for n in fn.arg_names:
        sig[n] = "constexpr" if n in cx else ptrs.get(n, "fp32" if n in floats else "i32")
    return sig

ptrs = {n: "*bf16" for n in ("Q", "K", "V", "Out")}
ptrs.update({n: "*fp32" for n in ("Lse", "TmpO", "TmpLse", "Sinks", "Slopes")})
ptrs.update({n: "*i32" for n in ("Work", "Counts", "QoIndptr", "KvIndptr", "KvIndices", "KvLens", "MaskIndptr",
                                 "Merge")})
ptrs["MaskBytes"] = "*u8"
ptrs["Out"] = "*bf16"
floats = {"qk_scale", "cap_inv", "cap_l2", "out_scale", "rope_log2_theta", "rope_inv_scale"}
cx = dict(G=4, HEAD_DIM=128, BLOCK_D=128, HALF=64, BLOCK_HALF=64, BLOCK_M=16, BLOCK_N=64, PAGE=16, MASK_MODE=1,
          HAS_WINDOW=True, SOFT_CAP=True, ALIBI=True, ROPE=False, HAS_SINKS=True, STORE_LSE=True,
          DOT_PREC="tf32", PREFETCH=False, DOT_F16=False, KV_ADDR=1, PERSISTENT=True,
          HEAD_DIM_VO=128, BLOCK_DV=128)
target = GPUTarget("cuda", 90, 32)
triton.compile(ASTSource(fn=_attn_fwd, signature=sig_of(_attn_fwd, cx, ptrs, floats), constexprs=cx), target=target,
               options=dict(num_warps=4, num_stages=2))
mx = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16, HAS_SINKS=True, STORE_LSE=True, PERSISTENT=True)
triton.compile(ASTSource(fn=_merge_splits, signature=sig_of(_merge_splits, mx, ptrs, floats), constexprs=mx),
               target=target, options=dict(num_warps=4))
print("compiled")
'''


def test_persistent_kernels_compile_for_sm90():
    """Graph mode's persistent loops compile to a cubin for sm90 (Triton's bundled ptxas; no GPU needed),
    so a construct the interpreter accepts but the compiler rejects shows up on the CPU."""
    import subprocess
    import sys

    nvidia = pytest.importorskip("triton.backends.nvidia")
    if not os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")):
        pytest.skip("Triton's bundled ptxas is absent")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


@cpu_only
def test_graph_state_follows_its_caller_not_an_address():
    # a new caller (a new fixed qo_indptr buffer) gets its own capacities even at a freed caller's address
    from attncore.backends.triton import plan as tp

    be = TritonBackend(config=TILES16)
    p = _problem("batch_prefill_ragged")
    small = inputs.build(p, "", 1, "cpu", shapes=([1, 1], [5, 5]))
    bases: dict = {}
    st = be.plan(p, runner._into_fixed(small.meta, bases)).graph
    assert st.anchor() is bases["qo_indptr"]
    key = tp._GRAPH_STATES.key(p, small.meta)
    big = inputs.build(p, "", 2, "cpu", shapes=([40, 40], [50, 50]))
    other = {"qo_indptr": torch.zeros(4096, dtype=torch.int32)}
    st.anchor = lambda: other["qo_indptr"]  # as if the first caller died and another took its address
    tp._GRAPH_STATES.states[key] = st
    plan = be.plan(p, runner._into_fixed(big.meta, bases))  # the same buffers: would be a capacity error...
    assert plan.graph is not st and plan.graph.nnz_q == 80  # ...but the state was another caller's
