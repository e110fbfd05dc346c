"""Issue 16: POD at points of one's choosing, beside the split model's verdict.  Each point (prefill rows, decode
batch, decode kv: a causal prefill, 32/8 heads, d128, page 16, bf16, as attncore bench's sweep) is timed as the
sweep times its rows (attncore.cli.bench_pod.measure: fused / serial / streams / SM split / auto, the median of 3
interleaved rounds) and printed with the model's split time over serial and its SM count (streams.choose_split
with this GPU's SMs and margin, as Streams.decide asks it).

    python scripts/gpu_pod_points.py 512,8,8192 1024,32,2048 ...
"""

from __future__ import annotations

import sys

import torch

from attncore.cli.bench_pod import PODWorkload, _fmt_row, default_pod_backend, measure
from attncore.core import green, streams

if __name__ == "__main__":
    backend = default_pod_backend("cuda")
    for qo, batch, kv in (tuple(map(int, a.split(","))) for a in sys.argv[1:]):
        w = PODWorkload(f"p{qo}-b{batch}-kv{kv}", qo, batch, kv)
        c = streams.choose_split(streams.prefill_flops([(qo, qo)], True, w.hq, w.d, w.d),
                                 streams.decode_bytes([kv] * batch, w.hkv, w.d, w.d, torch.bfloat16),
                                 green.sm_count(torch.device("cuda")),
                                 margin=streams.split_margin())
        row = measure(w, device="cuda", pod_backend=backend, rounds=3)
        print(f"{_fmt_row(row)}  model {c.split_s / c.serial_s:.3f} S={c.prefill_sms}", flush=True)
