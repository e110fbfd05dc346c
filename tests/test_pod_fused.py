"""The fused POD op (issue 16): both parts in one Triton launch, through the public POD wrappers,
against the fp64 golden (outputs and LSEs of both parts, edge shapes), and the fused-vs-composed choice."""

from __future__ import annotations

import pytest
import torch

import attncore
from attncore.kernels import interpreting
from attncore.core import registry
from attncore.core.problem import AttentionProblem, PODBatch, PODDeclined, pod_problem
from attncore.testing.golden import golden_and_baseline, max_error, tolerance


def _paged(kv_lens, page, hkv, d, dtype, layout="NHD", device="cpu"):
    pages = [(n + page - 1) // page for n in kv_lens]
    indptr = torch.tensor([0] + torch.tensor(pages, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    n = int(indptr[-1])
    indices = torch.randperm(n + 2)[:n].to(torch.int32)  # shuffled, with unused pages
    last = torch.tensor([(x - 1) % page + 1 if x else 0 for x in kv_lens], dtype=torch.int32)
    shape = (n + 2, 2, page, hkv, d) if layout == "NHD" else (n + 2, 2, hkv, page, d)
    cache = torch.randn(shape, dtype=dtype, device=device)
    return indptr.to(device), indices.to(device), last.to(device), cache


def _request_kv(cache, indptr, indices, kv_len, i, layout="NHD"):
    pg = indices[int(indptr[i]):int(indptr[i + 1])].long().to(cache.device)
    k, v = cache[pg, 0], cache[pg, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k.reshape(-1, *k.shape[2:])[:kv_len], v.reshape(-1, *v.shape[2:])[:kv_len]


def _check(out, lse, q, k, v, dtype, **kw):
    """One request against the golden, by the project's tolerance rule."""
    go, gl, bo, bl = golden_and_baseline(q, k, v, dtype=dtype, **kw)
    assert max_error(out, go) <= tolerance(bo, go, dtype), (max_error(out, go), tolerance(bo, go, dtype))
    assert max_error(lse, gl) <= tolerance(bl, gl, dtype, kind="lse"), (max_error(lse, gl),)


POD_CASES = {
    "causal": dict(causal_p=True),
    "qo_gt_kv": dict(qo=9, kv=5),
    "window": dict(causal_p=True, window_left_p=3, window_left=2),
    "alibi": dict(pos_p="ALIBI", pos="ALIBI", causal_p=True),
    "rope": dict(pos_p="ROPE_LLAMA", pos="ROPE_LLAMA", causal_p=True),
    "custom_mask": dict(custom=True),
    "one_request_page1": dict(kv_lens=[13], page=1),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(POD_CASES))
def test_pod_fused_against_golden(triton_pod, case, dtype):
    c = dict(qo=7, kv=12, kv_lens=[5, 0, 17, 1], page=4, causal_p=False, window_left_p=-1, window_left=-1,
             pos_p="NONE", pos="NONE", custom=False)
    c.update(POD_CASES[case])
    torch.manual_seed(hash(case) % 1000)
    hq, hkv, d = 4, 2, 32
    indptr, indices, last, cache = _paged(c["kv_lens"], c["page"], hkv, d, dtype)
    qp = torch.randn(c["qo"], hq, d, dtype=dtype)
    kp, vp = torch.randn(c["kv"], hkv, d, dtype=dtype), torch.randn(c["kv"], hkv, d, dtype=dtype)
    qd = torch.randn(len(c["kv_lens"]), hq, d, dtype=dtype)
    mask = torch.rand(c["qo"], c["kv"]) > 0.4 if c["custom"] else None
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="triton")
    w.plan(indptr, indices, last, hq, hkv, d, c["page"], q_data_type=dtype, window_left=c["window_left"],
           pos_encoding_mode=c["pos"])
    (op, lp), (od, ld) = w.run(qp, kp, vp, qd, cache, custom_mask_p=mask, causal_p=c["causal_p"],
                               window_left_p=c["window_left_p"], pos_encoding_mode_p=c["pos_p"],
                               return_lse_p=True, return_lse_d=True)
    assert w.backend == "fused=triton" and w.fused_reason is None
    _check(op, lp, qp, kp, vp, dtype, causal=c["causal_p"], mask=mask, window_left=c["window_left_p"],
           pos_encoding_mode=c["pos_p"])
    for i, n in enumerate(c["kv_lens"]):
        k, v = _request_kv(cache, indptr, indices, n, i)
        _check(od[i:i + 1], ld[i:i + 1], qd[i:i + 1], k, v, dtype, causal=True, window_left=c["window_left"],
               pos_encoding_mode=c["pos"])
        if n == 0:  # a decode row with no keys: out 0, lse -inf
            assert bool((od[i] == 0).all()) and bool(torch.isinf(ld[i]).all())


@pytest.mark.parametrize("mode", ["grid", "persistent"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_batch_pod_fused_against_golden(triton_pod, mode, layout):
    dtype = torch.float16
    torch.manual_seed(3)
    hq, hkv, d, page = 6, 2, 32, 4  # group 3: packed rows do not align with tiles
    old = triton_pod._pod
    triton_pod._pod = ("always", mode, 1, None)
    try:
        kvp, qop = [10, 3], [4, 6]  # request 1: qo > kv
        kvd = [7, 0, 12]
        ip, xp, lp_, cp = _paged(kvp, page, hkv, d, dtype, layout)
        idd, xd, ld_, cd = _paged(kvd, page, hkv, d, dtype, layout)
        qo_indptr_p = torch.tensor([0, qop[0], sum(qop)], dtype=torch.int32)
        qo_indptr_d = torch.arange(len(kvd) + 1, dtype=torch.int32)
        w = attncore.BatchPODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), layout,
                                                     backend="triton")
        w.plan(qo_indptr_p, ip, xp, lp_, qo_indptr_d, idd, xd, ld_, hq, hkv, d, page, q_data_type=dtype)
        qp = torch.randn(sum(qop), hq, d, dtype=dtype)
        qd = torch.randn(len(kvd), hq, d, dtype=dtype)
        (op, lp), (od, ld) = w.run(qp, cp, qd, cd, causal_p=True, return_lse=True)
        assert w.backend == "fused=triton"
        for i, n in enumerate(kvp):
            k, v = _request_kv(cp, ip, xp, n, i, layout)
            s = slice(int(qo_indptr_p[i]), int(qo_indptr_p[i + 1]))
            _check(op[s], lp[s], qp[s], k, v, dtype, causal=True)
        for i, n in enumerate(kvd):
            k, v = _request_kv(cd, idd, xd, n, i, layout)
            _check(od[i:i + 1], ld[i:i + 1], qd[i:i + 1], k, v, dtype, causal=True)
    finally:
        triton_pod._pod = old


def test_pod_backend_softcap_sinks_fp8(triton_pod):
    """What the POD wrappers cannot ask for (soft cap, sinks, fp8 KV with scales), through the backend's
    contract: a PODBatch planned and run directly, each part against the golden."""
    from attncore.core.backend import AttnParams, BatchMeta, RunArgs
    from attncore.core.problem import PODRunArgs

    torch.manual_seed(11)
    hq, hkv, d, page, qo, kv = 4, 2, 32, 4, 6, 10
    kv_dt = torch.float8_e4m3fn
    pp_params = AttnParams(sm_scale=0.2, logits_soft_cap=5.0, window_left=4)
    pd_params = AttnParams(sm_scale=0.3)
    mp = BatchMeta.ragged(qo_indptr_host=[0, qo], kv_indptr_host=[0, kv], device="cpu", params=pp_params,
                          causal=True)
    kv_lens = [3, 9]
    indptr, indices, last, cache = _paged(kv_lens, page, hkv, d, torch.float16)
    cache = cache.to(kv_dt)
    md = BatchMeta.paged([0, 1, 2], indptr, indices, last, page, device="cpu", params=pd_params, decode=True)
    base = dict(q_dtype=torch.float16, kv_dtype=kv_dt, out_dtype=torch.float16, num_qo_heads=hq,
                num_kv_heads=hkv, head_dim_qk=d, head_dim_vo=d, return_lse=True, sinks=True, fp8_scales=True)
    prob = pod_problem("pod", AttentionProblem(op="single_prefill", mask="causal", window_left=4, soft_cap=True,
                                               **base),
                       AttentionProblem(op="batch_decode", page_size=page, mask="causal", **base))
    assert triton_pod.supports(prob), triton_pod.reasons(prob)
    plan = triton_pod.plan(prob, PODBatch(mp, md))
    qp, qd = torch.randn(qo, hq, d, dtype=torch.float16), torch.randn(2, hq, d, dtype=torch.float16)
    kp, vp = (torch.randn(kv, hkv, d, dtype=torch.float16).to(kv_dt) for _ in range(2))
    sinks = torch.randn(hq, dtype=torch.float32)
    ap = RunArgs(q=qp, k=kp, v=vp, out=torch.empty_like(qp), lse=torch.empty(qo, hq), sinks=sinks, k_scale=0.5)
    ad = RunArgs(q=qd, k=cache[:, 0], v=cache[:, 1], out=torch.empty_like(qd), lse=torch.empty(2, hq), sinks=sinks,
                 q_scale=0.8, k_scale=1.5, v_scale=2.0)
    triton_pod.run(plan, PODRunArgs(ap, ad))
    _check(ap.out, ap.lse, qp, kp, vp, torch.float16, causal=True, window_left=4, sm_scale=0.2, logits_soft_cap=5.0,
           sinks=sinks, k_scale=0.5)
    for i, n in enumerate(kv_lens):
        k, v = _request_kv(cache, indptr, indices, n, i)
        _check(ad.out[i:i + 1], ad.lse[i:i + 1], qd[i:i + 1], k, v, torch.float16, causal=True, sm_scale=0.3,
               sinks=sinks, q_scale=0.8, k_scale=1.5, v_scale=2.0)
    with pytest.raises(ValueError, match="decode: sinks: planned with sinks"):
        triton_pod.run(plan, PODRunArgs(ap, RunArgs(q=qd, k=cache[:, 0], v=cache[:, 1], out=torch.empty_like(qd),
                                                    k_scale=3.0)))


def test_pod_auto_on_cpu_composes_and_says_why():
    dtype = torch.float16
    hq, hkv, d, page = 4, 2, 32, 4
    indptr, indices, last, cache = _paged([5, 9], page, hkv, d, dtype)
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD")
    w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dtype)
    w.run(torch.randn(3, hq, d, dtype=dtype), torch.randn(4, hkv, d, dtype=dtype),
          torch.randn(4, hkv, d, dtype=dtype), torch.randn(2, hq, d, dtype=dtype), cache)
    if interpreting() and "triton" in registry.entries() and not registry.entries()["triton"].unavailable_reasons():
        assert "ranks below the reference" in w.fused_reason
    else:  # a GPU run (TRITON_INTERPRET unset): Triton's compiled kernels take no CPU tensors
        assert w.fused_reason.startswith("no backend runs pod fused")
    assert w.backend.startswith("prefill=")
    w2 = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="reference")
    w2.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dtype)
    w2.run(torch.randn(3, hq, d, dtype=dtype), torch.randn(4, hkv, d, dtype=dtype),
           torch.randn(4, hkv, d, dtype=dtype), torch.randn(2, hq, d, dtype=dtype), cache)
    assert "no backend runs pod fused" in w2.fused_reason and "op: got pod" in w2.fused_reason


