"""cuda_fa2's fused POD (issue 16: prefill and decode in one launch of prefill90's POD kernel, backends/cuda_fa2/pod.py).

CPU: the plan with the library faked (tests/test_cuda_fa2.py's cpu_patches): the pod90 kernel key, both parts
unsplit (no merge launch) where a part alone would split, the order table, the one launch's two structs, and the
refusals.  GPU (sm_90): both outputs and both LSEs against the fp64 golden, outputs poisoned first, edge shapes
included, through the POD wrappers with the backend forced."""

import pytest
import torch

import attncore
from attncore.core import current
from attncore.core.backend import AttnParams, BatchMeta, RunArgs
from attncore.core.problem import AttentionProblem, PODBatch, PODDeclined, PODRunArgs, pod_problem
from attncore.backends.cuda_fa2 import pod
from attncore.backends.cuda_fa2.backend import CudaFa2Backend
from attncore.testing.golden import golden_and_baseline, max_error, tolerance

from test_cuda_fa2 import FakeLib, cpu_patches

HQ, HKV, D, PAGE = 8, 2, 128, 16


def test_interleave_keeps_each_part_in_order_and_level():
    p, d = [4.0, 3.0, 2.0, 1.0], [10.0] * 6
    order = pod.interleave(p, d)
    assert sorted(e for e in order if e >= 0) == [e for e in order if e >= 0] == [0, 1, 2, 3]
    assert [~e for e in order if e < 0] == list(range(6))
    done_p = done_d = 0.0  # each part's share issued stays within one item of the other's
    for e in order:
        if e >= 0:
            done_p += p[e]
        else:
            done_d += d[~e]
        assert abs(done_p / sum(p) - done_d / sum(d)) <= max(max(p) / sum(p), max(d) / sum(d)) + 1e-9
    ahead = pod.interleave(p, d, weight=4.0)  # the prefill counted 4x: its items come earlier
    assert [i for i, e in enumerate(ahead) if e >= 0] < [i for i, e in enumerate(order) if e >= 0]
    assert pod.interleave([], [1.0, 2.0]) == [~0, ~1] and pod.interleave([1.0], []) == [0]


def _problems(mask_p="causal", window_d=-1, graph=False, d=D):
    base = dict(device_type="cuda", compute_capability=(9, 0), q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                out_dtype=torch.bfloat16, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=d, head_dim_vo=d,
                kv_layout="NHD", cuda_graph=graph)
    pp = AttentionProblem(op="single_prefill", page_size=None, mask=mask_p, **base)
    pd = AttentionProblem(op="batch_decode", page_size=PAGE, mask="causal", window_left=window_d, **base)
    return pod_problem("pod", pp, pd)


