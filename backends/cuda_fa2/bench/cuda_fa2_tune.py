"""Tile-shape tuning sweep for cuda_fa2 (one device call): prefill and decode variants, do_bench medians.
Usage: python backends/cuda_fa2/bench/cuda_fa2_tune.py OUT.json"""
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cuda_fa2_bench import bench, causal_pairs, make  # noqa: E402

from attncore.build import jit  # noqa: E402
from attncore.backends.cuda_fa2.specs import Fa2Key  # noqa: E402

PREFILL = {  # round 3.  Round 1 (H100 2026-11-22): nnk2, nnk2_s3, w8m1 variants slower than default;
    # round 2: 64-row tiles (w4m1) win P1 causal (257 vs 234) and lose P3/P4 (153/166 vs 199/219).
    "p_default": (),
    "p_nopgtab": (("FA2_P_PGTAB", "0"),),  # direct page-id loads in the copy (rounds 1-2 code)
}
DECODE = {  # round 2: no page-id prefetch won everywhere (D1 2.86 vs 2.74 TB/s): now the default
    "d_default": (),
}


def main():
    out = {}
    # build all variants in parallel first
    specs = []
    for cfg, table in (("prefill", PREFILL), ("decode", DECODE)):
        for tune in table.values():
            for mask in ("causal", "none") if cfg == "prefill" else ("causal",):
                specs.append(Fa2Key(cfg, "bf16", "same", 128, mask, tune=tune).spec())
                if cfg == "decode":
                    specs.append(Fa2Key(cfg, "bf16", "e4m3", 128, mask, tune=tune).spec())
    t0 = time.time()
    jit.build("cuda_fa2", specs, jobs=os.cpu_count())
    print(f"built {len(specs)} variants in {time.time() - t0:.1f} s", flush=True)
    for name, tune in PREFILL.items():
        row = {}
        for wl, lens, causal, paged in (("P1c", [(4096, 4096)], True, False), ("P1n", [(4096, 4096)], False, False),
                                        ("P3", [(2048, 2048)] * 8, True, True), ("P4", [(512, 4096)] * 16, True, True)):
            be, plan, args, _ = make("batch_prefill_paged" if paged else "batch_prefill_ragged", lens, 32, 8, 128,
                                     causal, paged, tune=tune, force_config="prefill")
            t = bench(lambda: be.run(plan, args))
            pairs = sum(causal_pairs(a, b) if causal else a * b for a, b in lens)
            row[wl] = round(4 * pairs * 32 * 128 / t / 1e9, 1)
        out[name] = row
        print(name, row, flush=True)
    for name, tune in DECODE.items():
        row = {}
        for wl, B, kv, kvd in (("D1", 64, 4096, None), ("D2B16", 16, 16384, None), ("D2B1", 1, 32768, None),
                               ("D5", 64, 4096, torch.float8_e4m3fn)):
            be, plan, args, _ = make("batch_decode", [(1, kv)] * B, 32, 8, 128, False, True, 16, tune=tune, kv_dtype=kvd)
            t = bench(lambda: be.run(plan, args))
            row[wl] = round((B * kv * 8 * 128 * args.k.element_size() * 2) / t / 1e9, 3)
        out[name] = row
        print(name, row, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    # spill report of the default prefill kernel (SASS local-memory ops)
    p = jit.library_path(Fa2Key("prefill", "bf16", "same", 128, "causal").spec(), jit.current_arch())
    try:
        sass = subprocess.run(["cuobjdump", "-sass", str(p)], capture_output=True, text=True).stdout
        print("default prefill SASS: LDL", sass.count("LDL"), "STL", sass.count("STL"), "HMMA", sass.count("HMMA"))
    except Exception as e:
        print("cuobjdump failed", e)


if __name__ == "__main__":
    main()
