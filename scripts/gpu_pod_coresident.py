"""Issue 16, co-residency probe: can a prefill CTA and decode CTAs share an SM, so that two streams overlap?

Two streams measured 1.01x over serial on PD1/PD2 (BENCHMARKS 2f): the default prefill's CTAs fill every SM
(two per SM), so the decode CTAs only start when the prefill's last wave drains.  The hardware runs CTAs of
two kernels side by side on one SM when both fit its resources (H100: 64K registers, 228 KB shared memory
with 1 KB reserved per CTA, 2048 threads, 32 CTAs); a kernel launched first keeps dispatching its CTAs, and
the other kernel's CTAs go into what is left beside them.  So the pairs worth timing are a prefill whose
CTA takes at most one SM's worth of one kernel (one CTA per SM alone) and leaves room for one or more
decode CTAs.  Offline (sm_90 compiles of this session: Triton 3.9, nvcc 13.0; the H100 has Triton 3.6, so
the GPU run reads each kernel's registers and shared memory from its profiler trace and fits again):

    prefill (d128 causal bf16)            regs x thr   smem KB  alone/SM | decode            regs x thr  smem KB
    triton dense 128x64 w4 s2 (default)    255 x 128    96.0      2      | xqa mt1 st3 (def)  168 x 128  101.0
    triton dense 64x64 w4 s3 (1 loop)      139 x 128   112.1      2      | xqa mt1 st2        166 x 128   69.0
    triton dense 64x64 w4 s2               139 x 128    80.0      2      | cuda_fa2 decode    153 x 128  100.0
    triton dense 128x64 w8 s3              139 x 256   128.1      1      | triton 16x64 w4s2  255 x 128   22.0
    cuda_fa2 prefill64                     197 x 128    80.5      2      |
    cuda_fa2 prefill90 (plain)             175 x 256   161.0      1      |
    cuda_fa2 prefill90 ws (default)        168 x 384   225.0      1      |

Beside one prefill CTA (fit() below): 128x64 w8 s3 holds 1 xqa st2 (not the default xqa: 98.9 KB left,
102 KB needed), prefill90 plain holds no xqa (an xqa CTA needs 21.5K registers, 20.5K are left) and no
cuda_fa2 decode (shared memory); the 2-per-SM prefills hold one decode CTA beside one of theirs, but a
prefill launched first with more CTAs than SMs puts two of its own there and leaves no room: of these,
only 128x64 w8 s3 + xqa st2 co-resides at the prefill's full occupancy (``fits``: decode_beside_full).  Pairs (``PAIRS``) and, for PD1 and PD2, three modes each: serial (prefill then decode
on one stream), streams with the decode launched first, streams with the prefill first
(``attncore.core.streams.Streams.compose(prefill_first=)``), timed with triton.testing.do_bench (median),
plus each part alone (the bound: max(prefill, decode)).  Every mode's outputs (NaN-poisoned first) must equal
the pair's serial outputs bit for bit, and the serial outputs of each part must be within the project's
tolerance of the fp64 golden (attncore.testing.golden) on a slice (2 kv heads of the prefill, 4 decode
requests).  A torch.profiler trace of a few streams iterations gives each kernel's grid, block, registers
and shared memory, and the fraction of the shorter part's kernel time that overlapped the other stream.

    python scripts/gpu_pod_coresident.py [--json PATH] [--workloads PD1,PD2] [--pairs NAME,...] [--cpu]

On the GPU the JSON goes to $OUT/pod_coresident.json when OUT is set.  --cpu (or no GPU): tiny shapes, the
Triton interpreter and the reference backend, serial only (the smoke path tests/test_pod_coresident_script.py
runs).  The default POD policy is not changed by this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from attncore.cli.bench_pod import POD_WORKLOADS, PODWorkload

# one SM of an H100 (sm_90): what co-resident CTAs share
SM90 = dict(regs=65536, smem=228 * 1024, cta_reserved=1024, threads=2048, ctas=32)


@dataclass(frozen=True)
class Res:
    """One kernel's per-CTA resources: registers per thread, threads per CTA, shared memory in bytes."""
    regs: int
    threads: int
    smem: int

    def cta_regs(self) -> int:  # allocated per warp in units of 256 (8 registers per thread)
        return -(-max(self.regs, 1) // 8) * 8 * 32 * -(-self.threads // 32)


def fit(used: List[Res], extra: Res, sm: dict = SM90) -> int:
    """How many CTAs of ``extra`` fit on one SM beside the CTAs ``used`` (0: none)."""
    regs = sm["regs"] - sum(r.cta_regs() for r in used)
    smem = sm["smem"] - sum(r.smem + sm["cta_reserved"] for r in used)
    thr = sm["threads"] - sum(r.threads for r in used)
    ctas = sm["ctas"] - len(used)
    if min(regs, smem, thr, ctas) < 0:
        return 0
    return max(0, min(regs // extra.cta_regs(), smem // (extra.smem + sm["cta_reserved"]),
                      thr // extra.threads, ctas))


def _triton_dense(bm, bn, w, st, ws=False):
    from attncore.backends.triton.backend import TritonBackend

    return TritonBackend(dense=dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st, warp_specialize=ws,
                                    one_loop=True, branch=True))


def _fa2(config: str, ws: bool = True):
    from attncore.backends.cuda_fa2.backend import CudaFa2Backend

    be = CudaFa2Backend()
    be.force_config, be.sm90_ws = config, ws
    return be


def _xqa(stages: Optional[int] = None):
    from attncore.backends.xqa.backend import XqaBackend

    be = XqaBackend()
    be.tune = (("st", stages),) if stages else ()
    return be


def _registered(name: str):
    from attncore.core import registry

    return registry.get_backend(name)


# name -> a backend instance with its config pinned (None: what auto picks for the part)
PREFILLS = {
    "auto": lambda: None,
    "t128x64w8s3": lambda: _triton_dense(128, 64, 8, 3),
    "t64x64w4s3": lambda: _triton_dense(64, 64, 4, 3),
    "fa2p64": lambda: _fa2("prefill64"),
    "fa2p90": lambda: _fa2("prefill90", ws=False),
    "triton": lambda: _registered("triton"),  # CPU smoke path
}
DECODES = {
    "auto": lambda: None,
    "xqa": lambda: _xqa(),
    "xqa_st2": lambda: _xqa(2),
    "fa2d": lambda: _fa2("decode"),
    "tdec": lambda: _registered("triton"),
    "triton": lambda: _registered("triton"),
}
# the defaults first (the reference row), then pairs predicted to co-reside, then controls that should not
PAIRS = ["auto+auto", "t128x64w8s3+xqa_st2", "t128x64w8s3+tdec", "t128x64w8s3+xqa", "fa2p90+tdec",
         "t64x64w4s3+xqa_st2", "fa2p64+xqa_st2"]
CPU_PAIRS = ["auto+auto", "triton+triton"]


# PD1/PD2 as `attncore bench --pod` defines them (one home: attncore/cli/bench_pod.py)
WORKLOADS = {w.id: w for w in POD_WORKLOADS}


def tiny(w: PODWorkload) -> PODWorkload:
    return dataclasses.replace(w, qo=24, batch=3, kv=40, hq=4, hkv=2, d=32, page=4)


class Inputs:
    """One workload's tensors, the auto-planned parts (their problems and batches) and the golden slices."""

    def __init__(self, w: PODWorkload, device: str, dtype):
        from attncore.core.single_prefill import plan_single
        from attncore.decode import BatchDecodeWithPagedKVCacheWrapper
        from attncore.pod import _paged_args

        g = torch.Generator(device="cpu").manual_seed(w.qo + w.batch)
        rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
        self.w, self.device, self.dtype = w, device, dtype
        pages = -(-w.kv // w.page)
        self.indptr = torch.arange(w.batch + 1, dtype=torch.int32) * pages
        self.last = torch.full((w.batch,), w.kv - (pages - 1) * w.page, dtype=torch.int32)
        self.indices = torch.randperm(w.batch * pages, generator=g).to(torch.int32)
        self.cache = rnd(w.batch * pages, 2, w.page, w.hkv, w.d)
        self.qp, self.kp, self.vp = rnd(w.qo, w.hq, w.d), rnd(w.qo, w.hkv, w.d), rnd(w.qo, w.hkv, w.d)
        self.qd = rnd(w.batch, w.hq, w.d)
        self.planned_p, self.args_p = plan_single(
            q=self.qp, k=self.kp, v=self.vp, custom_mask=None, packed_custom_mask=None, causal=True, kv_layout="NHD",
            pos_encoding_mode="NONE", sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None,
            rope_theta=None, return_lse=False, backend="auto", sinks=None, q_scale=None, k_scale=None, v_scale=None,
            out=None, lse=None)
        self.ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        self.dec = BatchDecodeWithPagedKVCacheWrapper(self.ws, "NHD")
        self.dec.plan(self.indptr, self.indices, self.last, w.hq, w.hkv, w.d, w.page, q_data_type=dtype)
        self.args_d = _paged_args(self.dec, self.qd, self.cache, None, None, None, False)

    def part(self, which: str, be):
        """(launch callable, its output, backend name) of one part on ``be`` (None: auto's plan)."""
        planned, args = (self.planned_p, self.args_p) if which == "prefill" else (self.dec._planned, self.args_d)
        args = dataclasses.replace(args, out=torch.empty_like(args.out))
        if be is None:
            b, plan = planned.backend, planned._primary[1]
        else:
            if not be.supports(planned.problem):
                raise ValueError(f"{be.name} cannot serve the {which}: " + "; ".join(map(str, be.reasons(planned.problem))))
            # its own int workspace (None: the backend allocates one), so candidates never share tables
            b, plan = be, be.plan(planned.problem, dataclasses.replace(planned.meta, int_workspace=None))
        return (lambda: b.run(plan, args)), args.out, b.name

    def golden_errors(self, out_p, out_d) -> Dict[str, float]:
        """max error / tolerance of each part's output on a slice (1 means at the bound)."""
        from attncore.testing.golden import golden_and_baseline, max_error, tolerance

        w, dev = self.w, self.device
        kh = min(2, w.hkv)
        hq = kh * (w.hq // w.hkv)
        res = {}
        go, _, bo, _ = golden_and_baseline(self.qp[:, :hq], self.kp[:, :kh], self.vp[:, :kh], dtype=self.dtype,
                                           device=dev, causal=True)
        res["prefill"] = max_error(out_p[:, :hq], go) / tolerance(bo, go, self.dtype)
        pages = self.indices.view(w.batch, -1).long()
        worst = 0.0
        for b in range(min(4, w.batch)):
            kv = self.cache[pages[b].to(self.cache.device)]  # [pages, 2, page, hkv, d]
            k = kv[:, 0].reshape(-1, w.hkv, w.d)[:w.kv]
            v = kv[:, 1].reshape(-1, w.hkv, w.d)[:w.kv]
            go, _, bo, _ = golden_and_baseline(self.qd[b:b + 1], k, v, dtype=self.dtype, device=dev)
            worst = max(worst, max_error(out_d[b:b + 1], go) / tolerance(bo, go, self.dtype))
        res["decode"] = worst
        return res


def prebuild(inp: Inputs, pairs: List[str], jobs: int = 8) -> Dict[str, float]:
    """Build the CUDA libraries the pairs need, in parallel (a fresh machine builds each on first use, one at a
    time: minutes); {uri: seconds}.  Backends without JIT specs (Triton) are skipped."""
    from concurrent.futures import ThreadPoolExecutor

    from attncore.build import jit

    keys = {}
    for pair in pairs:
        pn, _, dn = pair.partition("+")
        for which, be in (("prefill", PREFILLS[pn]()), ("decode", DECODES[dn]())):
            problem = (inp.planned_p if which == "prefill" else inp.dec._planned).problem
            if be is not None and be.name == "xqa":
                k = be.key_for(problem, 1)
            elif be is not None and be.name == "cuda_fa2":
                k = be.key_for(problem, be.force_config, inp.w.page if which == "decode" else 0, which == "decode")
            else:
                continue
            keys[k.uri] = k.spec()
    arch = jit.current_arch()

    def one(spec):
        try:
            return spec.uri, round(jit.build_spec(spec, arch).seconds, 1)
        except Exception as e:  # the pair that needs it reports the error when it loads the library
            return spec.uri, f"{type(e).__name__}: {str(e)[:120]}"
    with ThreadPoolExecutor(jobs) as ex:
        return dict(ex.map(one, keys.values()))


def _timer(device: str):
    if device != "cuda":
        def t(fn):
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return t
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")


def _poison(*ts) -> None:
    for t in ts:
        t.fill_(float("nan"))


def trace(modes: Dict[str, tuple], iters: int = 5) -> Dict:
    """Run each streams mode ``iters`` times under torch.profiler; per mode the kernels (name, grid, block,
    registers, shared memory, mean us, stream) and the overlap: the time both streams ran a kernel at once over
    the shorter stream's kernel time (1.0: the shorter part ran entirely beside the other)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, (run, _) in modes.items():
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                run()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile("w+", suffix=".json", delete=False) as f:
            path = f.name
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f).get("traceEvents", []) if e.get("cat") == "kernel"]
        os.unlink(path)
        out[name] = summarize(events)
    return out


def summarize(events: List[dict]) -> Dict:
    """Kernels and overlap of chrome-trace kernel events (``ts``/``dur`` in us, ``args``: stream, grid, ...)."""
    kernels: Dict[str, dict] = {}
    by_stream: Dict[int, List[tuple]] = {}
    for e in sorted(events, key=lambda e: e["ts"]):  # first seen = first launched (the serial trace: the prefill)
        a = e.get("args", {})
        s = a.get("stream", 0)
        by_stream.setdefault(s, []).append((e["ts"], e["ts"] + e["dur"]))
        k = kernels.setdefault(e["name"][:60], dict(grid=a.get("grid"), block=a.get("block"), stream=s, n=0, us=0.0,
                                                      regs=a.get("registers per thread"),
                                                      smem=a.get("shared memory"),
                                                      occupancy=a.get("est. achieved occupancy %")))
        k["n"] += 1
        k["us"] += e["dur"]
    for k in kernels.values():
        k["us"] = round(k["us"] / k["n"], 2)
    busy = {s: sum(b - a for a, b in _union(iv)) for s, iv in by_stream.items()}
    both = 0.0
    if len(by_stream) == 2:
        (_, a), (_, b) = by_stream.items()
        both = _overlap(_union(a), _union(b))
    shorter = min(busy.values()) if len(busy) == 2 else 0.0
    return dict(kernels=kernels, overlap=round(both / shorter, 3) if shorter else 0.0, streams=len(by_stream))


def _union(iv: List[tuple]) -> List[tuple]:
    out: List[list] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


def _overlap(a: List[tuple], b: List[tuple]) -> float:
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def measure_pair(inp: Inputs, pair: str, timer, device: str, profile: bool) -> Dict:
    from attncore.core.streams import Streams

    pn, dn = pair.split("+")
    row: Dict = {"workload": inp.w.id, "pair": pair}
    try:
        run_p, out_p, row["prefill_backend"] = inp.part("prefill", PREFILLS[pn]())
        run_d, out_d, row["decode_backend"] = inp.part("decode", DECODES[dn]())
    except Exception as e:  # a pair this machine cannot build or serve: the row says why
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return row
    streams = Streams("streams", torch.device(device))

    def serial():
        run_p(), run_d()
    modes = {"serial": (serial, None)}
    if device == "cuda":
        modes["decode_first"] = (lambda: streams.compose(run_p, run_d, prefill_first=False), None)
        modes["prefill_first"] = (lambda: streams.compose(run_p, run_d, prefill_first=True), None)
    _poison(out_p, out_d)
    serial()
    if device == "cuda":
        torch.cuda.synchronize()
    ref_p, ref_d = out_p.clone(), out_d.clone()
    row["golden"] = {k: round(v, 3) for k, v in inp.golden_errors(ref_p, ref_d).items()}
    row["correct"] = all(v <= 1.0 for v in row["golden"].values())
    for name, (run, _) in modes.items():
        _poison(out_p, out_d)
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        same = torch.equal(out_p, ref_p) and torch.equal(out_d, ref_d)
        row[f"{name}_equal"] = same
        row["correct"] = row["correct"] and same
        row[name] = timer(run)
    row["prefill_alone"] = timer(run_p)
    row["decode_alone"] = timer(run_d)
    row["bound"] = max(row["prefill_alone"], row["decode_alone"])
    for m in ("decode_first", "prefill_first"):
        if m in row:
            row[f"{m}_x"] = row["serial"] / row[m]
    if profile and device == "cuda":
        try:
            row["trace"] = trace({m: modes[m] for m in ("serial", "decode_first", "prefill_first")})
            row["fit"] = fit_from_trace(row["trace"]["serial"]["kernels"])
        except Exception as e:  # the profiler is a diagnostic: its failure does not lose the timings
            row["trace_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def fit_from_trace(kernels: Dict[str, dict]) -> Optional[Dict]:
    """From the serial trace's two largest kernels (by time: the prefill and the decode, first launched first):
    how many CTAs of each fit on an SM alone, and decode CTAs beside one prefill CTA, by the measured resources."""
    ks = [(n, k) for n, k in kernels.items() if k.get("regs") and k.get("block")]
    if len(ks) < 2:
        return None
    res = [(n, Res(int(k["regs"]), int(k["block"][0] * k["block"][1] * k["block"][2]), int(k["smem"] or 0)))
           for n, k in ks]
    (pn, p), (dn, d) = res[0], max(res[1:], key=lambda t: kernels[t[0]]["us"])
    return fits(p, d, prefill=pn, decode=dn)


def fits(p: Res, d: Res, **names) -> Dict:
    """CTAs per SM: each kernel alone, decode CTAs beside one prefill CTA, and beside as many prefill CTAs
    as fit alone (what a prefill launched first with more CTAs than SMs leaves: the case that matters)."""
    pa = fit([], p)
    return dict(names, prefill_alone=pa, decode_alone=fit([], d), decode_beside_one=fit([p], d),
                decode_beside_full=fit([p] * pa, d))


def run(workloads: List[str], pairs: List[str], device: str, profile: bool = True, progress=print) -> Dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    timer = _timer(device)
    rows: List[Dict] = []
    info: Dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows}
    for wid in workloads:
        if wid not in WORKLOADS:
            raise ValueError(f"--workloads: unknown {wid!r}; known: {', '.join(WORKLOADS)}")
        w = WORKLOADS[wid] if device == "cuda" else tiny(WORKLOADS[wid])
        inp = Inputs(w, device, dtype)
        if device == "cuda" and "builds" not in info:
            t0 = time.perf_counter()
            info["builds"] = prebuild(inp, [p for p in pairs if p.partition("+")[0] in PREFILLS
                                            and p.partition("+")[2] in DECODES])
            progress(f"prebuilt in {time.perf_counter() - t0:.0f} s: {info['builds']}")
        for pair in pairs:
            pn, _, dn = pair.partition("+")
            if pn not in PREFILLS or dn not in DECODES:
                raise ValueError(f"--pairs: {pair!r}: expected PREFILL+DECODE with PREFILL in {', '.join(PREFILLS)} "
                                 f"and DECODE in {', '.join(DECODES)}")
            rows.append(measure_pair(inp, pair, timer, device, profile))
            progress(fmt_row(rows[-1]))
        del inp
        if device == "cuda":
            torch.cuda.empty_cache()
    return info


def _ms(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else "-"


def fmt_row(r: Dict) -> str:
    if "error" in r:
        return f"{r['workload']:<4} {r['pair']:<22} error: {r['error']}"
    ov = r.get("trace", {})
    ovs = "/".join(f"{ov[m]['overlap']:.2f}" for m in ("decode_first", "prefill_first") if m in ov) or "-"
    f = r.get("fit") or {}
    fits = "/".join(str(f.get(k, "-")) for k in ("prefill_alone", "decode_alone", "decode_beside_one",
                                                    "decode_beside_full"))
    return (f"{r['workload']:<4} {r['pair']:<22} {_ms(r['prefill_alone']):>7} {_ms(r['decode_alone']):>7} "
            f"{_ms(r['serial']):>7} {_ms(r.get('decode_first')):>7} {_ms(r.get('prefill_first')):>7} "
            f"{r.get('decode_first_x', 0):>6.2f} {r.get('prefill_first_x', 0):>6.2f} {ovs:>9} {fits:>7} "
            f"{'ok' if r['correct'] else 'WRONG'} {r['golden']}")


def format_table(info: Dict) -> str:
    head = (f"{'wl':<4} {'prefill+decode':<22} {'P alone':>7} {'D alone':>7} {'serial':>7} {'D first':>7} "
            f"{'P first':>7} {'Dx':>6} {'Px':>6} {'overlap':>9} {'fit':>7} check (golden err/tol) backends")
    lines = [f"POD co-residency on {info['device']} (ms, median; x = serial / streams; overlap = D first / P first: "
             f"share of the shorter stream's kernel time beside the other; fit = CTAs per SM from the traced "
             f"resources: P alone / D alone / D beside one P / D beside a full SM of P)", head]
    lines += [fmt_row(r) for r in info["rows"]]
    ok = [r for r in info["rows"] if "error" not in r and r["correct"]]
    for wid, target in (("PD1", None), ("PD2", 0.40)):
        rs = [r for r in ok if r["workload"] == wid]
        if not rs:
            continue
        base = next((r["serial"] for r in rs if r["pair"] == "auto+auto"), None)
        best = min(rs, key=lambda r: min(r.get("decode_first", 1e9), r.get("prefill_first", 1e9), r["serial"]))
        t = min(best.get("decode_first", 1e9), best.get("prefill_first", 1e9), best["serial"])
        goal = (f"target < {0.85 * base:.3f} (0.85x serial {base:.3f})" if target is None and base
                else f"target < {target:.2f}" if target else "")
        lines.append(f"{wid}: best {t:.3f} ms ({best['pair']}); {goal}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="PD1,PD2")
    ap.add_argument("--pairs", default=None, help=f"comma-separated PREFILL+DECODE (default: {','.join(PAIRS)})")
    ap.add_argument("--json", default=None, help="write the rows here (default: $OUT/pod_coresident.json if OUT is set)")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (Triton interpreter), serial only")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler traces")
    a = ap.parse_args(argv)
    device = "cpu" if a.cpu or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--cpu: set TRITON_INTERPRET=1 before running (the Triton backend runs on the CPU only "
                         "through its interpreter)")
    pairs = a.pairs.split(",") if a.pairs else (PAIRS if device == "cuda" else CPU_PAIRS)
    info = run(a.workloads.split(","), pairs, device, profile=not a.no_profile,
               progress=lambda s: print(s, file=sys.stderr, flush=True))
    path = a.json or (os.path.join(os.environ["OUT"], "pod_coresident.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(info, f, indent=1, default=str)
    print(format_table(info))
    return 0 if all(r.get("correct", True) for r in info["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
