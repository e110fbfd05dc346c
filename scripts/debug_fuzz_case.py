"""Bisect one fuzz mismatch over its features: ``python scripts/debug_fuzz_case.py BACKEND SEED``.
Prints, for the problem and for variants with one feature removed, the rows whose LSE or output is
not finite and the golden's values there."""
import random
import sys

import torch

from attncore.testing import fuzz, inputs, resolve_backend, runner

name, seed = sys.argv[1], int(sys.argv[2])
backend, _ = resolve_backend(name)
pools = fuzz.Pools(backend, "cuda")
cfg, shp = fuzz.split_seed(seed)
p0 = pools.draw(random.Random(cfg))
rng = random.Random(shp)
shapes = fuzz.draw_shapes(p0, rng)
views = (rng.random() < 0.25, rng.random() < 0.5)
nonfinite = rng.random() < 0.25
data_seed = rng.getrandbits(31)
variants = {"as drawn": p0, "no sinks": p0.replace(sinks=False), "no alibi": p0.replace(pos_encoding="NONE"),
            "no window": p0.replace(window_left=-1), "kv bf16": p0.replace(kv_dtype=p0.q_dtype),
            "no lse": p0.replace(return_lse=False)}
for what, p in variants.items():
    for strided in sorted({views[0], False}):
        if backend.reasons(p):
            print(f"{what}: refused"); continue
        b = inputs.build(p, "", data_seed, "cuda", shapes=shapes, views=(strided, views[1]), nonfinite=nonfinite)
        plan = backend.plan(p, b.meta)
        backend.run(plan, b.args)
        torch.cuda.synchronize()
        errs = runner.check_result(b, inputs.expected(b))
        o = b.out_buf[1:-1].float()
        bad_o = (~torch.isfinite(o)).any(-1)
        line = f"{what:10s} strided={strided}: {len(errs)} errors; non-finite out (row, head): {bad_o.nonzero().tolist()[:6]}"
        if b.lse_buf is not None:
            l = b.lse_buf[1:-1]
            bad = (~torch.isfinite(l)).nonzero().tolist()
            gl = torch.cat([e[1] for e in inputs.expected(b)])
            line += f"; non-finite lse at {bad[:6]} ({len(bad)}), values {[float(l[i, j]) for i, j in bad[:4]]}, " \
                    f"golden {[float(gl[i, j]) for i, j in bad[:4]]}"
        print(line + (f"\n    {errs[0][:200]}" if errs else ""))
print("plan:", type(plan).__name__, {k: v for k, v in vars(plan).items() if isinstance(v, (int, str, bool))})
