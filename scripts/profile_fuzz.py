"""Where a fuzz worker's time goes: ``python scripts/profile_fuzz.py BACKEND N``; prints the top
functions by cumulative time (compiles, builds, golden, run)."""
import cProfile
import pstats
import sys

from attncore.testing import fuzz, resolve_backend

name, n = sys.argv[1], int(sys.argv[2])
backend, _ = resolve_backend(name)
prof = cProfile.Profile()
prof.enable()
rep = fuzz.fuzz(backend, n, seed=13, configs=int(sys.argv[3]) if len(sys.argv) > 3 else None)
prof.disable()
print(f"{name}: {rep.run} problems in {rep.seconds:.1f} s, {len(rep.mismatches)} mismatches")
pstats.Stats(prof).sort_stats("cumulative").print_stats(22)
