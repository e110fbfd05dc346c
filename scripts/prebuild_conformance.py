"""Build every cuda_fa2 specialization the conformance suite may load, in parallel, before the suite
runs (the suite itself builds on first use, one library at a time).  Run on the GPU machine:

    python3 scripts/prebuild_conformance.py [--dry] [--flashinfer-tests]

Over-approximates: for each computed case it builds every tile config plan() could pick for it.
``--flashinfer-tests``: instead, the features FlashInfer 0.2.14's test files combine (scripts/
compat_flashinfer.sh): head dims 64/128/256, fp16/bf16, every mask, one of RoPE / soft cap / ALiBi,
fp8 KV for decode, so that the compat run spends its time testing, not compiling one library at a time.
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


def flashinfer_test_keys():
    from attncore.backends.cuda_fa2.specs import HEAD_DIMS, Fa2Key

    feats = [{}, {"rope": True}, {"softcap": True}, {"alibi": True}]
    keys = set()
    for dt in ("fp16", "bf16"):
        for d in HEAD_DIMS:
            for f in feats:
                for m in ("none", "causal", "custom"):
                    keys.add(Fa2Key("prefill", dt, "same", d, m, **f))
                    if d != 256 and m == "causal":
                        keys.add(Fa2Key("prefill64", dt, "same", d, m, **f))
                for kv in ("same", "e4m3", "e5m2"):
                    for pf in (False, True):
                        keys.add(Fa2Key("decode", dt, kv, d, "causal", prefetch=pf, **f))
    return keys


def main():
    if "--flashinfer-tests" in sys.argv:
        specs = [k.spec() for k in sorted(flashinfer_test_keys(), key=lambda k: k.uri)]
        print(f"{len(specs)} specializations for FlashInfer's test files")
        if "--dry" not in sys.argv:
            t = time.time()
            res = jit.build("cuda_fa2", specs)
            print(f"built {sum(1 for r in res if r.seconds)} in {time.time() - t:.0f} s")
        return
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