def test_plan_declines_when_decode_needs_split():
    pod = pytest.importorskip("attncore.backends.triton.pod")
    from attncore.core.backend import AttnParams, BatchMeta

    params = AttnParams(sm_scale=0.1)
    mp = BatchMeta.ragged(qo_indptr_host=[0, 1], kv_indptr_host=[0, 16], device="cpu", params=params)
    n = 64
    md = BatchMeta.paged([0, 1], torch.tensor([0, n], dtype=torch.int32), torch.arange(n, dtype=torch.int32),
                         torch.tensor([16], dtype=torch.int32), 16, device="cpu", params=params, decode=True)
    base = AttentionProblem(op="single_prefill", num_qo_heads=4, num_kv_heads=1, head_dim_qk=32, head_dim_vo=32)
    prob = pod_problem("pod", base, base.replace(op="batch_decode", page_size=16, mask="causal"))
    with pytest.raises(PODDeclined, match="needs split-KV"):
        pod.plan_pod(prob, PODBatch(mp, md), interpret=False)
    plan = pod.plan_pod(prob, PODBatch(mp, md), interpret=True, fused="always")
    assert plan.stats["items"] == [1, 1]


def test_pod_problem_and_refusals():
    base = AttentionProblem(op="single_prefill", num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, head_dim_vo=64)
    with pytest.raises(ValueError, match="num_kv_heads: the prefill part has 2, the decode part 4"):
        pod_problem("pod", base, base.replace(op="batch_decode", num_kv_heads=4))
    with pytest.raises(ValueError, match="op: got 'decode'"):
        pod_problem("decode", base, base)
    p = pod_problem("batch_pod", base.replace(page_size=16),
                    base.replace(op="batch_decode", page_size=16, mask="causal", sinks=True))
    assert "sinks" in p.features and "decode[p16 NHD causal sinks]" in p.describe()
    entry = registry.entries().get("triton")
    if entry is not None and hasattr(entry.backend, "_pod"):
        bad = pod_problem("batch_pod", base.replace(page_size=16),
                          base.replace(op="batch_decode", page_size=16, kv_layout="XYZ", mask="causal"))
        assert any(r.axis == "decode kv_layout" for r in entry.backend.reasons(bad))


