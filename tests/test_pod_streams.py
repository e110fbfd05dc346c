"""POD's concurrent modes (issue 16): the composed parts on two CUDA streams (the decode on a side stream) or
on two disjoint sets of SMs (``sm_split``; its model: tests/test_pod_sm_split.py), their selection
(``overlap=``, ``mode``, ``overlap_reason``), the batch POD's workspace split and its too-small fallback (on
the CPU, with the stream fork faked), and on a GPU: streams and sm_split == serial bit for bit, under
CUDA-graph capture and replay after re-plan (the fused launch too), memory flat over repeated runs."""

from __future__ import annotations

import contextlib

import pytest
import torch

import attncore
from attncore import pod as _pod
from attncore.core.problem import AttentionProblem, pod_problem
from attncore.core.selector import explain
from attncore.core.workspace import ALIGN, WorkspaceTooSmall

from tests.test_pod_fused import _check, _paged, _request_kv

HQ, HKV, D, PAGE = 4, 2, 32, 4


def _pod_inputs(dtype, device="cpu", kv_lens=(5, 9, 0), qo=6, seed=0):
    torch.manual_seed(seed)
    indptr, indices, last, cache = _paged(list(kv_lens), PAGE, HKV, D, dtype, device=device)
    qp = torch.randn(qo, HQ, D, dtype=dtype, device=device)
    kp, vp = (torch.randn(qo, HKV, D, dtype=dtype, device=device) for _ in range(2))
    qd = torch.randn(len(kv_lens), HQ, D, dtype=dtype, device=device)
    return indptr, indices, last, cache, qp, kp, vp, qd


def _batch_pod(ws, dtype, device="cpu", qo=7, kv_p=(7,), kv_d=(5, 9), **kw):
    torch.manual_seed(1)
    ip, xp, lp, cp = _paged(list(kv_p), PAGE, HKV, D, dtype, device=device)
    idd, xd, ld, cd = _paged(list(kv_d), PAGE, HKV, D, dtype, device=device)
    w = attncore.BatchPODWithPagedKVCacheWrapper(ws, "NHD", **kw)
    qo_p = torch.tensor([0, qo], dtype=torch.int32, device=device)
    qo_d = torch.arange(len(kv_d) + 1, dtype=torch.int32, device=device)
    w.plan(qo_p, ip, xp, lp, qo_d, idd, xd, ld, HQ, HKV, D, PAGE, q_data_type=dtype)
    qp = torch.randn(qo, HQ, D, dtype=dtype, device=device)
    qd = torch.randn(len(kv_d), HQ, D, dtype=dtype, device=device)
    return w, (qp, cp, qd, cd), (ip, xp, idd, xd)


# ------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("bad", ["parallel", "", True, None, 2])
def test_bad_overlap_raises_naming_it(bad):
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"overlap: got .*expected one of 'auto', 'sm_split', 'streams', 'serial'"):
        attncore.PODWithPagedKVCacheWrapper(ws, "NHD", overlap=bad)
    with pytest.raises(ValueError, match="overlap: got"):
        attncore.BatchPODWithPagedKVCacheWrapper(ws, "NHD", overlap=bad)


