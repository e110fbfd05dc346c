"""Randomized differential testing: ``attncore check --fuzz N [--seed S] [--backend B] [--replay SEED]``.

Each problem is drawn over every axis the backend claims (op, dtypes, head dims, GQA group, page
size, layout, mask, window, features, q_len_per_req), with lengths that favour tile boundaries and
edge shapes, NaN in everything out of range, and sometimes NaN in a query row and left of the window
(docs/semantics.md).  It runs through the ``Backend`` contract like the conformance suite
(``inputs.build`` / ``runner.check_result``: fp64 golden, the one tolerance rule, poisoned outputs).

A problem is a pure function of its replay seed: ``config << 32 | shapes``.  ``config`` picks the
``AttentionProblem`` (what a kernel is specialized on) and ``shapes`` the lengths and views, so N
problems share a few hundred configurations (kernels compile once each) yet every mismatch prints
one number that replays it alone.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from attncore.core.backend import Backend
from attncore.core.problem import DECODE_OPS, AttentionProblem, device_info
from attncore.testing import inputs, runner
from attncore.testing.cases import (TESTED_OPS, claims, copy_axis, find_base, float_dtypes, normalize, pick_device, problem_id,
                    sweep_claims, with_feature)
from attncore.testing.placement import device_type, placed

# Longest sequence and largest batch drawn: on a GPU, tiles of up to 128 rows are crossed twice; the
# CPU (the reference in float64, Triton's interpreter) gets smaller problems so that CI stays fast.
MAX_LEN = {"cuda": 300, "cpu": 140}
MAX_BATCH = {"cuda": 8, "cpu": 4}
AXES = ("q_dtype", "kv_dtype", "out_dtype", "head_dim", "head_dim_vo", "group", "page_size", "kv_layout", "mask",
        "q_len_per_req")


@dataclass
class Mismatch:
    seed: int
    problem: str
    shapes: str
    errors: List[str]


@dataclass
class FuzzReport:
    backend: str
    device: str
    seed: int
    run: int = 0
    configs: int = 0
    seconds: float = 0.0
    mismatches: List[Mismatch] = field(default_factory=list)


class Pools:
    """Per claimed op: the base problem and, per axis, the claimed one-axis variations of it."""

    def __init__(self, backend: Backend, device: str):
        self.backend = backend
        self.device = device
        dev_type, cc = device_info(device)  # device may name an index (cuda:1)
        dtypes = float_dtypes(dev_type)
        claimed_ops = {op for e in backend.capabilities for op in e.ops}
        self.ops: Dict[str, Tuple[AttentionProblem, Dict[str, List[AttentionProblem]], List[str]]] = {}
        for op in TESTED_OPS:
            if op not in claimed_ops:
                continue
            base = find_base(backend, op, dev_type, cc, dtypes)
            if base is None:
                continue
            pools, _ = sweep_claims(backend, base, dtypes)
            features = [a for a in pools if a not in AXES and a != "spec_mask"]
            self.ops[op] = (base, pools, features)

    def draw(self, rng: random.Random) -> AttentionProblem:
        """A claimed problem: random axes around a random op's base, redrawn until claimed."""
        op = rng.choice(sorted(self.ops))
        base, pools, features = self.ops[op]
        for _ in range(64):
            p = base
            for axis in AXES:
                if pools.get(axis) and rng.random() < 0.5:
                    p = copy_axis(p, rng.choice(pools[axis]), axis)
            for f in features:
                if rng.random() < 0.3:
                    p = with_feature(p, f)
                    if f == "window":
                        p = p.replace(window_left=rng.choice((0, 1, rng.randint(2, 40), rng.randint(41, 200))))
            if op == "xqa_decode" and pools.get("spec_mask") and rng.random() < 0.3:
                p = p.replace(spec_mask=True, q_len_per_req=max(2, p.q_len_per_req))
            if rng.random() < 0.5:
                p = p.replace(return_lse=True)
            p = normalize(p)
            if claims(self.backend, p):
                return p
        return base