GPU_CASES = {
    "plain": dict(),
    "window": dict(window_left_p=100, window_left=300),
    "alibi": dict(pos_p="ALIBI", pos="ALIBI"),
    "rope": dict(pos_p="ROPE_LLAMA", pos="ROPE_LLAMA"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["grid", "persistent"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_pod_fused_gpu_bf16(triton_pod, case, mode):
    """bf16 on the GPU, serving shapes (32/8 heads, d128, page 16), both outputs and LSEs, edge rows."""
    c = dict(window_left_p=-1, window_left=-1, pos_p="NONE", pos="NONE")
    c.update(GPU_CASES[case])
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(7)
    hq, hkv, d, page = 32, 8, 128, 16
    old = triton_pod._pod
    triton_pod._pod = ("always", mode, 2, None)
    try:
        kv_lens = [0, 1, 100, 1000, 4097]
        indptr, indices, last, cache = _paged(kv_lens, page, hkv, d, dtype, device=dev)
        qo = 300
        qp = torch.randn(qo, hq, d, dtype=dtype, device=dev)
        kp, vp = (torch.randn(qo, hkv, d, dtype=dtype, device=dev) for _ in range(2))
        qd = torch.randn(len(kv_lens), hq, d, dtype=dtype, device=dev)
        w = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device=dev), "NHD",
                                                backend="triton")
        w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dtype, window_left=c["window_left"],
               pos_encoding_mode=c["pos"])
        (op, lp), (od, ld) = w.run(qp, kp, vp, qd, cache, causal_p=True, window_left_p=c["window_left_p"],
                                   pos_encoding_mode_p=c["pos_p"], return_lse_p=True, return_lse_d=True)
        assert w.backend == "fused=triton"
        _check(op, lp, qp, kp, vp, dtype, causal=True, window_left=c["window_left_p"], pos_encoding_mode=c["pos_p"])
        for i, n in enumerate(kv_lens):
            k, v = _request_kv(cache, indptr, indices, n, i)
            _check(od[i:i + 1], ld[i:i + 1], qd[i:i + 1], k, v, dtype, causal=True, window_left=c["window_left"],
                   pos_encoding_mode=c["pos"])
    finally:
        triton_pod._pod = old


