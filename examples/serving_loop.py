"""A serving loop on attncore: continuous batching over a paged KV cache.

A small Llama-shaped model with random weights (no downloads; GQA 32/8, head dim 128 on a GPU)
serves a queue of requests the way serving stacks do:

* each step runs every decoding request one token and, while prompts wait, one chunk of one
  prompt (chunked prefill); such mixed steps go through ``BatchPODWithPagedKVCacheWrapper``;
* steps with decodes only replay a CUDA graph of the whole model step (one graph per batch size,
  captured on first use; the decode wrapper is planned into fixed buffers before each replay);
* the dense parts of each layer run under ``torch.compile``;
* every attention call uses ``backend="auto"``.

It prints tokens/s.  With ``--flashinfer`` (an importable ``flashinfer``) the same loop runs on
FlashInfer in the same process (its 0.2.14 has no BatchPOD: mixed steps run its prefill and decode
wrappers one after the other).  ``--verify`` re-runs each finished request densely (one causal
single prefill per layer over the whole sequence) and counts the generated tokens it agrees with::

    python examples/serving_loop.py                       # GPU sizes
    python examples/serving_loop.py --device cpu --tiny   # seconds on a CPU (reference backend)
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List

import torch

if not torch.cuda.is_available():  # attncore.rope's Triton kernel runs through the interpreter on a CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass
class Config:
    layers: int = 4
    hq: int = 32
    hkv: int = 8
    d: int = 128
    ffn: int = 11008
    vocab: int = 32000
    page: int = 16
    max_batch: int = 32
    chunk: int = 512
    requests: int = 48
    prompt: tuple = (64, 1024)
    new_tokens: tuple = (16, 96)
    dtype: torch.dtype = torch.bfloat16

    @property
    def hidden(self) -> int:
        return self.hq * self.d


TINY = dict(layers=2, hq=4, hkv=2, d=64, ffn=256, vocab=512, page=4, max_batch=4, chunk=8, requests=6,
            prompt=(3, 20), new_tokens=(2, 6), dtype=torch.float32)


class Model:
    """Weights and the dense halves of a layer; attention runs between them (``step``)."""

    def __init__(self, cfg: Config, device, compile_backend: str):
        g = torch.Generator().manual_seed(0)
        w = lambda *s: (torch.randn(*s, generator=g) / s[0] ** 0.5).to(device, cfg.dtype)  # noqa: E731
        c, h = cfg, cfg.hidden
        self.cfg = c
        self.embed = w(c.vocab, h) * c.vocab ** 0.5
        self.lm_head = w(h, c.vocab)
        self.wqkv = [w(h, (c.hq + 2 * c.hkv) * c.d) for _ in range(c.layers)]
        self.wo = [w(h, h) for _ in range(c.layers)]
        self.w_up = [w(h, 2 * c.ffn) for _ in range(c.layers)]
        self.w_down = [w(c.ffn, h) for _ in range(c.layers)]
        wrap = (lambda f: f) if compile_backend == "none" else (lambda f: torch.compile(f, backend=compile_backend,
                                                                                        dynamic=True))
        self.pre, self.post = wrap(self._pre), wrap(self._post)

    def _pre(self, x, wqkv):
        c = self.cfg
        qkv = torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ wqkv
        q, k, v = qkv.split([c.hq * c.d, c.hkv * c.d, c.hkv * c.d], dim=-1)
        return q.reshape(-1, c.hq, c.d), k.reshape(-1, c.hkv, c.d), v.reshape(-1, c.hkv, c.d)

    def _post(self, x, attn, wo, w_up, w_down):
        x = x + attn.reshape(x.shape) @ wo
        gate, up = (torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ w_up).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ w_down

    def step(self, api, tokens, pos, cache, kv, attend) -> torch.Tensor:
        """One forward over the step's tokens; ``kv``: the append tensors; ``attend(layer, q)``."""
        x = self.embed[tokens]
        for i in range(self.cfg.layers):
            q, k, v = self.pre(x, self.wqkv[i])
            api.apply_rope_pos_ids_inplace(q, k, pos)
            api.append_paged_kv_cache(k, v, kv["batch"], kv["pos"], cache[i], kv["indices"], kv["indptr"],
                                      kv["last"])
            x = self.post(x, attend(i, q), self.wo[i], self.w_up[i], self.w_down[i])
        return torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ self.lm_head