def draw_shapes(p: AttentionProblem, rng: random.Random) -> Tuple[List[int], List[int]]:
    """Lengths: a case-suite shape (edge, tiles, one token, the small random ones) or a larger batch."""
    kind = rng.random()
    if kind < 0.5:
        tag = rng.choice(("", "", "edge", "tiles", "tiles", "tok1", "nf"))
        return inputs.case_shapes(p, tag, rng)
    dev = p.device_type if p.device_type in MAX_LEN else "cuda"
    b = 1 if p.op == "single_prefill" else rng.randint(1, MAX_BATCH[dev])
    ln = lambda: rng.choice((rng.randint(0, 20), rng.randint(0, MAX_LEN[dev]), rng.choice(inputs.TILE_LENS)))  # noqa: E731
    if p.op in DECODE_OPS:
        ql = p.q_len_per_req
        kv = [max(ql, ln()) for _ in range(b)]
        if p.op == "batch_decode" and ql == 1 and rng.random() < 0.2:
            kv[rng.randrange(b)] = 0  # an empty request
        return [ql] * b, kv
    qo = [ln() for _ in range(b)]
    kv = [ln() for _ in range(b)]
    if p.op == "single_prefill":
        qo = [max(1, qo[0])]
        if p.mask == "causal" and kv[0] < qo[0]:
            qo, kv = kv, qo
            qo = [max(1, qo[0])]
            kv = [max(kv[0], qo[0])]
    return qo, kv


def split_seed(replay: int) -> Tuple[int, int]:
    return replay >> 32, replay & 0xFFFFFFFF


def replay_seed(master: int, i: int, configs: int) -> int:
    """Problem i of a run: its configuration is one of ``configs`` drawn from the master seed."""
    cfg = random.Random(f"cfg-{master}-{i % configs}").getrandbits(31)
    shp = random.Random(f"shape-{master}-{i}").getrandbits(32)
    return cfg << 32 | shp


def run_one(pools: Pools, seed: int) -> Tuple[AttentionProblem, Optional[inputs.Built], List[str]]:
    """Draw, build, plan, run and check one problem; (problem, inputs, error messages)."""
    cfg, shp = split_seed(seed)
    p = pools.draw(random.Random(cfg))
    rng = random.Random(shp)
    shapes = draw_shapes(p, rng)
    views = (rng.random() < 0.25, rng.random() < 0.5)
    nonfinite = rng.random() < 0.25
    be = pools.backend
    try:
        b = inputs.build(p, "", rng.getrandbits(31), pools.device, shapes=shapes, views=views, nonfinite=nonfinite)
    except Exception as e:  # the harness's own bug: report it, never hide it as a pass
        return p, None, [f"building inputs failed: {type(e).__name__}: {e}"]
    try:
        snap = inputs.snapshot(b)
        plan = be.plan(p, b.meta)
        be.run(plan, b.args)
        runner.sync(pools.device)
    except Exception as e:
        return p, b, [f"{type(e).__name__}: {e}"]
    what = "with NaN in a query row and left of the window: " if nonfinite else ""
    return p, b, inputs.check_inputs_unchanged(snap) + runner.check_result(b, inputs.expected(b), what=what)


def _describe(p: AttentionProblem, b: Optional[inputs.Built], backend: str) -> Tuple[str, str]:
    shapes = "" if b is None else f"qo_lens={b.qo_lens} kv_lens={b.kv_lens}" + (" strided" if b.strided else "")
    return problem_id(backend, p) + (f" window_left={p.window_left}" if p.window_left >= 0 else ""), shapes