@pytest.mark.parametrize("overlap", ["auto", "sm_split", "streams", "serial"])
def test_pod_on_cpu_runs_serially_and_says_why(overlap):
    """On the CPU the concurrent mode degrades to serial (no streams), with the reason; results are
    the serial path's bit for bit and right against the golden."""
    dtype = torch.float32
    indptr, indices, last, cache, qp, kp, vp, qd = _pod_inputs(dtype)
    res = {}
    for ov in (overlap, "serial"):
        w = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD",
                                                backend="reference", overlap=ov)
        assert w.mode is None and w.overlap_reason is None
        w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dtype)
        res[ov] = w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_p=True, return_lse_d=True)
        assert w.mode == "serial"
        if ov == "serial":
            assert w.overlap_reason.startswith("overlap='serial'")
        else:
            assert f"overlap={ov!r}: no CUDA streams on cpu" in w.overlap_reason
    for a, b in zip(res[overlap], res["serial"]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    (op, lp), (od, ld) = res[overlap]
    _check(op, lp, qp, kp, vp, dtype, causal=True)
    for i, n in enumerate([5, 9, 0]):
        if n:
            k, v = _request_kv(cache, indptr, indices, n, i)
            _check(od[i:i + 1], ld[i:i + 1], qd[i:i + 1], k, v, dtype, causal=True)


def test_batch_pod_on_cpu_shares_the_workspace():
    """Serial on the CPU: no split, both parts plan into the whole float workspace."""
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    w, args, _ = _batch_pod(ws, torch.float32, backend="reference")
    w.run(*args, return_lse=True)
    assert w.mode == "serial" and "no CUDA streams on cpu" in w.overlap_reason
    assert w._split is None
    assert w._prefill._float_workspace_buffer is ws and w._decode._float_workspace_buffer is ws


def test_batch_pod_plans_the_prefill_mask_the_last_run_used(monkeypatch):
    """A serving step plans then runs causal_p=True: after the first such run, plan() plans the prefill side
    causal, so later steps plan it once; a run with another mask still plans it (and differs)."""
    f32 = torch.float32
    ip, xp, lp, cp = _paged([7], PAGE, HKV, D, f32)
    idd, xd, ld, cd = _paged([5, 9], PAGE, HKV, D, f32)
    qp, qd = torch.randn(7, HQ, D), torch.randn(2, HQ, D)
    w = attncore.BatchPODWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8), "NHD", backend="reference")
    plans = []
    real = w._prefill.plan
    monkeypatch.setattr(w._prefill, "plan", lambda *a, **kw: plans.append(kw["causal"]) or real(*a, **kw))

    def step(causal_p):
        w.plan(torch.tensor([0, 7], dtype=torch.int32), ip, xp, lp, torch.arange(3, dtype=torch.int32), idd, xd,
               ld, HQ, HKV, D, PAGE, q_data_type=f32)
        return w.run(qp, cp, qd, cd, causal_p=causal_p)

    step(True)
    assert plans == [False, True]  # before any run plan() plans causal_p=False
    causal = step(True)
    assert plans == [False, True, True]  # one plan a step
    full = w.run(qp, cp, qd, cd, causal_p=False)
    assert plans[-1] is False and not torch.equal(full[0], causal[0])
    step(False)
    assert plans[-2:] == [False, False]


def test_fused_run_reports_fused_mode(triton_pod):
    dtype = torch.float32
    indptr, indices, last, cache, qp, kp, vp, qd = _pod_inputs(dtype)
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="triton",
                                            overlap="streams")
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dtype)
    w.run(qp, kp, vp, qd, cache, causal_p=True)
    assert w.mode == "fused" and w.overlap_reason is None and w.fused_reason is None


def test_halves_split_the_workspace():
    ws = torch.empty(10 * ALIGN + 100, dtype=torch.uint8)
    head, tail = _pod.halves(ws)
    assert head.numel() % ALIGN == 0 and head.numel() + tail.numel() == ws.numel()
    assert head.data_ptr() == ws.data_ptr() and tail.data_ptr() == ws.data_ptr() + head.numel()
    f = torch.empty(1024, dtype=torch.float32)  # a float workspace of another dtype: its bytes
    head, tail = _pod.halves(f)
    assert head.dtype == torch.uint8 and head.numel() + tail.numel() == 4096
    assert _pod.halves(torch.empty(64, 64, dtype=torch.uint8)[:, ::2]) is None


@pytest.fixture
def fake_streams(monkeypatch):
    """Streams "available" on the CPU, the fork faked: the parts run in turn on the current stream;
    records the calls."""
    calls = []

    def compose(self, prefill, decode, why_serial=None):
        why = why_serial or self.unavailable()
        calls.append(why)
        if why is not None:
            prefill(), decode()
            self.mode, self.reason = "serial", why
        else:
            prefill(), decode()
            self.mode, self.reason = "streams", None

    monkeypatch.setattr(_pod.Streams, "unavailable",
                        lambda self: "overlap='serial'" if self.overlap == "serial" else None)
    monkeypatch.setattr(_pod.Streams, "decide", lambda self, *parts: self.unavailable())
    monkeypatch.setattr(_pod.Streams, "decide_work", lambda self, work: self.unavailable())
    monkeypatch.setattr(_pod.Streams, "compose", compose)
    return calls