@dataclass
class Request:
    rid: int
    prompt: List[int]
    new_tokens: int
    pages: List[int] = field(default_factory=list)
    done_prompt: int = 0  # prompt tokens already in the cache
    out: List[int] = field(default_factory=list)

    @property
    def cached(self) -> int:  # tokens in the cache
        return self.done_prompt + max(0, len(self.out) - 1)


class Server:
    def __init__(self, api, cfg: Config, model: Model, device, graphs: bool):
        self.api, self.cfg, self.model, self.device = api, cfg, model, device
        c = cfg
        budget = c.requests * -(-(c.prompt[1] + c.new_tokens[1]) // c.page)
        self.cache = [torch.zeros(budget, 2, c.page, c.hkv, c.d, device=device, dtype=c.dtype)
                      for _ in range(c.layers)]
        self.free = list(range(budget))[::-1]
        self.ws = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
        self.pod = getattr(api, "BatchPODWithPagedKVCacheWrapper", None)
        self.mixed = self.pod(self.ws, "NHD") if self.pod else None
        self.prefill = api.BatchPrefillWithPagedKVCacheWrapper(self.ws, "NHD")
        self.decode = api.BatchDecodeWithPagedKVCacheWrapper(self.ws, "NHD", use_tensor_cores=True)
        self.graphs: Dict[int, tuple] = {} if graphs else None
        self.graph_steps = self.eager_steps = self.captures = 0

    # ------------------------------------------------------------------ paging
    def _grow(self, r: Request, tokens: int) -> None:
        need = -(-tokens // self.cfg.page) - len(r.pages)
        r.pages += [self.free.pop() for _ in range(need)]

    def _table(self, reqs: List[Request], lens: List[int]):
        c, dev = self.cfg, self.device
        indptr = [0]
        for r in reqs:
            indptr.append(indptr[-1] + len(r.pages))
        indices = [p for r in reqs for p in r.pages]
        last = [n - (-(-n // c.page) - 1) * c.page for n in lens]
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
        return i32(indptr), i32(indices), i32(last)

    # ------------------------------------------------------------------ one step
    def step(self, waiting: collections.deque, running: List[Request]) -> List[Request]:
        c = self.cfg
        chunk_req, chunk = None, []
        if waiting and len(running) < c.max_batch:
            chunk_req = waiting[0]
            chunk = chunk_req.prompt[chunk_req.done_prompt:chunk_req.done_prompt + c.chunk]
        dec = list(running)
        for r in dec:
            self._grow(r, r.cached + 1)
        if chunk_req is None:
            logits = self._decode_step(dec)
        else:
            self._grow(chunk_req, chunk_req.done_prompt + len(chunk))
            logits = self._mixed_step(chunk_req, chunk, dec)
        nxt = logits.argmax(-1).tolist()
        finished = []
        if chunk_req is not None:
            chunk_req.done_prompt += len(chunk)
            nxt_p, nxt = nxt[0], nxt[1:]
            if chunk_req.done_prompt == len(chunk_req.prompt):
                waiting.popleft()
                chunk_req.out.append(nxt_p)
                running.append(chunk_req)
        for r, t in zip(dec, nxt):
            r.out.append(t)
        for r in list(running):
            if len(r.out) >= r.new_tokens:
                running.remove(r)
                self.free += r.pages
                finished.append(r)
        return finished

    def _append_meta(self, reqs, lens, new):
        """Append tensors: ``new[b]`` tokens of request b land at its last positions."""
        indptr, indices, last = self._table(reqs, lens)
        batch = [b for b, n in enumerate(new) for _ in range(n)]
        pos = [lens[b] - new[b] + j for b, n in enumerate(new) for j in range(n)]
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=self.device)  # noqa: E731
        return dict(batch=i32(batch), pos=i32(pos), indices=indices, indptr=indptr, last=last)

    def _mixed_step(self, req: Request, chunk: List[int], dec: List[Request]) -> torch.Tensor:
        c, api = self.cfg, self.api
        self.eager_steps += 1
        reqs = [req] + dec
        lens = [req.done_prompt + len(chunk)] + [r.cached + 1 for r in dec]
        new = [len(chunk)] + [1] * len(dec)
        kv = self._append_meta(reqs, lens, new)
        tokens = chunk + [r.out[-1] for r in dec]
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=self.device)  # noqa: E731
        pos = kv["pos"]
        p_ind, p_idx, p_last = self._table([req], lens[:1])
        n = len(chunk)
        if dec:
            d_ind, d_idx, d_last = self._table(dec, lens[1:])
        if self.mixed is not None and dec:
            self.mixed.plan(i32([0, n]), p_ind, p_idx, p_last, i32(list(range(len(dec) + 1))), d_ind, d_idx, d_last,
                            c.hq, c.hkv, c.d, c.page, q_data_type=c.dtype)

            def attend(i, q):
                o_p, o_d = self.mixed.run(q[:n], self.cache[i], q[n:], self.cache[i], causal_p=True)
                return torch.cat([o_p, o_d])
        else:  # composed: prefill then decode (FlashInfer 0.2.14, or no decodes)
            self.prefill.plan(i32([0, n]), p_ind, p_idx, p_last, c.hq, c.hkv, c.d, c.page, causal=True,
                              q_data_type=c.dtype)
            if dec:
                self.decode.plan(d_ind, d_idx, d_last, c.hq, c.hkv, c.d, c.page, q_data_type=c.dtype)

            def attend(i, q):
                o = [self.prefill.run(q[:n], self.cache[i])]
                if dec:
                    o.append(self.decode.run(q[n:], self.cache[i]))
                return torch.cat(o)
        logits = self.model.step(api, i32(tokens), pos, self.cache, kv, attend)
        return torch.cat([logits[n - 1:n], logits[n:]])

    def _decode_step(self, dec: List[Request]) -> torch.Tensor:
        c, api = self.cfg, self.api
        lens = [r.cached + 1 for r in dec]
        kv = self._append_meta(dec, lens, [1] * len(dec))
        tokens = torch.tensor([r.out[-1] for r in dec], dtype=torch.int32, device=self.device)
        if self.graphs is None:
            self.eager_steps += 1
            self.decode.plan(kv["indptr"], kv["indices"], kv["last"], c.hq, c.hkv, c.d, c.page, q_data_type=c.dtype)
            return self.model.step(api, tokens, kv["pos"], self.cache, kv, lambda i, q: self.decode.run(q, self.cache[i]))
        self.graph_steps += 1
        b = len(dec)
        if b not in self.graphs:
            self.graphs[b] = self._capture(b, kv, tokens)
        g, wrapper, static, out = self.graphs[b]
        for k in ("batch", "pos", "last", "indptr"):
            static[k].copy_(kv[k])
        static["indices"][:kv["indices"].numel()].copy_(kv["indices"])
        static["tokens"].copy_(tokens)
        wrapper.plan(static["indptr"], static["indices"], static["last"], c.hq, c.hkv, c.d, c.page,
                     q_data_type=c.dtype)
        g.replay()
        return out

    def _capture(self, b: int, kv, tokens):
        """A CUDA graph of one decode step of ``b`` requests over fixed index buffers."""
        c, api = self.cfg, self.api
        pages = self.cache[0].shape[0]  # room for any page table
        static = {k: kv[k].clone() for k in ("batch", "pos", "last", "indptr")}
        static["indices"] = torch.zeros(pages, dtype=torch.int32, device=self.device)
        static["indices"][:kv["indices"].numel()].copy_(kv["indices"])
        static["tokens"] = tokens.clone()
        wrapper = api.BatchDecodeWithPagedKVCacheWrapper(
            self.ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=static["indptr"],
            paged_kv_indices_buffer=static["indices"], paged_kv_last_page_len_buffer=static["last"])
        wrapper.plan(static["indptr"], static["indices"], static["last"], c.hq, c.hkv, c.d, c.page, q_data_type=c.dtype)

        def run():  # the warm-up runs write this step's K/V, which the first replay writes again
            return self.model.step(api, static["tokens"], static["pos"], self.cache, static,
                                   lambda i, q: wrapper.run(q, self.cache[i]))

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                run()  # compile and autotune outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = run()
        self.captures += 1
        return g, wrapper, static, out


def serve(server: Server, verify: bool, seed: int) -> dict:
    """Serve ``cfg.requests`` random requests to completion; figures of the run."""
    cfg, device, api, model = server.cfg, server.device, server.api, server.model
    server.graph_steps = server.eager_steps = server.captures = 0
    rng = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=rng))  # noqa: E731
    reqs = [Request(i, torch.randint(cfg.vocab, (rand(*cfg.prompt),), generator=rng).tolist(), rand(*cfg.new_tokens))
            for i in range(cfg.requests)]
    waiting, running, done = collections.deque(reqs), [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while waiting or running:
        done += server.step(waiting, running)
        steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(r.prompt) + len(r.out) for r in done)
    agree = _verify(api, model, cfg, done, device) if verify else None
    return dict(seconds=dt, tokens=tokens, generated=sum(len(r.out) for r in done), steps=steps,
                graph_steps=server.graph_steps, eager_steps=server.eager_steps, captures=server.captures, agree=agree)


def _verify(api, model: Model, cfg: Config, done: List[Request], device) -> float:
    """Teacher-forced dense forward (single prefill per layer) of each request; the fraction of
    generated tokens it predicts the same."""
    same = total = 0
    for r in done:
        seq = torch.tensor(r.prompt + r.out[:-1], device=device)
        x = model.embed[seq]
        pos = torch.arange(len(seq), dtype=torch.int32, device=device)
        for i in range(cfg.layers):
            q, k, v = model._pre(x, model.wqkv[i])
            api.apply_rope_pos_ids_inplace(q, k, pos)
            x = model._post(x, api.single_prefill_with_kv_cache(q, k, v, causal=True), model.wo[i], model.w_up[i],
                            model.w_down[i])
        pred = (torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ model.lm_head).argmax(-1)[len(r.prompt) - 1:]
        same += int((pred.cpu() == torch.tensor(r.out)).sum())
        total += len(r.out)
    return same / max(total, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU smoke runs)")
    p.add_argument("--compile", default=None, help="torch.compile backend: inductor (GPU default), eager (CPU "
                                                     "default), aot_eager, or none")
    p.add_argument("--no-graphs", action="store_true", help="decode steps eagerly (graphs need a GPU)")
    p.add_argument("--flashinfer", action="store_true", help="also run the loop on the importable flashinfer")
    p.add_argument("--verify", action="store_true", help="check generated tokens against a dense re-run")
    p.add_argument("--runs", type=int, default=1, help="timed runs of the same requests after the warm-up (each printed; a first "
                                                         "process may still compile in the first)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cfg = Config(**TINY) if a.tiny or a.device == "cpu" else Config()
    compile_backend = a.compile or ("inductor" if a.device == "cuda" else "eager")
    graphs = a.device == "cuda" and not a.no_graphs
    import attncore

    apis = [("attncore", attncore)]
    if a.flashinfer:
        import flashinfer

        apis.append(("flashinfer", flashinfer))
    print(f"{cfg.layers} layers, {cfg.hq}/{cfg.hkv} heads, d{cfg.d}, {cfg.requests} requests, batch <= {cfg.max_batch}, "
          f"chunk {cfg.chunk}, page {cfg.page}, {str(cfg.dtype).replace('torch.', '')}, compile={compile_backend}, "
          f"graphs={graphs}, {a.device}")
    ok = True
    model = Model(cfg, device, compile_backend)
    for name, api in apis:
        server = Server(api, cfg, model, device, graphs)
        serve(server, False, seed=99)  # warm-up: compiles, JIT, most graphs
        for run in range(a.runs):
            r = serve(server, a.verify, seed=1)
            line = (f"{name:10s} {r['tokens'] / r['seconds']:10.0f} tokens/s ({r['generated']} generated, {r['tokens']} in "
                    f"all, {r['steps']} steps: {r['graph_steps']} graph replays, {r['captures']} captures, "
                    f"{r['eager_steps']} eager) in {r['seconds']:.2f} s")
            if r["agree"] is not None:
                line += f"; dense re-run agrees on {r['agree']:.1%} of generated tokens"
                ok &= r["agree"] >= (1.0 if cfg.dtype == torch.float32 else 0.9)
            print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
