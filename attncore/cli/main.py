"""The ``attncore`` command: info, explain, check, bench, tune, build, conformance."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from typing import List, Optional

from attncore.cli import arg_types


class UsageError(Exception):
    """A bad argument found after parsing: main() reports it as argparse does (usage, exit 2)."""


def _known_backend(name: str) -> None:
    from attncore.core import registry

    try:
        registry.get_entry(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _runnable_device(device: Optional[str]) -> None:
    """check and bench run on ``device`` (explain only describes a problem on it)."""
    from attncore.testing.placement import parse_device

    if device is not None:
        try:
            parse_device(device)
        except ValueError as e:
            raise UsageError(f"--device {e}") from None


def _versions() -> List[str]:
    import torch

    lines = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except Exception as e:  # noqa: BLE001 - report, never fail
        lines.append(f"triton not importable ({type(e).__name__})")
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
            lines.append("nvcc " + out.strip().splitlines()[-1])
        except Exception:  # noqa: BLE001
            lines.append(f"nvcc at {nvcc} (version unknown)")
    else:
        lines.append("nvcc not found")
    return lines


def cmd_info(args) -> int:
    import torch

    from attncore import __version__
    from attncore.core import registry
    from attncore.core.capabilities import summarize

    print(f"attncore {__version__}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            print(f"device cuda:{i}: {torch.cuda.get_device_name(i)} (sm{cc[0]}{cc[1]})")
    else:
        print("device: cpu (no CUDA GPU)")
    for line in _versions():
        print(line)
    print("\nbackends:")
    for name, e in sorted(registry.entries().items()):
        rs = e.unavailable_reasons()
        state = "available" if not rs else "unavailable: " + "; ".join(map(str, rs))
        print(f"  {name} [{e.origin}] {state}")
        if e.backend is not None:
            if e.backend.description:
                print(f"      {e.backend.description}")
            for line in summarize(e.backend.capabilities):
                print(f"      {line}")
    return 0


_PAGED_OPS = ("batch_prefill_paged", "batch_decode", "xqa_decode", "batch_pod")
_POD_OPS = ("pod", "batch_pod")


def _problem_from_args(a):
    import torch

    from attncore.core.checks import check_heads
    from attncore.core.problem import AttentionProblem

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cc = None
    if device == "cuda":
        if a.cc:
            cc = a.cc
        elif torch.cuda.is_available():
            cc = tuple(torch.cuda.get_device_capability())
        else:
            cc = (9, 0)
    hq, hkv = a.heads
    try:  # the API's own rule, so explain never shows a problem the API would reject
        check_heads(hq, hkv, a.head_dim)
    except ValueError as e:
        raise UsageError(f"--heads {hq}/{hkv}: {e}") from None
    from attncore.core.fp8_query import compute_dtype

    q_dtype = compute_dtype(a.q_dtype, a.out_dtype)  # an fp8 q is upcast before selection, as the API does
    kv_dtype = a.kv_dtype or a.q_dtype
    paged = a.op in _PAGED_OPS
    page_size = a.page_size or 16
    mask = a.mask or ("causal" if a.op in ("batch_decode", "xqa_decode") else "none")
    problem = AttentionProblem(
        op=a.op, device_type=device, compute_capability=cc, q_dtype=q_dtype, kv_dtype=kv_dtype,
        out_dtype=a.out_dtype or a.q_dtype, num_qo_heads=hq, num_kv_heads=hkv,
        head_dim_qk=a.head_dim, head_dim_vo=a.head_dim_vo or a.head_dim, page_size=page_size if paged else None,
        kv_layout=a.layout, mask=mask, window_left=a.window, soft_cap=a.soft_cap, pos_encoding=a.pos,
        sinks=a.sinks, fp8_scales=a.fp8_scales, return_lse=a.lse, q_len_per_req=a.q_len, spec_mask=a.spec_mask,
        cuda_graph=a.cuda_graph)
    if a.op in _POD_OPS:  # the options describe the prefill part; the decode part: causal, paged
        from attncore.core.problem import pod_problem

        decode = problem.replace(op="batch_decode", page_size=page_size, mask="causal")
        return pod_problem(a.op, problem, decode)
    return problem


def _explain_unused(a) -> None:
    """A usage error for an explain argument the problem of --op has no use for (never silently dropped)."""
    if a.page_size is not None and a.op not in _PAGED_OPS + ("pod",):
        raise UsageError(f"--page-size: --op {a.op} reads no paged KV cache")
    if a.q_len != 1 and a.op not in ("batch_decode", "xqa_decode"):
        raise UsageError(f"--q-len: query tokens per request of a decode op (batch_decode, xqa_decode); got --op {a.op}"
                         + (" (a POD's decode part takes one)" if a.op in _POD_OPS else ""))
    if a.pod_sizes and a.op not in _POD_OPS:
        raise UsageError(f"--pod-sizes: describes a POD; give --op pod or --op batch_pod (got --op {a.op})")
    if a.sms is not None and not a.pod_sizes:
        raise UsageError("--sms: the GPU size of --pod-sizes' SM split; give --pod-sizes")
    if a.sizes and a.op in _POD_OPS:
        raise UsageError("--sizes: picks a tuned op's measured bucket, and POD ops are not tuned; --pod-sizes gives a "
                         "POD's sizes")


def cmd_explain(a) -> int:
    from attncore.core.selector import explain

    if a.backend != "auto":
        _known_backend(a.backend)
    _explain_unused(a)
    problem = _problem_from_args(a)
    from attncore.core.tables import Sizes

    try:  # the planned sizes pick the measured bucket (attncore.core.ranking)
        sizes = Sizes.parse(a.sizes) if a.sizes else None
    except ValueError as err:
        raise UsageError(f"--sizes {err}") from None
    ex = explain(problem, a.backend, sizes)
    if problem.q_dtype != a.q_dtype:  # an fp8 q (attncore.core.fp8_query)
        from attncore.core.fp8_query import note

        ex.note = "; ".join(x for x in (ex.note, note(a.q_dtype, problem.q_dtype, problem.out_dtype, "--out-dtype"))
                            if x)
    print(ex)
    if a.pod_sizes:
        print(_pod_fused_line(a, ex))
        print(_pod_split_line(a, problem))
    return 0 if ex.chosen else 1


def _pod_fused_line(a, ex) -> str:
    """``--pod-sizes``: whether the fused op auto picked would fuse a POD of these sizes, or why it composes."""
    from attncore.core import registry

    qo, kv, batch, kv_d = _pod_sizes(a)
    if not ex.chosen:
        return "pod fused: no backend runs this POD fused; the parts are composed"
    decide = getattr(registry.get_backend(ex.chosen), "fused_pod_reason", None)
    if decide is None or ex.problem.device_type != "cuda":  # e.g. Triton's interpreter: its cost model, per batch
        return f"pod fused: {ex.chosen} decides at plan() from the whole batch"
    reason = decide(qo, batch, kv_d)
    return (f"pod fused: {ex.chosen} " + ("fuses these sizes (one launch)" if reason is None
                                          else f"composes these sizes: {reason}"))


def _pod_sizes(a) -> tuple:
    """``--pod-sizes`` as (prefill rows, prefill kv, decode batch, decode kv)."""
    try:
        qo, kv, batch, kv_d = (int(x) for x in a.pod_sizes.split(","))
        if min(qo, kv, batch, kv_d) < 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--pod-sizes: got {a.pod_sizes!r}, expected PREFILL_QO,PREFILL_KV,DECODE_BATCH,DECODE_KV "
                         f"(non-negative integers, e.g. 2048,2048,64,4096)") from None
    return qo, kv, batch, kv_d


def _pod_split_line(a, problem) -> str:
    """``--pod-sizes``: how overlap="auto" runs the composed parts of a POD of these sizes (the SM split's model)."""
    from attncore.core import streams
    from attncore.core.problem import pod_parts

    qo, kv, batch, kv_d = _pod_sizes(a)
    pp, pd = pod_parts(problem)
    flops, nbytes = streams.part_work(pp, [(qo, kv)], pd, [kv_d] * batch)
    import torch

    here = problem.device_type == "cuda" and torch.cuda.is_available()
    sms, whose = a.sms, "given"
    if sms is None:
        if here:
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            sms, whose = props.multi_processor_count, "this GPU's"
        else:
            sms, whose = 132, "an H100's: no GPU here, --sms sets it"
    margin = streams.split_margin() if here else streams.SPLIT_MARGINS["default"]
    return (f"pod sizes: prefill {qo} x {kv} keys, decode {batch} x {kv_d} keys, {sms} SMs ({whose}): "
            + streams.describe_split(flops, nbytes, sms, problem.compute_capability or (0, 0), margin))


def _given(a, *names) -> List[str]:
    """The options among ``names`` (attribute names) set on the command line (not None / False)."""
    return ["--" + n.replace("_", "-") for n in names if getattr(a, n) not in (None, False)]


def _refuse_unused(given: List[str], context: str) -> None:
    """A usage error naming the options ``given`` that a run in ``context`` would not use (none: nothing)."""
    if given:
        raise UsageError(f"{', '.join(given)}: not used {context}")


def _check_unused(a) -> None:
    """A usage error for a check argument the run it asks for would not use (never silently dropped)."""
    if a.replay is not None:
        _refuse_unused(_given(a, "fuzz", "seed", "configs", "jobs", "quick", "json"),
                       "with --replay (it reruns the one problem its seed names)")
    elif a.fuzz is not None:
        _refuse_unused(_given(a, "quick"), "with --fuzz (it draws its own problems)")
    else:
        _refuse_unused(_given(a, "seed", "configs", "jobs"), "without --fuzz (options of a --fuzz run)")


def cmd_check(a) -> int:
    from attncore.core import registry
    from attncore.cli.check import format_table, fuzz_command, run_check

    _runnable_device(a.device)
    _check_unused(a)
    if a.seed is None:
        a.seed = 0
    if a.fuzz is not None or a.replay is not None:
        from attncore.testing import resolve_backend

        names = a.backend or sorted(registry.available_backends())
        for n in names:  # a registered name or module:attr, like `attncore conformance`
            try:
                _, unavailable = resolve_backend(n)
            except (ImportError, AttributeError, TypeError, ValueError) as e:
                raise UsageError(f"--backend {n}: {e}") from None
            if unavailable:
                raise UsageError(f"backend {n!r} is unavailable here: " + "; ".join(map(str, unavailable)))
        return fuzz_command(a, names)
    names = a.backend or None
    if names:
        for n in names:
            try:
                registry.get_backend(n)  # unknown/unavailable: a clear error now, not per case
            except ValueError as e:
                raise UsageError(str(e)) from None
    else:
        es = registry.entries()
        for n, e in sorted(es.items()):
            if not e.is_available:
                print(f"skipping {n}: " + "; ".join(map(str, e.unavailable_reasons())), file=sys.stderr)
    results = run_check(names, quick=a.quick, device=a.device, stream=a.stream,
                        progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(results))
    _write_json(a.json, [r.__dict__ for r in results])
    ran = [r for r in results if r.status in ("pass", "FAIL", "ERROR")]
    if not ran:
        print("no case ran", file=sys.stderr)
        return 1
    return 1 if any(r.status in ("FAIL", "ERROR") for r in results) else 0


def _bench_unused(a, pod_ids, only_pod: bool) -> None:
    """A usage error for an argument this kind of bench run would not use (never silently dropped).  ``only_pod``:
    every workload named is a POD one (or none is)."""
    if a.latency:
        _refuse_unused(_given(a, "workload", "pod_sweep", "plot", "pod_backend", "page_order", "sustain"),
                       "with --latency (it times tiny problems of its own)")
        return
    _refuse_unused(_given(a, "calls"), "without --latency (an option of its timing)")
    pod = bool(pod_ids or a.pod_sweep)
    if pod and a.sustain is not None:  # its points share one input set: back to back, small ones would run from L2
        raise UsageError("--sustain: times the non-POD workloads; the POD rows (PD1 / PD2, --pod-sweep) keep "
                         "do_bench's flushed calls")
    if a.pod_backend and not pod:
        raise UsageError("--pod-backend: the backend of the POD rows' fused op; name PD1 / PD2 with --workload "
                         "or give --pod-sweep")
    if pod and only_pod and a.backend:  # POD rows only
        raise UsageError("--backend: the POD rows run each composed part on auto's pick and the fused op of "
                         "--pod-backend; --backend applies to the other workloads, and none is named")


def cmd_bench(a) -> int:
    from attncore.cli import bench_pod
    from attncore.cli.bench import PAGE_ORDERS, format_table, run_bench

    _runnable_device(a.device)
    for n in a.backend or ():
        if n != "auto":  # auto beside named backends: the selector's pick timed in the same run
            _known_backend(n)  # an unavailable one gets an n/a row with its reasons
    pod_ids = [i for i in a.workload or () if i in {w.id for w in bench_pod.POD_WORKLOADS}]
    only_pod = len(pod_ids) == len(a.workload or ())  # no other workload named
    _bench_unused(a, pod_ids, only_pod)
    if a.latency:  # issue 15: host time per call of tiny problems (attncore/cli/latency.py)
        return _bench_latency(a)
    if a.flashinfer:
        import torch

        from attncore.cli.bench import _import_flashinfer

        try:
            _import_flashinfer(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except ValueError as e:
            raise UsageError(str(e)) from None
    progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    page_order = a.page_order or PAGE_ORDERS[0]  # the default where it is used (--latency refuses it given)
    pinfo = None
    if pod_ids or a.pod_sweep or a.plot:  # POD workloads (issue 16): fused vs serial (vs FlashInfer)
        if a.plot and not (pod_ids or a.pod_sweep):
            raise UsageError("--plot: plots the POD rows; give --workload PD1/PD2 or --pod-sweep")
        try:
            if a.plot:
                bench_pod.check_plot()
            pinfo = bench_pod.run_pod_bench(pod_ids or None, sweep=a.pod_sweep, device=a.device,
                                            pod_backend=a.pod_backend, flashinfer=a.flashinfer, progress=progress,
                                            page_order=page_order, rounds=a.rounds)
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(bench_pod.format_pod_table(pinfo))
        if a.plot:
            bench_pod.plot(pinfo, a.plot)
        if only_pod:
            _write_json(a.json, pinfo)
            return 0
    info = run_bench(a.backend or None, ids=[i for i in a.workload or () if i not in pod_ids] or None,
                     device=a.device, page_order=page_order, flashinfer=a.flashinfer,
                     progress=progress, rounds=a.rounds, sustain=a.sustain)
    print(format_table(info))
    _write_json(a.json, info if pinfo is None else dict(info, pod=pinfo))  # one file: both runs' rows
    return 0


def _write_json(path, data) -> None:
    """--json: ``data`` into ``path`` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)


def _bench_latency(a) -> int:
    from attncore.cli.latency import format_latency, run_latency

    try:
        info = run_latency(a.backend or None, device=a.device, calls=a.calls, flashinfer=a.flashinfer,
                           progress=lambda s: print(s, file=sys.stderr, flush=True), rounds=a.rounds)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(format_latency(info))
    _write_json(a.json, info)
    return 0


def cmd_tune(a) -> int:
    import torch

    from attncore.cli import tune

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.list:  # the grid of any device, also one not here
        _refuse_unused(_given(a, "backend", "fresh", "resume", "json", "table"),
                       "with --list (it prints the grid and measures nothing)")
        cases = tune.grid(device, a.quick, a.op, a.head_dim)
        for c in cases:
            print(c.describe())
        print(f"{len(cases)} grid points")
        return 0
    if a.fresh and a.resume:
        raise UsageError("--fresh replaces the cached table, --resume skips what it holds: give one")
    _runnable_device(a.device)
    for n in a.backend or ():
        _known_backend(n)  # an unavailable one is recorded as such in every grid point
    saved = {"fresh": a.fresh}

    def keep(point):  # each grid point is saved as it is measured: a cut-off run keeps its points
        saved["path"], saved["table"] = tune.save(point, fresh=saved["fresh"], path=a.table)
        saved["fresh"] = False

    try:  # a --table of another device is refused before anything is measured into it
        done = tune.load_cached(device, a.table) if (a.resume or a.table) and not a.fresh else None
    except ValueError as err:
        raise UsageError(f"--table {err}") from None
    done = done if a.resume else None
    table = tune.run_tune(a.backend or None, quick=a.quick, ops=a.op, head_dims=a.head_dim, device=device, done=done,
                          on_entry=keep, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(tune.format_table(table))
    if "table" not in saved:
        print("nothing left to measure: every grid point of this run is in the cached table (--resume)")
        return 0 if done else 1
    path, written = saved["path"], saved["table"]
    use = "auto ranks by it unless ATTNCORE_TUNE=0" if a.table is None else "--table: not the cache auto reads"
    print(f"table: {path} ({len(written['entries'])} grid points in all; {use})")
    _write_json(a.json, written)
    return 0 if any(e["times_ms"] for e in table["entries"]) else 1


def cmd_build(a) -> int:
    from attncore.build import jit
    from attncore.core.registry import canonical_name

    backend = canonical_name(a.backend)
    # names and URIs first: a typo is reported as such, also where nothing can be built
    try:
        jit.list_specs(backend, a.arch)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        specs = [jit.parse_uri(backend, u) for u in a.spec]
    except ValueError as e:  # the first line: a URI grammar may follow
        raise UsageError(str(e).splitlines()[0] + f" (attncore build {backend} --list shows the URIs)") from None
    if a.list:
        _refuse_unused((["spec URIs"] if a.spec else []) + _given(a, "force"),
                       "with --list (it prints every specialization and builds nothing)")
        for s in jit.list_specs(backend, a.arch):
            print(f"{s.uri_for(jit.default_arch(a.arch))}  {s.text()}")
        return 0
    rs = jit.toolchain_reasons()
    if rs:
        print("cannot build: " + "; ".join(map(str, rs)), file=sys.stderr)
        return 1
    for r in jit.build(backend, specs or None, arch=a.arch, force=a.force):
        state = f"built in {r.seconds:.1f} s" if r.built else "cached"
        print(f"{r.spec.uri_for(r.arch)}: {state} -> {r.path}")
    return 0


def cmd_conformance(a, extra: List[str]) -> int:
    from attncore.testing import run_conformance

    if ":" not in a.name:  # module:attr is resolved (and its errors shown) by the suite
        _known_backend(a.name)
    return run_conformance(a.name, extra)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="attncore", description="attncore: attention backends, checked")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="device, versions and every backend with its state and capabilities")

    e = sub.add_parser("explain", help="which backend serves a problem, and why the others refuse",
                       usage="%(prog)s [options]")
    e.add_argument("--op", default="batch_decode",
                   choices=["single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode",
                            "xqa_decode", "pod", "batch_pod"])
    e.add_argument("--device", choices=["cpu", "cuda"])
    e.add_argument("--cc", type=arg_types.cc, help="compute capability for cuda, e.g. 9.0")
    e.add_argument("--q-dtype", type=arg_types.dtype("q"), default="bfloat16",
                   help="float16, bfloat16 or float32; e4m3/e5m2 (upcast exactly, as the API does)")
    e.add_argument("--kv-dtype", type=arg_types.dtype("kv"), help="default: the q dtype; also e4m3, e5m2")
    e.add_argument("--out-dtype", type=arg_types.dtype("kv"), help="default: the q dtype")
    e.add_argument("--heads", type=arg_types.heads, default="32/8", help="Hq/Hkv, e.g. 32/8")
    e.add_argument("--head-dim", type=arg_types.positive, default=128, help="q/k head dim (and v's, by default)")
    e.add_argument("--head-dim-vo", type=arg_types.positive,
                   help="v/output head dim when it differs from q/k's (DeepSeek-style 192/128)")
    e.add_argument("--page-size", type=arg_types.positive, help="paged ops (and a POD's decode part): default 16")
    e.add_argument("--layout", default="NHD", choices=["NHD", "HND"])
    e.add_argument("--mask", choices=["none", "causal", "custom"])
    e.add_argument("--window", type=arg_types.window, default=-1,
                   help="sliding window (keys left of the diagonal); -1: off")
    e.add_argument("--soft-cap", action="store_true")
    e.add_argument("--pos", default="NONE", choices=["NONE", "ROPE_LLAMA", "ALIBI"])
    e.add_argument("--sinks", action="store_true")
    e.add_argument("--fp8-scales", action="store_true")
    e.add_argument("--lse", action="store_true")
    e.add_argument("--q-len", type=arg_types.positive, default=1)
    e.add_argument("--spec-mask", action="store_true")
    e.add_argument("--cuda-graph", action="store_true")
    e.add_argument("--backend", default="auto")
    e.add_argument("--sizes", metavar="B,QO,KV", help="planned batch, longest query, longest KV: the measured "
                                                     "ranking uses their bucket (default: all buckets' mean)")
    e.add_argument("--pod-sizes", metavar="QO,KV,B,KV_D", help="with --op pod/batch_pod: prefill query rows and "
                   "keys, decode batch and keys per request: how overlap='auto' runs the composed parts (the SM "
                   "split's model)")
    e.add_argument("--sms", type=arg_types.positive, help="with --pod-sizes: the GPU's SMs (default: this GPU's, "
                   "else an H100's 132)")

    c = sub.add_parser("check", help="cross-check backends against the fp64 golden (exit 1 on any failure)")
    c.add_argument("--backend", action="append", help="backend name (repeatable); default: all available")
    c.add_argument("--quick", action="store_true", help="a smaller suite")
    c.add_argument("--device", type=arg_types.device_name, help="cpu, cuda or cuda:N (default: cuda when present)")
    c.add_argument("--stream", choices=["default", "side"], default="default",
                   help="side: run every case on a fresh stream of the device (the current device left alone)")
    c.add_argument("--json", metavar="FILE")
    c.add_argument("--fuzz", type=arg_types.positive, metavar="N",
                   help="N random problems per backend over every claimed axis instead of the fixed cases")
    c.add_argument("--seed", type=int, help="seed of the --fuzz run (default 0)")
    c.add_argument("--replay", type=int, metavar="SEED", help="replay one problem that --fuzz printed")
    c.add_argument("--configs", type=arg_types.positive, metavar="C",
                   help="kernel configurations the N problems share (default: N/150 within 4..128 on a "
                        "GPU, N on the CPU)")
    c.add_argument("--jobs", type=arg_types.positive, metavar="J", help="--fuzz worker processes (default 1)")

    from attncore.cli.bench import PAGE_ORDERS, WORKLOADS

    b = sub.add_parser("bench", help="time the standard workloads with the ceilings and torch SDPA")
    b.add_argument("--backend", action="append", help="backend (repeatable; auto: the selector's pick); default: auto")
    b.add_argument("--workload", action="append", type=arg_types.workload,
                   help="workload id (repeatable; a prefix such as P1 runs every P1-*): "
                        + ", ".join(w.id for w in WORKLOADS) + ", PD1, PD2 (POD); default: all but POD")
    b.add_argument("--page-order", choices=PAGE_ORDERS,
                   help="page table of the paged workloads (POD's decode part too): a shuffled (fragmented) cache "
                        "(the default), or pages in order")
    b.add_argument("--flashinfer", action="store_true",
                   help="also time the importable flashinfer package on each workload, in the same run")
    b.add_argument("--device", choices=["cpu", "cuda"])
    b.add_argument("--json", metavar="FILE", help="the rows as JSON; with POD workloads (or --pod-sweep) and others, "
                   "the POD rows under the key 'pod'")
    b.add_argument("--latency", action="store_true",
                   help="host time per call of tiny problems (one-call functions, plan, run), per backend")
    b.add_argument("--calls", type=arg_types.positive, metavar="N",
                   help="--latency: calls per cell (default 300, CPU 5)")
    b.add_argument("--rounds", type=arg_types.positive, metavar="N",
                   help="timings per figure, the columns (backends, FlashInfer, SDPA; --latency: the rows) "
                        "interleaved; the median is shown (default 3, CPU 1)")
    b.add_argument("--sustain", type=arg_types.seconds, metavar="SECS",
                   help="time each figure (ceilings too) as calls back to back for SECS seconds over inputs rotated "
                        "beyond L2, the mean per call, instead of do_bench's median of calls each after an L2 "
                        "flush: a serving step's stream of kernels, and a compute-bound kernel at the board's "
                        "power limit")
    b.add_argument("--pod-sweep", action="store_true",
                   help="POD sweep: prefill 512/2k/8k x decode batch 8/32/128 x kv 1k/4k/16k, fused vs serial")
    b.add_argument("--pod-backend", help="the backend whose fused POD op is timed (default: the one auto ranks first "
                                         "for POD here: cuda_fa2 on sm_90, else triton)")
    b.add_argument("--plot", metavar="FILE.png", help="plot the POD rows' speedup over serial (needs matplotlib)")

    from attncore.cli.tune import TUNE_OPS

    t = sub.add_parser("tune", help="time every available backend on a grid of problem classes; auto then "
                                    "ranks by the measured times")
    t.add_argument("--quick", action="store_true", help="one grid point per op (tiny shapes on the CPU)")
    t.add_argument("--backend", action="append", help="backend (repeatable); default: every available one "
                                                      "(on a GPU all but the reference)")
    t.add_argument("--op", action="append", choices=list(TUNE_OPS), help="only these ops (repeatable)")
    t.add_argument("--head-dim", action="append", type=int, choices=[64, 128, 192, 256],
                   help="only these (QK) head dims (repeatable; 192: DeepSeek's 192 / 128 pair)")
    t.add_argument("--device", choices=["cpu", "cuda"])
    t.add_argument("--fresh", action="store_true", help="replace the cached table instead of merging into it")
    t.add_argument("--resume", action="store_true", help="skip what the cached table already holds (a backend "
                                                         "at a grid point); each point is saved as it is measured")
    t.add_argument("--list", action="store_true", help="print the grid points and exit")
    t.add_argument("--json", metavar="FILE", help="also write the resulting table (the cache file) to FILE")
    t.add_argument("--table", metavar="FILE", help="merge into (and --resume from) FILE instead of the cache, "
                                                   "e.g. a copy of attncore/data/tune-sm90.json")

    bl = sub.add_parser("build", help="prebuild CUDA kernel specializations into the cache")
    bl.add_argument("backend", nargs="?", default="cuda_fa2")
    bl.add_argument("spec", nargs="*", help="specialization URIs (default: the common set)")
    bl.add_argument("--list", action="store_true", help="list the specializations instead")
    bl.add_argument("--arch", type=arg_types.arch, help="target arch, e.g. 90 (default: the current GPU, else 90)")
    bl.add_argument("--force", action="store_true", help="rebuild even if cached")

    cf = sub.add_parser("conformance", help="run the conformance suite on one backend (extra args go to pytest)")
    cf.add_argument("name")

    args, extra = p.parse_known_args(argv)
    if extra and args.cmd != "conformance":
        p.error("unrecognized arguments: " + " ".join(extra))
    commands = {"info": cmd_info, "explain": cmd_explain, "check": cmd_check, "bench": cmd_bench,
                "tune": cmd_tune, "build": cmd_build}
    try:
        if args.cmd == "conformance":
            return cmd_conformance(args, extra)
        return commands[args.cmd](args)
    except UsageError as err:
        sub.choices[args.cmd].error(str(err))  # exits 2


if __name__ == "__main__":
    sys.exit(main())