@pytest.mark.parametrize("raises", [False, True])
def test_on_switches_the_stream_and_restores_it(monkeypatch, raises):
    """current.on: torch's raw setter where the stream is on the current device (the previous stream restored on
    exit, also when the block raises), torch's context manager for another device's stream (the raw setter would
    switch the device too).  The CPU, with torch's accessors faked."""
    from types import SimpleNamespace

    from attncore.core import current

    now = {0: (7, 0, 1), 1: (9, 1, 1)}  # device index -> its current stream (id, index, type)
    ctx = []
    monkeypatch.setattr(current, "_raw_device", lambda: 0)  # the current device
    monkeypatch.setattr(current, "_get_stream", lambda i: now[i])
    monkeypatch.setattr(current, "_set_stream", lambda **k: now.__setitem__(k["device_index"], tuple(k.values())))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: SimpleNamespace(__enter__=lambda: ctx.append(("in", s)),
                                                                        __exit__=lambda *e: ctx.append(("out", s))))
    s0 = SimpleNamespace(stream_id=42, device_index=0, device_type=1)
    with pytest.raises(RuntimeError) if raises else contextlib.nullcontext():
        with current.on(s0):
            assert now == {0: (42, 0, 1), 1: (9, 1, 1)} and not ctx
            if raises:
                raise RuntimeError("a launch failed")
    assert now == {0: (7, 0, 1), 1: (9, 1, 1)}
    s1 = SimpleNamespace(stream_id=43, device_index=1, device_type=1)
    with current.on(s1):
        assert ctx == [("in", s1)] and now[1] == (9, 1, 1)
    assert ctx == [("in", s1), ("out", s1)]


def test_split_runs_the_decode_on_the_plan_for_its_sms(monkeypatch):
    """Under an SM split the decode part runs the plan its backend makes for its share of the SMs
    (Backend.plan_for_sms), asked once per plan; serial runs never ask.  The CPU, with the split faked."""
    import copy

    from attncore.core import registry

    calls = []
    ref = type(registry.entries()["reference"].backend)
    monkeypatch.setattr(ref, "plan_for_sms", lambda self, plan, sms: calls.append(sms) or copy.copy(plan))
    monkeypatch.setattr(_pod.Streams, "unavailable",
                        lambda self: "overlap='serial'" if self.overlap == "serial" else None)

    def decide(self, *parts):
        self.pair = None if self.overlap == "serial" else ((None, 40), (None, 92))
        return self.unavailable()

    def compose(self, prefill, decode, why_serial=None, tail=None):
        prefill(), decode()
        assert tail is None  # the reference backend offers no split launches
        self.mode, self.reason = ("serial", why_serial) if why_serial else ("sm_split", None)

    monkeypatch.setattr(_pod.Streams, "decide", decide)
    monkeypatch.setattr(_pod.Streams, "compose", compose)
    dtype = torch.float32
    indptr, indices, last, cache, qp, kp, vp, qd = _pod_inputs(dtype)
    res = {}
    for ov in ("sm_split", "serial"):
        w = attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD",
                                                backend="reference", fuse=False, overlap=ov)
        w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dtype)
        res[ov] = [w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_d=True) for _ in range(2)]
        assert w.mode == ov
        assert calls == [92]  # the split's first run asked, its second reused the plan; serial never asks
    for ra, rb in zip(res["sm_split"], res["serial"]):
        assert all(torch.equal(a, b) for a, b in zip(_flat(ra), _flat(rb)))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_batch_pod_split_gives_each_part_its_half(fake_streams, backend, cpu_backend):
    """In streams mode each part plans into its half of the float workspace (no shared scratch); the
    results equal the serial mode's, which shares the whole buffer."""
    if backend == "triton":
        from attncore.core import registry

        if "triton" not in registry.entries() or registry.entries()["triton"].unavailable_reasons():
            pytest.skip("triton backend unavailable")
    dtype = torch.float32
    ws = torch.empty(4 << 20, dtype=torch.uint8)
    w, args, _ = _batch_pod(ws, dtype, backend=backend, fuse=False)
    head, tail = w._split
    assert w._prefill._float_workspace_buffer is head and w._decode._float_workspace_buffer is tail
    assert head.data_ptr() == ws.data_ptr() and tail.data_ptr() == ws.data_ptr() + head.numel()
    assert w._prefill._planned.meta.workspace is head and w._decode._planned.meta.workspace is tail
    got = w.run(*args, return_lse=True)
    assert w.mode == "streams" and w.overlap_reason is None and fake_streams == [None]
    w2, args2, _ = _batch_pod(torch.empty(4 << 20, dtype=torch.uint8), dtype, backend=backend, fuse=False,
                              overlap="serial")
    assert w2._split is None
    want = w2.run(*args2, return_lse=True)
    assert w2.mode == "serial"
    for a, b in zip(got, want):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    w.run(*args, causal_p=True)  # a new prefill mask is planned into the prefill's half
    assert w._prefill._planned.meta.workspace is head and w.mode == "streams"
    ws2 = torch.empty(4 << 20, dtype=torch.uint8)
    w.reset_workspace_buffer(ws2)
    assert w._split is None  # split again at the next plan, from the new buffer


