"""Host time of a batch wrapper's plan() and run() on a tiny problem with host-side index tensors
(FlashInfer's convention), through the public API (issue 15 item 1).  Runs anywhere; on the CPU the
Triton backend goes through its interpreter (set TRITON_INTERPRET=1, as the tests do), whose plan is
the same Python as on a GPU.

    TRITON_INTERPRET=1 python scripts/profile_plan.py --op decode --backend triton --batch 64 [--profile]
    python scripts/profile_plan.py --op decode --fake-cuda-fa2 --batch 64 [--profile]
    python scripts/profile_plan.py --op batch_pod --backend auto --batch 31 --device-tables   (a serving step's
        BatchPOD plan and run, index tensors on the GPU as a serving loop keeps them)

``--fake-cuda-fa2`` (CPU only) plans on cuda_fa2 with the CPU fakes of ``tests/test_cuda_fa2.py``
(``cpu_patches``: the device, the library's tile shape and the stream faked; the problem says an sm90 CUDA
device and the backend is available): the schedule, the tables and the params structs are the real ones,
so plan()'s Python is timed as on a GPU, without the pinned copy (CPU figures, not GPU ones).  run() is not
timed in that mode.

run() on the interpreter is dominated by the interpreted kernel, so ``--stub-kernels`` (default on
the CPU for triton) times run() with the kernel launches replaced by no-ops after the first run: what
is left is attncore's own host work per run() (checks, launch-cache lookup, table re-send check).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import time

import torch

import attncore


def build(op: str, backend: str, batch: int, device: str, gpu_sizes: bool = False, device_tables: bool = False):
    """(plan, run) zero-argument callables of one tiny problem (inputs and wrapper made once); ``gpu_sizes``:
    the GPU's sizes on any device (the cuda_fa2 fakes: its head dims start at 64); ``device_tables``: the index
    tensors on ``device``, as a serving loop keeps them (else on the host, FlashInfer's convention).
    ``batch_pod``: one prefill request of ``qo`` rows over the first request's pages beside ``batch`` decodes."""
    if device == "cuda" or gpu_sizes:  # the sizes of `attncore bench --latency` on a GPU (attncore/cli/latency.py)
        hq, hkv, d, page, pages_per_req, qo, dt = 32, 8, 128, 16, 8, 16, torch.bfloat16
    else:
        hq, hkv, d, page, pages_per_req, qo, dt = 4, 2, 32, 4, 4, 4, torch.float16
    g = torch.Generator().manual_seed(0)
    tables = device if device_tables else "cpu"
    indptr = (torch.arange(batch + 1, dtype=torch.int32) * pages_per_req).to(tables)
    indices = torch.randperm(batch * pages_per_req, generator=g).to(torch.int32).to(tables)
    last = torch.randint(1, page + 1, (batch,), generator=g, dtype=torch.int32).to(tables)
    cache = torch.randn(batch * pages_per_req, 2, page, hkv, d, generator=g).to(device=device, dtype=dt)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    if op == "decode":
        w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        q = torch.randn(batch, hq, d, generator=g).to(device=device, dtype=dt)

        def plan():
            w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dt, kv_data_type=dt)
    elif op == "batch_pod":
        # on the CPU the parts are composed: their launches can be stubbed, an interpreted fused kernel not
        w = attncore.BatchPODWithPagedKVCacheWrapper(ws, "NHD", backend=backend, fuse=device != "cpu")
        qp, qd = (torch.randn(n, hq, d, generator=g).to(device=device, dtype=dt) for n in (qo, batch))
        i32 = lambda x: torch.tensor(x, dtype=torch.int32).to(tables)  # noqa: E731
        p_tables = (i32([0, pages_per_req]), indices[:pages_per_req], last[:1])
        qo_p, qo_d = i32([0, qo]), i32(list(range(batch + 1)))

        def plan():
            w.plan(qo_p, *p_tables, qo_d, indptr, indices, last, hq, hkv, d, page, q_data_type=dt, kv_data_type=dt)
        return w, plan, (lambda: w.run(qp, cache, qd, cache, causal_p=True))
    else:
        w = attncore.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        qo_indptr = (torch.arange(batch + 1, dtype=torch.int32) * qo).to(tables)
        q = torch.randn(batch * qo, hq, d, generator=g).to(device=device, dtype=dt)

        def plan():
            w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=True, q_data_type=dt,
                   kv_data_type=dt)
    return w, plan, (lambda: w.run(q, cache))


def build_one_call(op: str, backend: str, device: str):
    """A one-call function of the sizes of ``attncore bench --latency`` (attncore/cli/latency.py): a
    zero-argument callable, and a function returning its cached plan (to stub its launches)."""
    from attncore.core import plan_cache

    if device == "cuda":
        hq, hkv, d, qo, kv, dt = 32, 8, 128, 16, 128, torch.bfloat16
    else:
        hq, hkv, d, qo, kv, dt = 4, 2, 32, 4, 16, torch.float16
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dt)  # noqa: E731
    q, k, v, qd = rnd(qo, hq, d), rnd(kv, hkv, d), rnd(kv, hkv, d), rnd(hq, d)
    if op == "single_prefill":
        fn = lambda: attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend=backend)  # noqa: E731
    else:
        fn = lambda: attncore.single_decode_with_kv_cache(qd, k, v, backend=backend)  # noqa: E731

    def planned():
        plan_cache.ONE_CALL_PLANS.clear()
        fn()
        plans = {id(v[0]): v[0] for v in plan_cache.ONE_CALL_PLANS._d.values()}  # single decode: two keys, one plan
        (plan,) = plans.values()
        return plan
    return fn, planned