@pytest.mark.gpu
@pytest.mark.parametrize("prefill,batch,kv,fuses", [(2048, 64, 4096, False), (512, 8, 1024, True)],
                         ids=["PD1-composes", "p512-b8-kv1k-fuses"])
def test_batch_pod_auto_follows_the_measured_region_gpu(prefill, batch, kv, fuses):
    """auto on a GPU fuses only inside the region where the fused launch was measured to win (MEASURED_WINS of
    the fused backend auto ranks first: backends/cuda_fa2/pod.py on sm_90, backends/triton/pod.py elsewhere): PD1
    composes and says why, a small prefill beside short decodes fuses; both paths agree within the golden rule's
    scale."""
    dev, dtype = "cuda", torch.bfloat16
    hq, hkv, d, page = 32, 8, 128, 16
    indptr, indices, last, cache = _paged([kv] * batch, page, hkv, d, dtype, device=dev)
    qp = torch.randn(prefill, hq, d, dtype=dtype, device=dev)
    kp, vp = (torch.randn(prefill, hkv, d, dtype=dtype, device=dev) for _ in range(2))
    qd = torch.randn(batch, hq, d, dtype=dtype, device=dev)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    res = {}
    for fuse in (True, False):
        w = attncore.PODWithPagedKVCacheWrapper(ws, "NHD", fuse=fuse)
        w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dtype)
        res[fuse] = w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_p=True, return_lse_d=True)
        fused = "fused=cuda_fa2" if torch.cuda.get_device_capability() == (9, 0) else "fused=triton"
        if fuse and fuses:
            assert w.backend == fused, w.fused_reason
        elif fuse:
            assert not w.backend.startswith("fused=") and "MEASURED_WINS" in w.fused_reason, (w.backend,
                                                                                              w.fused_reason)
    for a, b in zip(res[True], res[False]):
        assert (a[0].float() - b[0].float()).abs().max().item() < 0.05
        assert (a[1] - b[1]).abs().max().item() < 0.05