def test_batch_pod_too_small_for_both_falls_back(fake_streams, monkeypatch):
    """A part whose plan does not fit its half (WorkspaceTooSmall, faked by sizes: the decode needs more
    than half of the buffer) sends both parts back to the whole buffer, run serially, saying why."""
    ws = torch.empty(1 << 16, dtype=torch.uint8)
    need = 40000  # bytes: more than half the buffer, less than all of it
    real = attncore.BatchDecodeWithPagedKVCacheWrapper.plan

    def plan(self, *a, **kw):
        have = self._float_workspace_buffer.numel()
        if have < need:
            raise WorkspaceTooSmall(f"float_workspace_buffer: fake decode needs {need} bytes, the buffer has {have}")
        return real(self, *a, **kw)

    monkeypatch.setattr(attncore.BatchDecodeWithPagedKVCacheWrapper, "plan", plan)
    w, args, _ = _batch_pod(ws, torch.float32, backend="reference")
    assert w._split is None
    assert w._prefill._float_workspace_buffer is ws and w._decode._float_workspace_buffer is ws
    w.run(*args)
    assert w.mode == "serial" and not fake_streams  # serial: each part's own run(), no composition
    assert "too small for both parts side by side" in w.overlap_reason and "needs 40000 bytes" in w.overlap_reason
    need = 1 << 20  # too small for the whole buffer too: the error reaches the caller, naming the buffer
    with pytest.raises(WorkspaceTooSmall, match="float_workspace_buffer: fake decode needs"):
        _batch_pod(ws, torch.float32, backend="reference")


def test_batch_pod_prefill_mask_too_big_for_its_half_falls_back(fake_streams, monkeypatch):
    """A prefill re-plan at run time (a new causal_p) that does not fit its half moves both parts back to
    the whole buffer."""
    ws = torch.empty(1 << 16, dtype=torch.uint8)
    real = attncore.BatchPrefillWithPagedKVCacheWrapper.plan

    def plan(self, *a, **kw):
        if kw.get("causal") and self._float_workspace_buffer.numel() < ws.numel():
            raise WorkspaceTooSmall("float_workspace_buffer: fake causal prefill needs the whole buffer")
        return real(self, *a, **kw)

    monkeypatch.setattr(attncore.BatchPrefillWithPagedKVCacheWrapper, "plan", plan)
    w, args, _ = _batch_pod(ws, torch.float32, backend="reference")
    assert w._split is not None
    w.run(*args)
    assert w.mode == "streams"
    w.run(*args, causal_p=True)
    assert w._split is None and w.mode == "serial" and "fake causal prefill" in w.overlap_reason


def test_explain_mentions_streams():
    base = AttentionProblem(op="single_prefill", num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, head_dim_vo=64)
    p = pod_problem("pod", base, base.replace(op="batch_decode", page_size=16, mask="causal"))
    note = explain(p).note
    assert "side CUDA stream" in note and "disjoint SMs" in note and "choose_split" in note


# ------------------------------------------------------------------------------------------- GPU
def _pd(prefill=1024, batch=32, kv=2048, seed=3):
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(seed)
    indptr, indices, last, cache = _paged([kv] * (batch - 2) + [0, 1], 16, 8, 128, dtype, device=dev)
    qp = torch.randn(prefill, 32, 128, dtype=dtype, device=dev)
    kp, vp = (torch.randn(prefill, 8, 128, dtype=dtype, device=dev) for _ in range(2))
    qd = torch.randn(batch, 32, 128, dtype=dtype, device=dev)
    return indptr, indices, last, cache, qp, kp, vp, qd


def _bpd(seed):
    """BatchPOD's inputs beside _pd's decode batch: two paged prefills (1024 and 300 rows, their own cache).
    ((the plan's index tables), (the run's q and caches))."""
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(seed)
    ip, xp, lp, cp = _paged([1024, 300], 16, 8, 128, dtype, device=dev)
    idd, xd, ld, cd = _paged([2048] * 30 + [0, 1], 16, 8, 128, dtype, device=dev)
    qo_p = torch.tensor([0, 1024, 1324], dtype=torch.int32, device=dev)
    qo_d = torch.arange(33, dtype=torch.int32, device=dev)
    qp, qd = torch.randn(1324, 32, 128, dtype=dtype, device=dev), torch.randn(32, 32, 128, dtype=dtype, device=dev)
    return (qo_p, ip, xp, lp, qo_d, idd, xd, ld), (qp, cp, qd, cd)


def _flat(res):
    out = []
    for r in res:
        out += list(r) if isinstance(r, tuple) else [r]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["streams", "sm_split"])
