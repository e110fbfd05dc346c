"""What a cold Triton fuzz run compiles: ``python scripts/profile_triton_compiles.py N CONFIGS [SEED]``.

Runs ``attncore check --fuzz N --configs CONFIGS`` for triton in-process with Triton's JIT hooks
installed, and prints per kernel how many variants compiled and the seconds spent, then which
specialization fields differed between variants of the same configuration (what made a
configuration compile more than once).  Run it with a fresh ``TRITON_CACHE_DIR`` to see a cold cache.
"""
import collections
import sys
import time

import triton

from attncore.testing import fuzz, resolve_backend

n, configs = int(sys.argv[1]), int(sys.argv[2])
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 13
events = []  # (kernel, repr, seconds)
_start = {}


def _before(*, key, fn, **_):
    _start[key] = time.perf_counter()
    return False  # go on compiling


def _after(*, key, fn, compile, **_):
    try:  # a hook must never break the run it watches
        names = fn.jit_function.arg_names
        spec = " ".join(f"{names[k[0]] if isinstance(k, tuple) else k}={v}"
                        for k, v in compile["constants"].items() if v is not None)
        spec = f"w{compile['num_warps']} s{compile['num_stages']} {spec}"
    except Exception as e:  # noqa: BLE001
        spec = f"(unreadable: {e!r})"
    events.append((fn.name, spec, time.perf_counter() - _start.pop(key, time.perf_counter())))
    print(f"compiled {events[-1][2]:6.1f} s {fn.name} {spec[:700]}", flush=True)  # as it happens


triton.knobs.runtime.jit_cache_hook = _before
triton.knobs.runtime.jit_post_compile_hook = _after

backend, _ = resolve_backend("triton")
t0 = time.perf_counter()
rep = fuzz.fuzz(backend, n, seed=seed, configs=configs)
wall = time.perf_counter() - t0
compile_s = sum(e[2] for e in events)
print(f"triton: {rep.run} problems, {configs} configs, {len(rep.mismatches)} mismatches, {wall:.1f} s wall, "
      f"{len(events)} compiles taking {compile_s:.1f} s")
per = collections.defaultdict(list)
for name, r, s in events:
    per[name].append(s)
for name, ts in sorted(per.items(), key=lambda kv: -sum(kv[1])):
    print(f"  {name:24s} {len(ts):4d} variants {sum(ts):7.1f} s (max {max(ts):.1f})")
for name, spec, sec in sorted(events, key=lambda e: -e[2]):
    print(f"  {sec:6.1f} s {name} {spec[:600]}")
for m in rep.mismatches[:5]:
    print("MISMATCH", m.seed, m.problem, m.errors[:2])
