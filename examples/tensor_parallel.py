"""Tensor-parallel attention through attncore: heads split across GPUs, one process per GPU.

Each rank holds ``1/world`` of the query and KV heads (whole GQA groups), its own paged KV cache
and its own plan on its own GPU.  A step: a batch of prompts is prefilled (paged prefill), then
each request decodes one token (paged decode), both with ``backend="auto"``.  The attention
outputs are gathered over NCCL (gloo on the CPU) and rank 0 compares them with the same step run
on one device with all the heads, and the row-parallel output projection (an all-reduce of the
partial products) with the single-device projection::

    python examples/tensor_parallel.py                 # every GPU here (at least 2)
    python examples/tensor_parallel.py --device cpu    # 2 processes on the CPU (gloo), tiny sizes
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attncore as ac

PAGE = 16


def make_inputs(hq: int, hkv: int, d: int, qo, kv, dtype, seed: int = 0):
    """Every rank draws the same full-width tensors from one seed (no broadcast needed)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32).to(dtype)  # noqa: E731
    pages = [-(-n // PAGE) for n in kv]
    return dict(
        q_prefill=rnd(sum(qo), hq, d), q_decode=rnd(len(kv), hq, d),
        cache=rnd(sum(pages), 2, PAGE, hkv, d), w_o=rnd(hq * d, hq * d) / (hq * d) ** 0.5,
        indptr=torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32),
        indices=torch.randperm(sum(pages), generator=g).to(torch.int32),
        last=torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv, pages)], dtype=torch.int32),
        qo_indptr=torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32))


def attention_step(x: dict, heads: slice, kv_heads: slice, d: int, device) -> torch.Tensor:
    """Prefill then one decode token for this rank's heads; returns [tokens, local heads * d]."""
    q_p = x["q_prefill"][:, heads].to(device)
    q_d = x["q_decode"][:, heads].to(device)
    cache = x["cache"][:, :, :, kv_heads].contiguous().to(device)
    hq, hkv = q_p.shape[1], cache.shape[3]
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=device)
    prefill = ac.BatchPrefillWithPagedKVCacheWrapper(ws, backend="auto")
    prefill.plan(x["qo_indptr"], x["indptr"], x["indices"], x["last"], hq, hkv, d, PAGE, causal=True,
                 q_data_type=q_p.dtype)
    decode = ac.BatchDecodeWithPagedKVCacheWrapper(ws, backend="auto")
    decode.plan(x["indptr"], x["indices"], x["last"], hq, hkv, d, PAGE, q_data_type=q_d.dtype)
    out = torch.cat([prefill.run(q_p, cache), decode.run(q_d, cache)])
    return out.reshape(out.shape[0], hq * d)


def rank_main(rank: int, world: int, args, port: int, result_q) -> None:
    cpu = args.device == "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world,
                            **({} if cpu else {"device_id": device}))
    try:
        hq, hkv, d, dtype = args.hq, args.hkv, args.head_dim, (torch.float16 if cpu else torch.bfloat16)
        x = make_inputs(hq, hkv, d, args.qo, args.kv, dtype)
        per_q, per_kv = hq // world, hkv // world
        heads, kv_heads = slice(rank * per_q, (rank + 1) * per_q), slice(rank * per_kv, (rank + 1) * per_kv)
        local = attention_step(x, heads, kv_heads, d, device)
        # row-parallel output projection: this rank's columns of attention x its rows of W_o, summed
        proj = local.float() @ x["w_o"][rank * per_q * d:(rank + 1) * per_q * d].float().to(device)
        dist.all_reduce(proj)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        if rank == 0:
            gathered = torch.cat([p.reshape(p.shape[0], per_q, d) for p in parts], dim=1)
            full = attention_step(x, slice(None), slice(None), d, device).reshape(gathered.shape)
            full_proj = full.reshape(full.shape[0], -1).float() @ x["w_o"].float().to(device)
            result_q.put((float((gathered.float() - full.float()).abs().max()),
                          float((proj - full_proj).abs().max() / full_proj.abs().max())))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", type=int, help="ranks (default: every GPU; 2 on the CPU)")
    p.add_argument("--hq", type=int, help="query heads (default 32 on GPUs, 4 on the CPU)")
    p.add_argument("--hkv", type=int, help="KV heads (default 8 on GPUs, 2 on the CPU)")
    p.add_argument("--head-dim", type=int, help="default 128 on GPUs, 64 on the CPU")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    a.world = a.world or (2 if cpu else torch.cuda.device_count())
    if not cpu and a.world > torch.cuda.device_count():
        p.error(f"--world {a.world}: this machine has {torch.cuda.device_count()} GPU(s)")
    if a.world < 2:
        p.error("tensor parallelism needs at least 2 ranks")
    a.hq, a.hkv = a.hq or (4 if cpu else 32), a.hkv or (2 if cpu else 8)
    a.head_dim = a.head_dim or (64 if cpu else 128)
    if a.hkv % a.world or a.hq % a.hkv:
        p.error(f"{a.hq}/{a.hkv} heads do not split into {a.world} ranks of whole GQA groups")
    a.qo, a.kv = ([3, 9, 1], [20, 47, 5]) if cpu else ([512, 77, 1000], [2048, 900, 4000])
    ctx = mp.get_context("spawn")
    result_q = ctx.SimpleQueue()
    mp.start_processes(rank_main, args=(a.world, a, _free_port(), result_q), nprocs=a.world, join=True,
                       start_method="spawn")
    attn_err, proj_err = result_q.get()
    ok = attn_err <= (1e-2 if cpu else 3e-2) and proj_err <= 1e-2
    print(f"{a.world} ranks on {a.device}: {a.hq}/{a.hkv} heads, d{a.head_dim}; gathered attention vs one device: "
          f"max |diff| {attn_err:.2e}; all-reduced projection: max rel diff {proj_err:.2e}: "
          f"{'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