@pytest.mark.parametrize("lse", [False, True])
def test_streams_equal_serial_bitwise_gpu(lse, mode, monkeypatch):
    """PD-like shapes in bf16 (32/8 heads, d128, page 16, kv-0 and kv-1 decode rows): the concurrent mode
    runs (side stream, or two green-context streams on disjoint SMs) and gives the serial mode's bits, with
    and without LSEs, where the decode keeps the whole GPU's split count (xqa's SHARE_SPLITS off; with it, the
    test below)."""
    from attncore.backends.xqa import backend as xqa_backend

    monkeypatch.setattr(xqa_backend, "SHARE_SPLITS", False)
    indptr, indices, last, cache, qp, kp, vp, qd = _pd()
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    res, sides = {}, None
    for ov in (mode, "serial"):
        w = attncore.PODWithPagedKVCacheWrapper(ws, "NHD", fuse=False, overlap=ov)
        w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
        res[ov] = w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_p=lse, return_lse_d=lse)
        assert w.mode == ov, w.overlap_reason
        if ov == "streams":
            sides = list(w._streams._side.values())
            assert len(sides) == 1 and sides[0] != torch.cuda.current_stream()
            assert sides[0].priority == torch.cuda.current_stream().priority
            w.run(qp, kp, vp, qd, cache, causal_p=True)
            assert list(w._streams._side.values()) == sides  # created once, reused
        if ov == "sm_split":
            n_p, n_d = w.sm_split
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            assert n_p % 8 == 0 and 0 < n_p < n_p + n_d <= sms
            from attncore.backends.xqa.backend import SHARE_STAGES2

            planned = w._decode._planned
            if planned.backend_name == "xqa" and n_d <= SHARE_STAGES2 * sms:  # XqaBackend.plan_for_sms
                assert [p.lib.stages for p in planned._on_sms.values()] == [2]
    torch.cuda.synchronize()
    for a, b in zip(_flat(res[mode]), _flat(res["serial"])):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_split_decode_planned_for_its_sms_gpu(monkeypatch):
    """On an SM split the decode part runs a plan for its SMs (XqaBackend.plan_for_sms): with the prefill forced
    onto 48 SMs, a 32 x 2k decode splits its keys where one split would leave a tail wave, and its outputs and
    LSEs (kv-0 and kv-1 rows too) are right by the tolerance rule."""
    from attncore.backends.xqa import plan as xplan
    from attncore.core import streams

    monkeypatch.setattr(streams, "choose_split",
                        lambda f, b, n, g=8, margin=None: streams.SplitChoice(48, 0.0, 0.0, True, "x"))
    # inputs of its own: no output an earlier test left in the allocator's cache can pass for this one's
    indptr, indices, last, cache, qp, kp, vp, qd = _pd(seed=5)
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                            fuse=False, overlap="sm_split")
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    _, (od, lsed) = w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_d=True)
    assert w.mode == "sm_split", w.overlap_reason
    planned = w._decode._planned
    if planned.backend_name != "xqa":
        pytest.skip(f"the decode ran on {planned.backend_name}, not xqa")
    whole = planned._primary[1]
    shared = [p for p in planned._on_sms.values() if p is not None]
    slots = w.sm_split[1] * shared[0].lib.ctas_per_sm if shared else 0
    assert shared and shared[0].num_splits == xplan.choose_splits(256, 32, slots)
    assert shared[0].num_splits != whole.num_splits, (whole.num_splits, w.sm_split)
    torch.cuda.synchronize()
    lens = [2048] * 30 + [0, 1]
    for i, n in enumerate(lens):
        k, v = _request_kv(cache, indptr, indices, n, i)
        _check(od[i:i + 1], lsed[i:i + 1], qd[i:i + 1], k, v, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_pod", [False, True])
@pytest.mark.parametrize("prefill_sms", [8, 40])
def test_split_tail_takes_over_the_prefills_units_gpu(batch_pod, prefill_sms, monkeypatch):
    """On an SM split with cuda_fa2's prefill (prefill90: the one-unit grid for POD's contiguous K/V, the
    persistent grid for BatchPOD's paged K/V) the prefill runs as two launches sharing its units
    (CudaFa2Backend.split_launches): the first on the prefill's SMs, the tail on the decode's after the decode.
    Both parts equal the serial mode's bits (each unit is computed whole by one CTA of either launch), on 8
    prefill SMs (the tail takes most units) and 40; the counters are back at zero after every run (a second
    run, and a serial run after it, give the same bits)."""
    from attncore.backends.cuda_fa2 import binding
    from attncore.backends.xqa import backend as xqa_backend
    from attncore.core import streams

    monkeypatch.setattr(xqa_backend, "SHARE_SPLITS", False)  # the whole GPU's split count: the same bits
    monkeypatch.setattr(streams, "choose_split",
                        lambda f, b, n, g=8, margin=None: streams.SplitChoice(prefill_sms, 0.0, 0.0, True, "forced"))
    launch = binding.launch

    def spy(plan, args, shared=None):
        launches.append(shared)
        return launch(plan, args, shared)
    launches = []
    monkeypatch.setattr(binding, "launch", spy)
    dev, dtype = "cuda", torch.bfloat16
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    if batch_pod:
        tables, inputs = _bpd(seed=6)

        def make(ov):
            w = attncore.BatchPODWithPagedKVCacheWrapper(ws, "NHD", fuse=False, overlap=ov)
            w.plan(*tables, 32, 8, 128, 16, q_data_type=dtype)
            return w, lambda: w.run(*inputs, causal_p=True, return_lse=True)
    else:
        indptr, indices, last, cache, qp, kp, vp, qd = _pd(seed=6)

        def make(ov):
            w = attncore.PODWithPagedKVCacheWrapper(ws, "NHD", fuse=False, overlap=ov)
            w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=dtype)
            return w, lambda: w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_p=True, return_lse_d=True)
    w, run = make("sm_split")
    first = [t.clone() for t in _flat(run())]
    assert w.mode == "sm_split" and w.sm_split[0] == prefill_sms, w.overlap_reason
    prefill = w._prefill._planned.backend_name if batch_pod else w._prefill_backend
    if prefill != "cuda_fa2":
        pytest.skip(f"the prefill ran on {prefill}, not cuda_fa2")
    tails = [sh for sh in launches if sh is not None]
    assert [sh[2] for sh in tails] == [0, 1], launches  # the first launch, then the tail
    assert tails[0][:2] == tails[1][:2] and tails[0][1] > tails[0][0] > 0
    assert tails[0][3] == tails[1][3]  # both take the units in one order (Fa2Params.head_group)
    again = _flat(run())
    ws_serial, run_serial = make("serial")
    serial = _flat(run_serial())
    assert ws_serial.mode == "serial"
    torch.cuda.synchronize()
    for a, b, c in zip(first, again, serial):
        assert torch.equal(a, c) and torch.equal(b, c)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["streams", "sm_split"])