def fake_cuda_fa2() -> contextlib.ExitStack:
    """cuda_fa2's plan() on the CPU: tests/test_cuda_fa2.py's cpu_patches, the problem's device read as an
    sm90 GPU and the backend made available (selection then runs as on the GPU)."""
    import unittest.mock as um

    from attncore.core import _api, registry

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_cuda_fa2 import cpu_patches

    stack = cpu_patches()
    stack.enter_context(um.patch.object(_api, "device_info", lambda d: ("cuda", (9, 0))))
    stack.enter_context(um.patch.object(registry.entries()["cuda_fa2"], "_available", []))
    return stack


def stub_kernels(w=None, plan=None) -> int:
    """Replace the triton plan's (a wrapper's, or ``plan``, an ``attncore.core._api.Planned``) prepared
    launchers with no-ops (host time of run() without the interpreted kernel); returns how many were
    replaced."""
    if plan is None and hasattr(w, "_prefill"):  # a POD wrapper: both parts
        return stub_kernels(w._prefill) + stub_kernels(w._decode)
    plan = w._planned if plan is None else plan
    n = 0
    _, p = plan.variant(return_lse=False, sinks=False, fp8_scales=False)
    cache = getattr(p, "launch_cache", None)
    if cache is None:
        return 0
    noop = lambda *a: None  # noqa: E731
    for k in list(cache):
        cache[k] = (noop, noop)
        n += 1
    return n


def timed(fn, reps: int, rounds: int = 5) -> float:
    """us per call: the best of ``rounds`` rounds of ``reps`` calls (the least disturbed by the machine)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, time.perf_counter() - t)
    return best / reps * 1e6


def profile(fn, reps: int, top: int = 20, sort: str = "tottime") -> str:
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(top)
    return s.getvalue()


def stub_wanted(a, backend: str) -> bool:
    """--stub-kernels: on, or auto (Triton's kernels on the CPU, where the interpreter would be timed)."""
    names = {part.split("=")[-1] for part in backend.split()}  # a POD wrapper: "prefill=triton decode=triton"
    return a.stub_kernels == "on" or (a.stub_kernels == "auto" and a.device == "cpu" and "triton" in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=("decode", "paged_prefill", "batch_pod", "single_prefill", "single_decode"),
                    default="decode", help="single_*: the one-call function (a plan() and run() in one call)")
    ap.add_argument("--device-tables", action="store_true",
                    help="index tensors on the device (as a serving loop keeps them), not on the host")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stub-kernels", choices=("auto", "on", "off"), default="auto",
                    help="run() without the triton kernel launches (auto: on for triton on the CPU)")
    ap.add_argument("--profile", action="store_true", help="cProfile of plan() and run()")
    ap.add_argument("--sort", choices=("tottime", "cumulative"), default="tottime", help="--profile: the order")
    ap.add_argument("--top", type=int, default=20, help="--profile: the functions shown")
    ap.add_argument("--fake-cuda-fa2", action="store_true",
                    help="CPU: plan() on cuda_fa2 with tests/test_cuda_fa2.py's fakes (plan only)")
    a = ap.parse_args()
    if a.device_tables and (a.op.startswith("single") or a.fake_cuda_fa2):
        ap.error("--device-tables: the one-call ops take no index tables, and --fake-cuda-fa2 plans on the CPU")
    if a.fake_cuda_fa2:
        if a.device != "cpu":
            ap.error("--fake-cuda-fa2 is for the CPU (on a GPU, pass --backend cuda_fa2)")
        a.backend = "cuda_fa2"
        with fake_cuda_fa2():
            w, plan, _ = build(a.op, a.backend, a.batch, a.device, gpu_sizes=True)
            t_plan = timed(plan, a.reps)
            print(f"{a.op} cuda_fa2 (CPU fakes) batch {a.batch} on cpu: plan {t_plan:.1f} us "
                  f"(config {w._planned._primary[1].config})")
            if a.profile:
                print("---- plan()\n" + profile(plan, a.reps, a.top, a.sort))
        return
    if a.op.startswith("single"):
        fn, planned = build_one_call(a.op, a.backend, a.device)
        p = planned()
        stubbed = stub_wanted(a, p.backend_name)
        if stubbed:
            stub_kernels(plan=p)
        t = timed(fn, a.reps)
        if a.device == "cuda":
            torch.cuda.synchronize()
        print(f"{a.op} {a.backend} (chose {p.backend_name}) on {a.device}: call {t:.1f} us"
              f"{' (kernels stubbed)' if stubbed else ''}")
        if a.profile:
            print("---- call\n" + profile(fn, a.reps, a.top, a.sort))
        return
    w, plan, run = build(a.op, a.backend, a.batch, a.device, device_tables=a.device_tables)
    t_plan = timed(plan, a.reps)
    plan()
    run()
    stubbed = stub_wanted(a, w.backend)
    if stubbed:
        stub_kernels(w)
    t_run = timed(run, a.reps)
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(f"{a.op} {a.backend} (chose {w.backend}) batch {a.batch} on {a.device}: plan {t_plan:.1f} us, "
          f"run {t_run:.1f} us{' (kernels stubbed)' if stubbed else ''}")
    if a.profile:
        print("---- plan()\n" + profile(plan, a.reps, a.top, a.sort))
        plan()  # a new plan: its first run prepares the launchers, stubbed again
        run()
        if stubbed:
            stub_kernels(w)
        print("---- run()\n" + profile(run, a.reps, a.top, a.sort))


if __name__ == "__main__":
    main()