def test_pod_bench_fuses_with_the_backend_auto_ranks_first():
    """The bench's fused column defaults to the fused op auto would use: Triton's on a CPU (cuda_fa2's pod90
    serves sm_90 only), cuda_fa2's on an H100."""
    from attncore.cli import bench_pod

    assert bench_pod.default_pod_backend("cpu") == "triton"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        assert bench_pod.default_pod_backend("cuda") == "cuda_fa2"


def test_pod_bench_rows_on_cpu(triton_pod):
    """The POD bench's rows (fused, serial, auto) on a shrunken PD1, with a timer that only runs the
    closure (the interpreter's times mean nothing); the table prints every column."""
    from attncore.cli import bench_pod

    calls = []
    w = bench_pod._shrink(bench_pod.POD_WORKLOADS[0])
    forced = []  # the fused mode each timed closure ran under

    def timer(fn):
        forced.append(triton_pod._pod[0])
        fn()
        calls.append(1)
        return float(len(calls))

    triton_pod.pod_fuse = "auto"  # measure forces it for the fused column only (the fixture restores it)
    row = bench_pod.measure(w, device="cpu", time_fn=timer, rounds=3)
    assert "fused_error" not in row, row.get("fused_error")
    # three rounds, each timing every column once, each round starting one column later: a column's figure is
    # its median round
    assert len(calls) == 15 and row["rounds"] == 3
    assert [row[f"{k}_rounds"] for k in ("fused", "serial", "streams", "sm_split", "auto")] == [
        [1.0, 10.0, 14.0], [2.0, 6.0, 15.0], [3.0, 7.0, 11.0], [4.0, 8.0, 12.0], [5.0, 9.0, 13.0]]
    assert (row["fused"], row["serial"], row["auto"]) == (10.0, 6.0, 9.0)
    assert row["fused_speedup"] == 6.0 / 10.0
    assert forced == ["always"] + ["auto"] * 8 + ["always"] + ["auto"] * 3 + ["always", "auto"], forced
    assert row["serial_backends"].startswith("prefill=") and row["auto_ran"].startswith("serial: prefill=")
    assert row["streams_mode"] == "serial" and "no CUDA streams on cpu" in row["streams_reason"]
    assert row["sm_split_sms"] is None and "overlap='sm_split': no CUDA streams on cpu" in row["sm_split_reason"]
    assert triton_pod._pod[0] == "auto"  # the forced mode is restored
    table = bench_pod.format_pod_table({"device": "cpu", "rows": [row]})
    assert "PD1" in table and "fused x" in table and "streams x" in table and "streams_reason" in table
    assert "split x" in table and "sm_split_reason" in table
    with pytest.raises(ValueError, match="unknown POD workload PD9"):
        bench_pod.run_pod_bench(["PD9"], device="cpu")