@pytest.mark.parametrize("lse", [False, True])
def test_batch_pod_streams_equal_serial_bitwise_gpu(lse, mode, monkeypatch):
    from attncore.backends.xqa import backend as xqa_backend

    monkeypatch.setattr(xqa_backend, "SHARE_SPLITS", False)  # the whole GPU's split count: the same bits
    tables, inputs = _bpd(seed=4)
    res = {}
    for ov in (mode, "serial"):
        w = attncore.BatchPODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                     fuse=False, overlap=ov)
        w.plan(*tables, 32, 8, 128, 16, q_data_type=torch.bfloat16)
        res[ov] = w.run(*inputs, causal_p=True, return_lse=lse)
        assert w.mode == ov, w.overlap_reason
        assert (w._split is not None) == (ov == mode)
    torch.cuda.synchronize()
    for a, b in zip(_flat(res[mode]), _flat(res["serial"])):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["streams", "sm_split", "fused"])
def test_streams_graph_capture_replay_after_replan_gpu(mode):
    """The fork/join (or the fused launch: Triton's op, inside its measured region, as pod90 declines graph mode) is
    captured in a CUDA graph; a re-plan (new decode lengths, same batch size) and a replay give what an eager run of
    the new plan gives, bit for bit (serial for the composed modes, fused for the fused one: each output row is one
    work item's, whatever the work list's order)."""
    dev, dtype = "cuda", torch.bfloat16
    batch = 8 if mode == "fused" else 16
    kw = dict(backend="triton") if mode == "fused" else dict(fuse=False, overlap=mode)
    indptr, indices, last, cache, qp, kp, vp, qd = _pd(prefill=512, batch=batch, kv=1024)
    bufs = dict(paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.empty(cache.shape[0], dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=dev))
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    w = attncore.PODWithPagedKVCacheWrapper(ws, "NHD", True, **kw, **bufs)
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=dtype)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the default stream, as torch's graph recipe asks
        w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_d=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        (out_p, (out_d, lse_d)) = w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_d=True)
    assert w.mode == mode, (w.fused_reason, w.overlap_reason)
    # re-plan: shorter requests (same batch size, pages from the same cache)
    lens = [int(x) for x in torch.randint(0, 1024, (batch,))]
    pages = [(n + 15) // 16 for n in lens]
    indptr2 = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    indices2 = indices[:int(indptr2[-1])].contiguous()
    last2 = torch.tensor([(n - 1) % 16 + 1 if n else 0 for n in lens], dtype=torch.int32, device=dev)
    w.plan(indptr2, indices2, last2, 32, 8, 128, 16, q_data_type=dtype)
    g.replay()
    torch.cuda.synchronize()
    eager = kw if mode == "fused" else dict(fuse=False, overlap="serial")
    ref = attncore.PODWithPagedKVCacheWrapper(ws.clone(), "NHD", True, **eager,
                                              **{k: v.clone() for k, v in bufs.items()})
    ref.plan(indptr2, indices2, last2, 32, 8, 128, 16, q_data_type=dtype)
    want_p, (want_d, want_l) = ref.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_d=True)
    assert ref.mode == ("fused" if mode == "fused" else "serial")
    assert torch.equal(out_p, want_p) and torch.equal(out_d, want_d) and torch.equal(lse_d, want_l)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["streams", "sm_split"])