def fuzz(backend: Backend, n: int, *, seed: int = 0, device: Optional[str] = None, configs: Optional[int] = None,
         worker: Tuple[int, int] = (0, 1), progress: Optional[Callable[[str], None]] = None,
         stream: str = "default") -> FuzzReport:
    """Run the problems of an N-problem run whose configuration ``i % configs`` falls to ``worker``
    ``(w, jobs)`` (``w == (i % configs) % jobs``), on ``device`` and ``stream`` (``placement.placed``)."""
    dev = device or pick_device(backend)[0]
    if dev is None:
        raise ValueError(f"{backend.name}: {pick_device(backend)[1]}")
    pools = Pools(backend, dev)
    if not pools.ops:
        raise ValueError(f"{backend.name} claims no op the fuzzer can run on {dev}")
    configs = configs or default_configs(n, dev)
    rep = FuzzReport(backend.name, dev, seed, configs=min(configs, n))
    t0 = time.perf_counter()
    for i in range(n):
        if (i % configs) % worker[1] != worker[0]:  # a worker owns whole configurations: each compiles once
            continue
        s = replay_seed(seed, i, configs)
        with placed(dev, stream):
            p, b, errs = run_one(pools, s)
        rep.run += 1
        if errs:
            desc, shapes = _describe(p, b, backend.name)
            rep.mismatches.append(Mismatch(s, desc, shapes, errs[:6]))
            if progress:
                progress(f"MISMATCH {backend.name} --replay {s}: {desc} {shapes}\n  " + "\n  ".join(errs[:3]))
        if progress and rep.run % 250 == 0:
            progress(f"{backend.name}: {rep.run} problems, {len(rep.mismatches)} mismatches, "
                     f"{time.perf_counter() - t0:.0f} s")
    rep.seconds = time.perf_counter() - t0
    return rep


def default_configs(n: int, device: str) -> int:
    """On a GPU, problems share configurations so that each kernel compiles once per ~150 problems
    (a Triton or nvcc build takes seconds, a problem milliseconds); the CPU (Triton's interpreter,
    the reference) compiles nothing, so each problem gets its own."""
    return n if device_type(device) == "cpu" else max(4, min(128, n // 150))


def _worker(args):
    name, n, seed, device, configs, w, jobs, stream = args
    from attncore.testing import resolve_backend

    # each worker's host math on its own cores: J processes x all-core thread pools thrash
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))

    backend, _ = resolve_backend(name)
    say = lambda m: print(f"[worker {w}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    return fuzz(backend, n, seed=seed, device=device, configs=configs, worker=(w, jobs), progress=say,
                stream=stream)


def fuzz_parallel(name: str, n: int, *, seed: int = 0, device: Optional[str] = None, configs: Optional[int] = None,
                  jobs: int = 1, progress: Optional[Callable[[str], None]] = None,
                  stream: str = "default") -> FuzzReport:
    """``jobs`` processes share one run (kernels compile and goldens compute in parallel)."""
    from attncore.testing import resolve_backend

    if jobs <= 1:
        backend, _ = resolve_backend(name)
        return fuzz(backend, n, seed=seed, device=device, configs=configs, progress=progress, stream=stream)
    import multiprocessing as mp

    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    with ctx.Pool(jobs) as pool:
        parts = pool.map(_worker, [(name, n, seed, device, configs, w, jobs, stream) for w in range(jobs)])
    rep = FuzzReport(name, parts[0].device, seed, configs=parts[0].configs)
    for part in parts:
        rep.run += part.run
        rep.mismatches += part.mismatches
    rep.mismatches.sort(key=lambda m: m.seed)
    rep.seconds = time.perf_counter() - t0
    if progress:
        for m in rep.mismatches:
            progress(f"MISMATCH {name} --replay {m.seed}: {m.problem} {m.shapes}\n  " + "\n  ".join(m.errors[:3]))
    return rep


def replay(name: str, seed: int, device: Optional[str] = None, stream: str = "default"
           ) -> Tuple[str, str, List[str]]:
    """(problem, shapes, errors) of one replayed problem."""
    from attncore.testing import resolve_backend

    backend, _ = resolve_backend(name)
    dev = device or pick_device(backend)[0]
    pools = Pools(backend, dev)
    with placed(dev, stream):
        p, b, errs = run_one(pools, seed)
    desc, shapes = _describe(p, b, backend.name)
    return desc, shapes, errs


def default_jobs() -> int:
    return max(1, min(8, (os.cpu_count() or 1) // 2))
