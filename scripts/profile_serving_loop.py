"""Where a step of examples/serving_loop.py goes: wall time per step kind (mixed POD steps, decode
graph replays) for attncore and, when importable, FlashInfer, in one process; then, for each API, the
GPU kernels by total time (torch.profiler) and the host functions by own time (cProfile) of one run;
with --syncs, every call that made the host wait for the GPU (torch.cuda.set_sync_debug_mode), by step kind
and call site; with --calls, the wall time of each attention-library call (plan, run, RoPE, append) and of
the model's dense halves, per step kind (the loop is host-bound, so this is mostly their host time).

    PYTHONPATH=<repo>[:$FI_ROOT] python3 scripts/profile_serving_loop.py [--flashinfer] [--top 12]
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import serving_loop as sl  # noqa: E402


class StepKind:
    """Which kind of step the server is in (``now``: "mixed", "decode", or "other" between steps), how many
    of each it ran (``steps``) and, with ``timed``, each one's wall time up to a device sync (``seconds``), by
    wrapping its step methods."""

    def __init__(self, server, timed: bool = False):
        self.now, self.steps, self.seconds = "other", collections.Counter(), collections.defaultdict(list)
        for name in ("_mixed_step", "_decode_step"):
            f = getattr(server, name)

            def step(*a, _f=f, _k=name[1:-5], **kw):
                self.now = _k
                self.steps[_k] += 1
                t = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    if timed:
                        torch.cuda.synchronize()
                        self.seconds[_k].append(time.perf_counter() - t)
                    self.now = "other"
            setattr(server, name, step)


def sync_sites(server, seed: int, top: int) -> None:
    """Serve once with torch's sync debug mode on; print each call site (innermost attncore or example frame,
    and its caller) that synchronised the host with the GPU, per step kind."""
    import traceback
    import warnings
    counts, kind = collections.Counter(), StepKind(server)

    def ours(fr):
        return ("attncore" in fr.filename or "serving_loop" in fr.filename) and "profile_serving" not in fr.filename

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [fr for fr in traceback.extract_stack()[:-1] if ours(fr)]
        site = " < ".join(f"{'/'.join(fr.filename.split('/')[-2:])}:{fr.lineno}({fr.name})" for fr in frames[::-1][:2])
        counts[(kind.now, site or f"{filename}:{lineno}")] += 1
    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            sl.serve(server, False, seed=seed)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    print(f"syncs by step kind and site (steps: {dict(kind.steps)}):")
    for (k, site), n in counts.most_common(top):
        print(f"  {n:6d}  {k:6s} {site}")


class _CallTimer:
    """Wall time per (step kind, call) of one serve: the library calls of a step and the model's halves."""

    def __init__(self, server):
        self.acc = collections.defaultdict(lambda: [0, 0.0])
        self.kind = StepKind(server)
        self.server, self.saved = server, (server.api, server.model.pre, server.model.post)
        self.wrappers = []
        for wname in ("mixed", "prefill", "decode"):
            w = getattr(server, wname, None)
            if w is not None:
                self.wrappers.append(w)
                for m in ("plan", "run"):
                    setattr(w, m, self.wrap(getattr(w, m), f"{wname}.{m}"))
        server.api = _Proxy(server.api, self)
        server.model.pre = self.wrap(server.model.pre, "model.pre")
        server.model.post = self.wrap(server.model.post, "model.post")

    def restore(self) -> None:
        """The server's API, model halves and wrapper methods untimed again (its step methods keep the
        tracker)."""
        self.server.api, self.server.model.pre, self.server.model.post = self.saved
        for w in self.wrappers:
            for m in ("plan", "run"):
                if m in vars(w):
                    delattr(w, m)

    def wrap(self, f, label):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                cell = self.acc[(self.kind.now, label)]
                cell[0] += 1
                cell[1] += time.perf_counter() - t
        return timed

    def report(self, name: str) -> None:
        print(f"{name}: wall time per call kind (ms in all / calls / us per call):")
        for (k, label), (n, t) in sorted(self.acc.items(), key=lambda x: (x[0][0], -x[1][1])):
            print(f"  {k:6s} {label:32s} {t * 1e3:8.1f} ms {n:6d}x {t / n * 1e6:8.1f} us")


class _Proxy:
    """The API module with its RoPE and append functions timed."""

    def __init__(self, api, timer):
        self._api = api
        self.apply_rope_pos_ids_inplace = timer.wrap(api.apply_rope_pos_ids_inplace, "apply_rope_pos_ids_inplace")
        self.append_paged_kv_cache = timer.wrap(api.append_paged_kv_cache, "append_paged_kv_cache")

    def __getattr__(self, name):
        return getattr(self._api, name)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--flashinfer", action="store_true")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"], help="cProfile's order")
    p.add_argument("--only", default="", help="cProfile: only functions whose file:line(name) matches this regex")
    p.add_argument("--no-kernels", action="store_true", help="skip the torch.profiler run")
    p.add_argument("--syncs", action="store_true", help="also list the host-GPU syncs of one run by call site")
    p.add_argument("--calls", action="store_true", help="also time each library call of one run, per step kind")
    p.add_argument("--no-cprofile", action="store_true", help="skip the cProfile run")
    a = p.parse_args()
    import attncore
    apis = [("attncore", attncore)]
    if a.flashinfer:
        import flashinfer
        apis.append(("flashinfer", flashinfer))
    cfg, dev = sl.Config(), torch.device("cuda")
    model = sl.Model(cfg, dev, "inductor")
    for name, api in apis:
        server = sl.Server(api, cfg, model, dev, True)
        sl.serve(server, False, seed=99)
        sl.serve(server, False, seed=1)  # captures and compiles of these requests
        acc = StepKind(server, timed=True).seconds
        r = sl.serve(server, False, seed=1)
        print(f"{name}: {r['tokens'] / r['seconds']:.0f} tokens/s, {r['seconds'] * 1e3:.0f} ms; " + ", ".join(
            f"{k} {len(v)} x {1e3 * sum(v) / len(v):.2f} ms" for k, v in acc.items() if v), flush=True)
        if not a.no_kernels:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                sl.serve(server, False, seed=1)
            rows = sorted(((e.key, e.device_time_total, e.count) for e in prof.key_averages()), key=lambda x: -x[1])
            print(f"{name}: GPU time {sum(x[1] for x in rows) / 1e3:.1f} ms in all")
            for k, t, n in rows[:a.top]:
                print(f"  {t / 1e3:8.2f} ms {n:6d}x  {k[:100]}")
        if a.syncs:
            sync_sites(server, 1, a.top)
        if a.calls:
            timer = _CallTimer(server)
            sl.serve(server, False, seed=1)
            timer.report(name)
            timer.restore()
        if a.no_cprofile:
            continue
        pr = cProfile.Profile()
        pr.enable()
        sl.serve(server, False, seed=1)
        pr.disable()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s).sort_stats(a.sort)
        st.print_stats(*([a.only] if a.only else []), a.top)
        print(f"{name}: host functions by {a.sort} time (cProfile)")
        print("\n".join(ln for ln in s.getvalue().splitlines() if ln.strip()[:1].isdigit()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