def test_streams_memory_flat_gpu(mode):
    """Repeated concurrent runs whose results are dropped leave the allocated memory where it was (no block
    kept alive, none lost to the forked streams)."""
    indptr, indices, last, cache, qp, kp, vp, qd = _pd(prefill=512, batch=16, kv=1024)
    w = attncore.PODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                            fuse=False, overlap=mode)
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    for _ in range(3):
        w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_p=True, return_lse_d=True)
    torch.cuda.synchronize()
    assert w.mode == mode
    base = torch.cuda.memory_allocated()
    for _ in range(20):
        r = w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_p=True, return_lse_d=True)
        del r
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


def test_auto_splits_only_where_the_model_was_fitted(monkeypatch):
    """overlap="auto" may split the SMs on sm_90 (decide() says per pair of parts) and composes in turn
    elsewhere, saying why; "streams" always forks, "serial" never.  The device is faked: only the choice is
    tested here."""
    from attncore.core import green, streams

    monkeypatch.setattr(green, "unavailable", lambda device: None)
    for cc, ov, want in (((9, 0), "auto", None), ((8, 0), "auto", "overlap='auto': serial on sm_80"),
                         ((8, 0), "sm_split", None), ((9, 0), "streams", None),
                         ((9, 0), "serial", "overlap='serial'")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        why = streams.Streams(ov, torch.device("cuda", 0)).unavailable()
        assert (why is None) if want is None else why.startswith(want), (cc, ov, why)
        if why is not None and cc == (8, 0):
            assert "pass overlap='sm_split'" in why
    monkeypatch.setattr(green, "unavailable", lambda device: "CUDA green contexts are not available on cuda:0: x")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    why = streams.Streams("sm_split", torch.device("cuda", 0)).unavailable()
    assert why.startswith("overlap='sm_split': CUDA green contexts are not available") and "one after the" in why
    assert "no CUDA streams on cpu" in streams.Streams("auto", torch.device("cpu")).unavailable()


def _count_part_checks(monkeypatch) -> list:
    """The part wrappers whose query check ran (a POD part's checks start with it), one entry per check."""
    from attncore.core import wrapper as _wrapper

    calls = []
    real = _wrapper._BatchWrapper._check_q
    monkeypatch.setattr(_wrapper._BatchWrapper, "_check_q", lambda self, q: (calls.append(self), real(self, q))[1])
    return calls


def _single_pod(backend="reference"):
    return attncore.PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend=backend)


