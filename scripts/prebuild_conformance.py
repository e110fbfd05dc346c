"""Build every cuda_fa2 specialization the conformance suite may load, in parallel, before the suite
runs (the suite itself builds on first use, one library at a time).  Run on the GPU machine:

    python3 scripts/prebuild_conformance.py [--dry]

Over-approximates: for each computed case it builds every tile config plan() could pick for it.
"""

import sys
import time

from attncore.build import jit
from attncore.testing import resolve_backend
from attncore.testing.cases import generate


def candidate_keys(backend, p):
    page = p.page_size or 0
    configs = ["decode", "prefill"]
    if p.mask == "causal" and p.head_dim_qk != 256:
        configs.append("prefill64")
    if p.compute_capability is not None and tuple(p.compute_capability) == (9, 0) \
            and not backend._problem_sm90_reasons(p):
        configs.append("prefill90")
    keys = {backend.key_for(p, c, page, page > 0) for c in configs}
    if p.op in ("batch_prefill_paged", "batch_decode"):
        keys |= {backend.key_for(p, "decode", 1, True), backend.key_for(p, "decode", 16, True)}
    return keys


def main():
    backend, unavailable = resolve_backend("cuda_fa2")
    if unavailable:
        sys.exit(f"cuda_fa2 unavailable: {unavailable}")
    fams = generate(backend)
    keys = set()
    for fam in ("numerics", "merge", "cuda_graph"):
        for case in fams[fam]:
            try:
                keys |= candidate_keys(backend, case.problem)
            except ValueError:
                pass
    specs = []
    for k in sorted(keys, key=lambda k: k.uri):
        try:
            specs.append(k.spec())
        except ValueError:  # a combination no plan() builds (e.g. prefill90 of a feature)
            pass
    print(f"{len(specs)} specializations for {sum(len(fams[f]) for f in ('numerics', 'merge', 'cuda_graph'))} cases")
    if "--dry" in sys.argv:
        print("\n".join(s.uri for s in specs))
        return
    t = time.time()
    res = jit.build("cuda_fa2", specs)
    print(f"built {sum(1 for r in res if r.seconds)} (reused {sum(1 for r in res if not r.seconds)}) "
          f"in {time.time() - t:.0f} s")


if __name__ == "__main__":
    main()