def _batch(qo=300, decode=((1, 5000), (1, 40)), mask_p="causal", window_d=-1):
    mp = BatchMeta(batch_size=1, qo_indptr=torch.tensor([0, qo], dtype=torch.int32), qo_indptr_host=[0, qo],
                   kv_indptr=torch.tensor([0, qo], dtype=torch.int32), kv_indptr_host=[0, qo], kv_lens_host=[qo],
                   params=AttnParams(sm_scale=0.1), mask=mask_p)
    pages = [-(-kv // PAGE) for _, kv in decode]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    qo_d = [0]
    for q, _ in decode:
        qo_d.append(qo_d[-1] + q)
    md = BatchMeta(batch_size=len(decode), qo_indptr=torch.tensor(qo_d, dtype=torch.int32), qo_indptr_host=qo_d,
                   kv_indptr=torch.tensor(indptr, dtype=torch.int32), kv_indptr_host=indptr,
                   kv_indices=torch.arange(indptr[-1], dtype=torch.int32), kv_lens_host=[kv for _, kv in decode],
                   page_size=PAGE, params=AttnParams(sm_scale=0.1, window_left=window_d), mask="causal")
    return PODBatch(prefill=mp, decode=md)


class PodFakeLib(FakeLib):
    def run_pod(self, p0, p1, order, n, stream):
        from attncore.backends.cuda_fa2 import binding

        FakeLib.launched.append((binding.Fa2Params.from_buffer_copy(p0), binding.Fa2Params.from_buffer_copy(p1), n))


def _cpu_pod_plan(problem, batch, weight=1.0, fuse="always", decode_chunk=None):
    import unittest.mock as um

    from attncore.backends.cuda_fa2 import binding

    FakeLib.launched = []
    libs = {}
    b = CudaFa2Backend()
    with cpu_patches(), um.patch.object(binding, "get_library",
                                        lambda key, dev: libs.setdefault(key, PodFakeLib(key, (128, 128)))), \
            um.patch.object(pod, "cuda_device", lambda d, who: torch.device("cpu", 0)):
        plan = pod.plan_pod(b, problem, batch, weight, fuse, decode_chunk)
    return b, plan


def test_plan_is_one_unsplit_launch_of_the_pod_kernel_cpu():
    problem, batch = _problems(), _batch()
    b, plan = _cpu_pod_plan(problem, batch, decode_chunk=0)
    pre, dec = plan.parts
    assert plan.lib.key.config == "pod90" and plan.lib.key.pipe and plan.lib.key.ws  # ragged prefill: pipelined
    assert plan.lib.key.mask == "causal"
    # the 5000-key decode request would split alone (test_cuda_fa2.test_split_kv_hints_cpu); with chunk 0 it does not
    assert not pre.needs_merge and not dec.needs_merge
    assert pre.num_items == -(-300 * (HQ // HKV) // 128) and dec.num_items == 2
    order = plan.order.tolist()
    assert plan.num_ctas == len(order) == pre.num_items + dec.num_items
    assert sorted(e for e in order if e >= 0) == list(range(pre.num_items))
    assert sorted(~e for e in order if e < 0) == list(range(dec.num_items))
    # run: both parts' structs in one launch, each with its own tensors
    q_p = torch.randn(300, HQ, D, dtype=torch.bfloat16)
    k_p, v_p = (torch.randn(300, HKV, D, dtype=torch.bfloat16) for _ in range(2))
    cache = torch.randn(dec.meta.kv_indptr_host[-1], 2, PAGE, HKV, D, dtype=torch.bfloat16)
    q_d = torch.randn(2, HQ, D, dtype=torch.bfloat16)
    args = PODRunArgs(prefill=RunArgs(q_p, k_p, v_p, torch.empty_like(q_p), lse=torch.empty(300, HQ)),
                      decode=RunArgs(q_d, cache[:, 0], cache[:, 1], torch.empty_like(q_d)))
    import unittest.mock as um
    with um.patch.object(current, "stream", lambda index: 0):
        pre.device = dec.device = plan.device = torch.device("cpu")
        b.run(plan, args)
    (p0, p1, n), = FakeLib.launched
    assert n == plan.num_ctas
    assert p0.q == q_p.data_ptr() and p0.k == k_p.data_ptr() and p0.lse == args.prefill.lse.data_ptr()
    assert p1.q == q_d.data_ptr() and p1.k == cache[:, 0].data_ptr() and not p1.lse
    assert p0.page_size == 0 and p1.page_size == PAGE and p1.kv_indices
    assert b.relaunch(plan, args) is None


def test_decode_chunk_splits_the_decode_part_and_merges_after_the_launch_cpu():
    """decode_chunk: the decode requests' KV in items of that many tokens (whole pages), their partials merged by a
    second launch; the prefill part stays unsplit."""
    problem, batch = _problems(), _batch()
    assert pod.decode_chunk_for([5000, 40]) == pod.DECODE_CHUNK and pod.decode_chunk_for([4096, 40]) == 0
    b, plan = _cpu_pod_plan(problem, batch)  # by default: the 5000-key request in DECODE_CHUNK-key items
    assert plan.parts[1].num_items == -(-5000 // pod.DECODE_CHUNK) + 1 and plan.stats["decode_chunk"] == pod.DECODE_CHUNK
    b, plan = _cpu_pod_plan(problem, batch, decode_chunk=1024)
    pre, dec = plan.parts
    assert not pre.needs_merge and dec.needs_merge
    assert dec.num_items == -(-5000 // 1024) + 1  # the 40-key request: one item
    order = plan.order.tolist()
    assert plan.num_ctas == len(order) == pre.num_items + dec.num_items
    assert sorted(~e for e in order if e < 0) == list(range(dec.num_items))
    q_p = torch.randn(300, HQ, D, dtype=torch.bfloat16)
    k_p, v_p = (torch.randn(300, HKV, D, dtype=torch.bfloat16) for _ in range(2))
    cache = torch.randn(dec.meta.kv_indptr_host[-1], 2, PAGE, HKV, D, dtype=torch.bfloat16)
    q_d = torch.randn(2, HQ, D, dtype=torch.bfloat16)
    out_d = torch.empty_like(q_d)
    args = PODRunArgs(prefill=RunArgs(q_p, k_p, v_p, torch.empty_like(q_p)),
                      decode=RunArgs(q_d, cache[:, 0], cache[:, 1], out_d))
    import unittest.mock as um
    with um.patch.object(current, "stream", lambda index: 0):
        pre.device = dec.device = plan.device = torch.device("cpu")
        b.run(plan, args)
    (p0, p1, n), merged = FakeLib.launched
    assert n == plan.num_ctas and p1.o_part and merged.o == out_d.data_ptr() and merged.num_rows == 1


@pytest.mark.parametrize("what, problem, batch, match", [
    ("graph mode", _problems(graph=True), _batch(), "CUDA-graph mode"),
    ("decode window", _problems(window_d=64), _batch(window_d=64), "decode part: sliding window"),
    ("head dim", _problems(d=256), _batch(), "head dim 256"),
])
def test_plan_declines_what_the_kernel_does_not_serve_cpu(what, problem, batch, match):
    with pytest.raises(PODDeclined, match=match):
        _cpu_pod_plan(problem, batch)


@pytest.mark.parametrize("qo, decode, fuses", [(512, ((1, 4096),) * 8, True), (2048, ((1, 1024),) * 8, True),
                                               (2048, ((1, 1024),) * 32, True), (2048, ((1, 4096),) * 8, True),
                                               (2048, ((1, 4096),) * 9, False), (2048, ((1, 1024),) * 33, False),
                                               (4096, ((1, 1024),) * 8, False), (2048, ((1, 4096),) * 64, False),
                                               (512, ((1, 16384),), False)])
def test_auto_fuses_inside_the_measured_region_only_cpu(qo, decode, fuses):
    """auto (``fuse="auto"``) fuses where the one launch was measured to win (pod.MEASURED_WINS) and elsewhere
    declines, saying where the region is."""
    problem, batch = _problems(), _batch(qo=qo, decode=decode)
    if fuses:
        _, plan = _cpu_pod_plan(problem, batch, fuse="auto")
        assert plan.num_ctas > 0
    else:
        with pytest.raises(PODDeclined, match=r"outside the measured region .*MEASURED_WINS in backends/cuda_fa2/pod"):
            _cpu_pod_plan(problem, batch, fuse="auto")


@pytest.mark.parametrize("gpu, sizes, fuses", [
    ("NVIDIA H100 80GB HBM3", (2048, 8, 4096), True), ("NVIDIA H200", (2048, 8, 4096), False),
    ("NVIDIA H200", (512, 8, 4096), False), ("NVIDIA H200", (2048, 32, 1024), True),
    ("NVIDIA GH200 480GB", (2048, 8, 4096), True)])  # a model word, not a substring: GH200 takes the default rows
def test_measured_region_follows_the_gpu_model_cpu(monkeypatch, gpu, sizes, fuses):
    """Each GPU model has its own measured rows (the H200's decode is faster: 8 x 4k beside a prefill lost there);
    a batch's plan reads them for the batch's device, and the refusal names the rows it used."""
    from attncore.core import problem as problem_mod

    monkeypatch.setattr(problem_mod, "gpu_name", lambda device=None: gpu)
    why = pod.outside_region(*sizes)
    assert (why is None) == fuses, why
    if not fuses:
        assert "MEASURED_WINS in backends/cuda_fa2/pod.py, H200 rows" in why
        qo, b, kv = sizes
        with pytest.raises(PODDeclined, match="H200 rows"):
            _cpu_pod_plan(_problems(), _batch(qo=qo, decode=((1, kv),) * b), fuse="auto")


def test_capabilities_name_the_decode_part_cpu():
    b = CudaFa2Backend()
    ok = _problems()
    assert not [r for r in b.reasons(ok) if r.axis not in ("device", "availability")]
    bad = _problems(window_d=32)
    assert any(r.axis == "decode part" and "sliding window" in str(r) for r in b.reasons(bad))
    old = ok.replace(compute_capability=(8, 0))
    assert any(r.axis == "compute_capability" for r in b.reasons(old))


# ----------------------------------------------------------------------------- GPU (sm_90)
def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the pod90 kernel runs on sm_90 only")


@pytest.fixture
def always_fuse(monkeypatch):
    """cuda_fa2 fuses every batch its POD kernel serves (not only inside the measured region)."""
    from attncore.core import registry

    monkeypatch.setattr(registry.get_backend("cuda_fa2"), "pod_fuse", "always")


def _poison() -> None:
    """The caching allocator's free blocks full of NaN: an output element the kernel does not write stays NaN."""
    x = torch.full((256 << 20,), float("nan"), device="cuda")
    del x


def _paged(kv_lens, page, dt, g, d):
    """(indptr, indices, last, cache, per-request (k, v) on the CPU) of a shuffled paged NHD cache."""
    pages = [-(-n // page) for n in kv_lens]
    indptr = torch.tensor([0] + [sum(pages[:i + 1]) for i in range(len(pages))], dtype=torch.int32)
    total = int(indptr[-1])
    indices = torch.randperm(max(total, 1), generator=g)[:total].to(torch.int32)
    last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    cache = torch.randn(max(total, 1), 2, page, HKV, d, generator=g).to(dt)
    kv = []
    for i, n in enumerate(kv_lens):
        ids = indices[indptr[i]:indptr[i + 1]].long()
        c = cache[ids]
        kv.append((c[:, 0].reshape(-1, HKV, d)[:n], c[:, 1].reshape(-1, HKV, d)[:n]))
    return indptr, indices, last, cache, kv


def _close(out, lse, q, k, v, dt, causal):
    go, gl, bo, bl = golden_and_baseline(q, k, v, dtype=dt, causal=causal)
    assert max_error(out.cpu().double(), go) <= tolerance(bo, go, dt)
    assert max_error(lse.cpu().double(), gl) <= tolerance(bl, gl, torch.float32)


POD_CASES = {  # prefill qo, prefill kv, causal, decode kv lens, page, head dim, dtype
    "pd-like": (700, 700, True, (3000, 17, 0, 1, 640), 16, 128, torch.bfloat16),
    "qo>kv prefill": (300, 100, False, (200, 33), 16, 128, torch.bfloat16),
    "one decode, page 1": (129, 400, False, (999,), 1, 64, torch.float16),
}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case, layout", [(c, "NHD") for c in POD_CASES] + [("pd-like", "HND")])
@pytest.mark.parametrize("decode_chunk", [0, 256])
def test_gpu_pod_fused_in_one_launch_matches_golden(case, layout, decode_chunk, always_fuse, monkeypatch):
    """decode_chunk 256: the decode part's requests split into items of 256 keys, merged by a second launch."""
    from attncore.core import registry

    monkeypatch.setattr(registry.get_backend("cuda_fa2"), "pod_decode_chunk", decode_chunk)
    qo, kv_p, causal, kv_d, page, d, dt = POD_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    indptr, indices, last, cache, kv = _paged(kv_d, page, dt, g, d)
    q_p = torch.randn(qo, HQ, d, generator=g).to(dt)
    k_p, v_p = (torch.randn(kv_p, HKV, d, generator=g).to(dt) for _ in range(2))
    q_d = torch.randn(len(kv_d), HQ, d, generator=g).to(dt)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), layout,
                                            backend="cuda_fa2")
    w.plan(indptr, indices, last, HQ, HKV, d, page, q_data_type=dt)
    _poison()
    (out_p, lse_p), (out_d, lse_d) = w.run(q_p.cuda(), k_p.cuda(), v_p.cuda(), q_d.cuda(), cache.cuda(),
                                           causal_p=causal, return_lse_p=True, return_lse_d=True)
    assert w.mode == "fused" and w.fused_reason is None, w.fused_reason
    _close(out_p, lse_p, q_p, k_p, v_p, dt, causal)
    for i, (k, v) in enumerate(kv):
        _close(out_d[i:i + 1], lse_d[i:i + 1], q_d[i:i + 1], k, v, dt, True)


@pytest.mark.gpu
@needs_sm90
def test_gpu_batch_pod_fused_matches_golden(always_fuse):
    """BatchPOD: both parts paged (the prefill part's plain loop), ragged prefill requests, a kv-0 decode row."""
    dt, d, page = torch.bfloat16, 128, 16
    g = torch.Generator().manual_seed(7)
    kv_p = (900, 1, 64)
    ip, xp, lp, cache_p, kvp = _paged(kv_p, page, dt, g, d)
    kv_d = (1000, 0, 77)
    idd, xd, ld, cache_d, kvd = _paged(kv_d, page, dt, g, d)
    qo_indptr_p = torch.tensor([0, 300, 301, 365], dtype=torch.int32)
    qo_indptr_d = torch.arange(4, dtype=torch.int32)
    q_p = torch.randn(365, HQ, d, generator=g).to(dt)
    q_d = torch.randn(3, HQ, d, generator=g).to(dt)
    w = attncore.BatchPODWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                 backend="cuda_fa2")
    w.plan(qo_indptr_p, ip, xp, lp, qo_indptr_d, idd, xd, ld, HQ, HKV, d, page, q_data_type=dt)
    _poison()
    (out_p, lse_p), (out_d, lse_d) = w.run(q_p.cuda(), cache_p.cuda(), q_d.cuda(), cache_d.cuda(), causal_p=True,
                                           return_lse=True)
    assert w.mode == "fused" and w.fused_reason is None, w.fused_reason
    for i, (k, v) in enumerate(kvp):
        a, b = int(qo_indptr_p[i]), int(qo_indptr_p[i + 1])
        _close(out_p[a:b], lse_p[a:b], q_p[a:b], k, v, dt, True)
    for i, (k, v) in enumerate(kvd):
        _close(out_d[i:i + 1], lse_d[i:i + 1], q_d[i:i + 1], k, v, dt, True)


def test_explain_pod_sizes_says_whether_the_fused_op_fuses_cpu(monkeypatch):
    """``attncore explain --op pod --pod-sizes ...``: the fused op auto picked either fuses batches of these sizes or
    composes them, with its measured region's reason (the selection itself needs a GPU: the line alone here)."""
    import importlib
    from types import SimpleNamespace

    from attncore.core import registry

    cli = importlib.import_module("attncore.cli.main")  # the module (the package's ``main`` is its function)
    monkeypatch.setattr(registry, "get_backend", lambda name: CudaFa2Backend())  # chosen on a GPU; none here

    ex = SimpleNamespace(chosen="cuda_fa2", problem=_problems())
    assert cli._pod_fused_line(SimpleNamespace(pod_sizes="512,512,8,1024"), ex) == \
        "pod fused: cuda_fa2 fuses these sizes (one launch)"
    line = cli._pod_fused_line(SimpleNamespace(pod_sizes="2048,2048,64,4096"), ex)
    assert line.startswith("pod fused: cuda_fa2 composes these sizes: prefill 2048 tokens + decode 64 x up to 4096")
    assert "MEASURED_WINS in backends/cuda_fa2/pod.py" in line
    on_cpu = SimpleNamespace(chosen="cuda_fa2", problem=_problems().replace(device_type="cpu"))
    assert cli._pod_fused_line(SimpleNamespace(pod_sizes="512,512,8,1024"), on_cpu).endswith("from the whole batch")


def test_plan_names_the_bytes_a_small_int_workspace_lacks_cpu():
    import dataclasses

    from attncore.core.workspace import WorkspaceTooSmall

    problem, batch = _problems(), _batch()
    small = PODBatch(prefill=batch.prefill, decode=dataclasses.replace(batch.decode,
                                                                       int_workspace=torch.empty(512, dtype=torch.uint8)))
    with pytest.raises(WorkspaceTooSmall, match=r"fused POD plan needs \d+ bytes .* the buffer has 512"):
        _cpu_pod_plan(problem, small)