@pytest.mark.parametrize("lse", [False, True])
@pytest.mark.parametrize("tuple_cache", [False, True])
def test_pod_run_of_a_seen_signature_skips_the_checks_and_equals_them(monkeypatch, lse, tuple_cache):
    """A POD run with the signature of an earlier run on the same plan skips the checks (host time) and gives
    what the checked run gives on the same inputs, bit for bit (LSEs, a (k, v) tuple cache); a plan() empties
    the memo, and a run of another shape is checked again and refused as before."""
    dt = torch.float16
    calls = _count_part_checks(monkeypatch)
    planned_p = []  # the prefill side's checked plans (its one-call cache included)
    real = _pod.plan_single
    monkeypatch.setattr(_pod, "plan_single", lambda **kw: (planned_p.append(1), real(**kw))[1])
    indptr, indices, last, cache, qp, kp, vp, qd = _pod_inputs(dt, seed=3)
    w, fresh = _single_pod(), _single_pod()
    for x in (w, fresh):
        x.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dt)
    checked = lambda: sum(c is w._decode for c in calls)  # noqa: E731  (w's checked runs)
    kw = dict(causal_p=True, return_lse_p=lse, return_lse_d=lse)
    as_cache = (lambda c: tuple(c.unbind(1))) if tuple_cache else (lambda c: c)
    w.run(qp, kp, vp, qd, as_cache(cache), **kw)
    assert checked() == 1
    # new values, same signature: no check, the same result as a checked run of a fresh wrapper
    _, _, _, cache2, qp2, kp2, vp2, qd2 = _pod_inputs(dt, seed=4)
    got = w.run(qp2, kp2, vp2, qd2, as_cache(cache2), **kw)
    assert checked() == 1 and len(planned_p) == 1
    want = fresh.run(qp2, kp2, vp2, qd2, as_cache(cache2), **kw)
    flat = lambda r: [t for part in r for t in (part if isinstance(part, tuple) else (part,))]  # noqa: E731
    assert len(flat(got)) == len(flat(want)) == (4 if lse else 2)
    assert all(torch.equal(a, b) for a, b in zip(flat(got), flat(want)))
    # another signature is checked again (and refused as before)
    with pytest.raises(ValueError, match=r"^q: got shape"):
        w.run(qp2, kp2, vp2, qd2[:2], as_cache(cache2), **kw)
    assert checked() == 2
    # plan() empties the memo: a batch of another size runs, checked, and the old signature is refused
    indptr3, indices3, last3, cache3, qp3, kp3, vp3, qd3 = _pod_inputs(dt, kv_lens=(4, 3), seed=5)
    w.plan(indptr3, indices3, last3, HQ, HKV, D, PAGE, q_data_type=dt)
    assert not w._run_memo
    w.run(qp3, kp3, vp3, qd3, as_cache(cache3), **kw)
    assert checked() == 3
    with pytest.raises(ValueError, match=r"^q: got shape"):
        w.run(qp2, kp2, vp2, qd2, as_cache(cache2), **kw)


def test_pod_run_of_a_seen_signature_runs_the_fused_op_as_checked(triton_pod, monkeypatch):
    """The same on Triton's fused op (its interpreter on the CPU): the memo's run launches the fused plan with the
    new inputs, equal to a checked run of a fresh wrapper."""
    dt = torch.float16
    calls = _count_part_checks(monkeypatch)
    indptr, indices, last, cache, qp, kp, vp, qd = _pod_inputs(dt, seed=6)
    w, fresh = _single_pod("triton"), _single_pod("triton")
    for x in (w, fresh):
        x.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dt)
    w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_d=True)
    _, _, _, cache2, qp2, kp2, vp2, qd2 = _pod_inputs(dt, seed=7)
    got = w.run(qp2, kp2, vp2, qd2, cache2, causal_p=True, return_lse_d=True)
    assert sum(c is w._decode for c in calls) == 1 and w.backend == "fused=triton"
    want = fresh.run(qp2, kp2, vp2, qd2, cache2, causal_p=True, return_lse_d=True)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_batch_pod_fused_run_of_a_seen_signature_skips_the_part_checks(triton_pod, monkeypatch):
    """BatchPOD's fused run checks each part's arguments once per signature and plan (the part wrapper's run cache,
    shared with its own run()); a repeat gives what a checked run of a fresh wrapper gives, and another shape is
    checked again and refused."""
    checked = _count_part_checks(monkeypatch)
    dt = torch.float16
    w, (qp, cp, qd, cd), _ = _batch_pod(torch.empty(1 << 20, dtype=torch.uint8), dt, backend="triton")
    fresh, _, _ = _batch_pod(torch.empty(1 << 20, dtype=torch.uint8), dt, backend="triton")
    w.run(qp, cp, qd, cd, causal_p=True, return_lse=True)
    assert w.backend == "fused=triton" and len(checked) == 2
    qp2, qd2 = torch.randn_like(qp), torch.randn_like(qd)
    got = w.run(qp2, cp, qd2, cd, causal_p=True, return_lse=True)
    assert len(checked) == 2
    want = fresh.run(qp2, cp, qd2, cd, causal_p=True, return_lse=True)
    assert all(torch.equal(a, b) for g, x in zip(got, want) for a, b in zip(g, x))
    with pytest.raises(ValueError, match=r"^q: got shape"):
        w.run(qp2[:3], cp, qd2, cd, causal_p=True, return_lse=True)