def test_sweep_summary_names_autos_worst_point():
    """The sweep's medians per column and auto's worst point, named with what auto ran there; PD rows are not
    sweep points."""
    from attncore.cli import bench_pod

    rows = [{"id": "PD1", "auto_speedup": 0.5, "fused_speedup": 0.5},
            {"id": "S-a", "auto_speedup": 1.10, "fused_speedup": 1.2, "auto_ran": "fused=cuda_fa2"},
            {"id": "S-b", "auto_speedup": 0.97, "fused_speedup": 0.9, "auto_ran": "serial: prefill=x decode=y"},
            {"id": "S-c", "auto_speedup": 1.00, "sm_split_speedup": 1.1, "auto_ran": "serial: prefill=x decode=y"}]
    info = bench_pod.sweep_summary(rows)
    for r in rows:
        r["shape"] = "p1 + 1x1"
    assert info["sweep_median_auto_speedup"] == 1.00 and info["sweep_median_fused_speedup"] == (1.2 + 0.9) / 2
    assert info["sweep_median_sm_split_speedup"] == 1.1 and "sweep_median_streams_speedup" not in info
    assert info["sweep_worst_auto_speedup"] == 0.97 and info["sweep_worst_auto"] == "S-b, auto ran serial: prefill=x decode=y"
    table = bench_pod.format_pod_table({"device": "cpu", "rows": rows, **info})
    assert table.endswith("worst auto 0.970 (target: >= 0.98) at S-b, auto ran serial: prefill=x decode=y")
    # a column not measured reads "-", never a speedup of 0
    assert "streams -, sm_split 1.100" in table and "0.00" not in table
    pd1 = next(line for line in table.splitlines() if line.startswith("PD1"))
    assert pd1.split()[-6:] == ["0.50", "-", "-", "0.50", "-", "None"], pd1  # fused, streams, split, auto, fi x
    assert bench_pod.sweep_summary(rows[:1]) == {}


def test_bench_plot_needs_pod_rows():
    from attncore.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", "--plot", "/tmp/x.png"])
    assert e.value.code == 2


def test_pod_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from attncore.cli import bench_pod

    rows = [{"id": "S-a", "shape": "x", "fused_speedup": 1.2, "streams_speedup": 1.15, "auto_speedup": 1.1},
            {"id": "S-b", "shape": "y", "fused_speedup": 0.9, "streams_speedup": 1.05, "auto_speedup": 1.0}]
    bench_pod.plot({"device": "cpu", "rows": rows}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_batch_pod_fused_draft_rows_fp32(triton_pod):
    """batch_pod whose decode requests carry 2 query rows each (speculative drafts: causal within the
    request), fp32, page size 1."""
    dtype = torch.float32
    torch.manual_seed(5)
    hq, hkv, d, page = 4, 1, 16, 1
    kvp, kvd = [7], [5, 9]
    ip, xp, lp_, cp = _paged(kvp, page, hkv, d, dtype)
    idd, xd, ld_, cd = _paged(kvd, page, hkv, d, dtype)
    w = attncore.BatchPODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="triton")
    w.plan(torch.tensor([0, 7], dtype=torch.int32), ip, xp, lp_, torch.tensor([0, 2, 4], dtype=torch.int32),
           idd, xd, ld_, hq, hkv, d, page, q_data_type=dtype)
    qp, qd = torch.randn(7, hq, d, dtype=dtype), torch.randn(4, hq, d, dtype=dtype)
    (op, lp), (od, ld) = w.run(qp, cp, qd, cd, causal_p=False, return_lse=True)
    assert w.backend == "fused=triton"
    k, v = _request_kv(cp, ip, xp, 7, 0)
    _check(op, lp, qp, k, v, dtype)
    for i, n in enumerate(kvd):
        k, v = _request_kv(cd, idd, xd, n, i)
        _check(od[2 * i:2 * i + 2], ld[2 * i:2 * i + 2], qd[2 * i:2 * i + 2], k, v, dtype, causal=True)


@pytest.mark.parametrize("name", ["triton", "cuda_fa2"])
def test_pod_bench_forces_either_fused_op_through_pod_fuse(name):
    """``attncore bench --pod-backend NAME`` forces the backend's fused op on every batch through its ``pod_fuse``
    knob (the same name on both backends) while timing the fused column, and restores it afterwards, also when
    the block raises; a bad value is refused."""
    from attncore.cli import bench_pod
    from attncore.core import registry

    b = registry.entries()[name].backend
    before = b.pod_fuse
    with bench_pod._forced(name):
        assert b.pod_fuse == "always"
    assert b.pod_fuse == before
    with pytest.raises(KeyError), bench_pod._forced(name):
        raise KeyError("x")
    assert b.pod_fuse == before
    if name == "triton":
        assert b._pod[0] == before
        with pytest.raises(ValueError, match="pod_fuse: got 'never', expected 'auto' or 'always'"):
            b.pod_fuse = "never"
    with pytest.raises(ValueError, match="'reference' has no fused POD op"), bench_pod._forced("reference"):
        pass
