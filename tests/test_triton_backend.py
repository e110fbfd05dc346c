"""Triton backend against the fp64 golden, through the backend contract (BatchMeta / RunArgs).

CPU cases run through Triton's interpreter on small shapes (fp16 / fp32; the interpreter's bf16 is
broken); ``@pytest.mark.gpu`` cases run on CUDA (bf16, fp16, fp8 KV) and skip without it.
Cases are built, run and checked by ``attncore.testing.contract.run_case`` (the conformance suite's
checker and tolerance rule, ``attncore.testing.golden.tolerance``).  Outputs are poisoned with NaN
before every run, and so is every K/V slot and padding element a kernel must not read
(docs/semantics.md, "Non-finite inputs", rule 1); ``run_case(nan_q=..., nan_window=...)`` also
poisons query rows and keys left of the window (rules 2-4).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from attncore.core.backend import AttnParams, BatchMeta, RunArgs  # noqa: E402
from attncore.core.problem import AttentionProblem  # noqa: E402
from attncore.testing import contract  # noqa: E402
from attncore.testing.tile_model import slip_request, slips  # noqa: E402
from attncore.backends.triton.backend import TritonBackend  # noqa: E402


def _rank(backend, problem) -> int:
    """auto's rank of a shipped backend: the rule table (attncore.core.ranking)."""
    from attncore.core.ranking import rule_rank

    return rule_rank(backend, problem).rank

HAS_CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (CPU interpreter)")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERP, reason="needs a CUDA GPU (and no TRITON_INTERPRET)")


# ----------------------------------------------------------------------------- case builder
def run_case(op, *, backend=None, **kw):
    """``attncore.testing.contract.run_case`` on the Triton backend (a default ``TritonBackend()``):
    a batch built through BatchMeta / RunArgs with NaN wherever no request may read, run twice
    (clean, then with the NaN of ``nan_q`` / ``nan_window`` / ``nan_reqs``), checked against the fp64
    golden under the tolerance rule; returns the plan."""
    return contract.run_case(op, backend=backend or TritonBackend(), **kw)


# ----------------------------------------------------------------------------- contract tests
def test_capabilities_and_priority():
    be = TritonBackend()
    assert be.name == "triton"
    base = AttentionProblem(op="batch_decode", device_type="cpu", page_size=16)
    assert _rank(be, base) < 0  # auto on CPU keeps the reference backend (priority 0)
    cuda = base.replace(device_type="cuda", compute_capability=(9, 0), q_dtype=torch.bfloat16,
                        kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    assert _rank(be, cuda) == 50
    dense = cuda.replace(op="single_prefill", page_size=None, mask="causal")
    assert _rank(be, dense) == 53  # the Hopper dense kernel, measured above cuda_fa2 (52)
    assert _rank(be, dense.replace(compute_capability=(8, 0))) == 50
    assert _rank(be, dense.replace(soft_cap=True)) == 50  # the dense kernel does not serve it
    if INTERP:
        assert be.available() == []
        assert be.supports(base)
    bad = [
        base.replace(head_dim_qk=72, head_dim_vo=72),
        base.replace(head_dim_qk=512, head_dim_vo=512),
        base.replace(op="pod"),
        base.replace(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16),
        base.replace(cuda_graph=True),
        base.replace(op="xqa_decode", head_dim_vo=64),  # xqa: one head dim (prefill / decode serve two)
        base.replace(op="xqa_decode", out_dtype=torch.float8_e4m3fn),
        base.replace(device_type="cuda", compute_capability=(7, 5)),
        base.replace(spec_mask=True),
    ]
    for p in bad:
        rs = be.reasons(p)
        assert rs and all(str(r) for r in rs), p.describe()
    cuda_xqa = AttentionProblem(op="xqa_decode", device_type="cuda", compute_capability=(9, 0),
                                q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                                out_dtype=torch.bfloat16, page_size=16, spec_mask=True, sinks=True,
                                q_len_per_req=4)
    assert [r for r in be.reasons(cuda_xqa) if r.axis != "device"] == []
    # fp8 output and fp32 q: implemented, not yet validated on a GPU -> refused there
    assert not be.supports(cuda_xqa.replace(out_dtype=torch.float8_e4m3fn))
    assert not be.supports(cuda_xqa.replace(q_dtype=torch.float32, kv_dtype=torch.float32,
                                            out_dtype=torch.float32))
    assert any(r.axis == "kv_dtype" for r in be.reasons(cuda_xqa.replace(compute_capability=(8, 0))))


def test_plugin_registers():
    from attncore.backends.triton import plugin

    bes = plugin.attncore_backends()
    assert len(bes) == 1 and bes[0].name == "triton"


# ----------------------------------------------------------------------------- CPU (interpreter)
@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_single_prefill(dtype, causal):
    run_case("single_prefill", qo_lens=[37], kv_lens=[53], dtype=dtype, causal=causal, seed=1)


@cpu_only
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_prefill_layout_noncontig(layout):
    run_case("single_prefill", qo_lens=[20], kv_lens=[20], layout=layout, causal=True, noncontig=True,
             hq=6, hkv=2, seed=2)


@cpu_only
@pytest.mark.parametrize("causal,layout,one_loop,branch", [
    (True, "NHD", False, False), (False, "HND", False, False), (True, "HND", True, False),
    (False, "NHD", True, False), (True, "NHD", True, True), (False, "HND", True, True)])
def test_dense_kernel_interpreted(causal, layout, one_loop, branch):
    # the Hopper dense kernel's logic (descriptors, tails, qo > kv, empty KV, sinks, LSE), forced
    # with small tiles and no warp specialization so that the interpreter runs it
    be = TritonBackend(dense=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False,
                                  one_loop=one_loop, branch=branch))
    plan = run_case("batch_prefill_ragged", qo_lens=[40, 5, 0, 33, 16], kv_lens=[30, 70, 7, 33, 0],
                    causal=causal, layout=layout, sinks=True, hq=4, hkv=2, d=64, backend=be, seed=33)
    assert plan.dense and "dense_failed" not in plan.stats, plan.stats


def test_heads_first_rule():
    from attncore.backends.triton.backend import _heads_first
    causal_p1 = [64 * (i + 1) for i in range(64)]  # P1 causal, 64-row tiles
    assert _heads_first(causal_p1, 32, 132)
    assert not _heads_first([2048] * 64, 8, 132)  # equal costs (decode): no tail to fix
    p3 = [32 * (i + 1) for i in range(64)] * 8  # many requests: one SM's share dwarfs the spread
    assert not _heads_first(p3, 8, 132)
    assert not _heads_first([], 8, 132)


@cpu_only
@pytest.mark.parametrize("heads_first", [True, False])
def test_launch_orders(monkeypatch, heads_first):
    # both program orders of both kernels (the plan picks one by _heads_first)
    from attncore.backends.triton import plan as tp
    monkeypatch.setattr(tp, "_heads_first", lambda *a: heads_first)
    plan = run_case("batch_prefill_paged", qo_lens=[7, 40, 3], kv_lens=[19, 50, 3], page_size=4,
                    causal=True, hq=6, hkv=3, seed=5)
    assert plan.heads_first == heads_first
    be = TritonBackend(dense=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False,
                                  one_loop=True, branch=True))
    plan = run_case("batch_prefill_ragged", qo_lens=[40, 5, 33], kv_lens=[30, 70, 33], causal=True,
                    hq=4, hkv=2, d=64, backend=be, seed=6)
    assert plan.dense and plan.stats["heads_first"] == heads_first, plan.stats


@cpu_only
@pytest.mark.parametrize("page_size,layout,causal", [(16, "NHD", True), (1, "HND", True), (5, "NHD", False)])
def test_paged_gather_dense(page_size, layout, causal):
    # paged prefill through the dense kernel: pages copied into contiguous K/V first (shuffled
    # pages, a partial last page, qo > kv, an empty request, sinks, LSE)
    be = TritonBackend(dense=dict(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False,
                                  one_loop=True, branch=True), gather=True)
    plan = run_case("batch_prefill_paged", qo_lens=[40, 5, 0, 20], kv_lens=[37, 3, 7, 33], page_size=page_size,
                    layout=layout, causal=causal, sinks=True, hq=4, hkv=2, d=64, backend=be, seed=35)
    assert plan.dense and plan.gather is not None and "dense_failed" not in plan.stats, plan.stats


def test_gather_decision():
    # auto gathers only where the FLOPs per gathered byte pay for the copy, within the cap
    from types import SimpleNamespace
    from attncore.backends.triton.plan import _gather_bytes
    p = AttentionProblem(op="batch_prefill_paged", page_size=16, mask="causal", num_qo_heads=32, num_kv_heads=8)

    def decide(qo, kv, **kw):
        npg = (kv + 15) // 16
        plan = SimpleNamespace(problem=p, meta=SimpleNamespace(kv_indptr_host=[0, npg]))
        return _gather_bytes(TritonBackend(**kw), plan, [qo], [kv], True)

    assert decide(2048, 2048) == 8 << 20  # P3-like: ~4000 FLOPs per byte; K and V 128 pages x 16 x 8 x 128
    assert not decide(64, 8192)  # append-like: too few FLOPs per byte
    assert not decide(2048, 2048, gather_cap_mb=4)  # over the cap
    assert not decide(2048, 2048, gather=False)
    assert decide(64, 8192, gather=True)


def test_gather_cap_from_environment(monkeypatch):
    monkeypatch.setenv("ATTNCORE_TRITON_GATHER_MB", "0")
    assert TritonBackend()._gather_cap == 0
    monkeypatch.setenv("ATTNCORE_TRITON_GATHER_MB", "lots")
    r = TritonBackend().available()  # unavailable with the reason, not dropped from the registry
    assert len(r) == 1 and "ATTNCORE_TRITON_GATHER_MB" in str(r[0]) and "'lots'" in str(r[0])
    monkeypatch.delenv("ATTNCORE_TRITON_GATHER_MB")
    assert TritonBackend()._gather_cap == 512 << 20


@cpu_only
def test_batch_prefill_ragged_edges():
    # kv 0, qo > kv (rows that see nothing under causal), 1 token, longer
    run_case("batch_prefill_ragged", qo_lens=[5, 9, 1, 30, 0], kv_lens=[0, 4, 1, 70, 3], causal=True,
             hq=8, hkv=2, seed=3)


@cpu_only
@pytest.mark.parametrize("page_size,layout", [(1, "NHD"), (16, "HND"), (5, "NHD")])
def test_batch_prefill_paged(page_size, layout):
    # kv 32 with page 16: last page full
    run_case("batch_prefill_paged", qo_lens=[7, 16, 3], kv_lens=[19, 32, 3], page_size=page_size,
             layout=layout, causal=True, hq=4, hkv=1, seed=4)


@cpu_only
@pytest.mark.parametrize("kv_views,mode", [("same", 2), ("split", 1), ("padded", 0)])
def test_paged_row_addressing(kv_views, mode):
    """_kv_rows' three ways to address paged rows (token-row units shared by K and V, per tensor,
    element strides) give the same attention."""
    from attncore.backends.triton.kernels.attention import _kv_addr

    shape = (9, 5, 2, 32)
    ks = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3])
    vs = (ks[0] + 128, ks[1], ks[2]) if mode == 1 else ks
    if mode == 0:
        ks = vs = (ks[0] + 8, ks[1], ks[2])
    t = torch.empty(shape)
    assert _kv_addr(t, t, 5, ks, vs) == mode
    run_case("batch_prefill_paged", qo_lens=[7, 3], kv_lens=[19, 11], page_size=5, causal=True, hq=4, hkv=2,
             seed=5, kv_views=kv_views)


@cpu_only
def test_custom_mask_and_window():
    run_case("batch_prefill_paged", qo_lens=[9, 12], kv_lens=[21, 40], page_size=4, custom=True,
             window_left=10, seed=5)


@cpu_only
@pytest.mark.parametrize("window", [0, 7])
def test_window_causal(window):
    run_case("batch_prefill_ragged", qo_lens=[40, 6], kv_lens=[70, 6], causal=True, window_left=window,
             seed=6)


@cpu_only
def test_softcap_alibi_sinks():
    run_case("batch_prefill_ragged", qo_lens=[10, 17], kv_lens=[30, 17], causal=True, soft_cap=5.0,
             pos="ALIBI", sinks=True, hq=6, hkv=3, seed=7)


@cpu_only
@pytest.mark.parametrize("d", [32, 48])
def test_rope(d):
    run_case("batch_prefill_paged", qo_lens=[6, 11], kv_lens=[25, 11], page_size=8, causal=True,
             pos="ROPE_LLAMA", d=d, seed=8)


@cpu_only
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_scales(kv_dtype):
    run_case("batch_decode", qo_lens=[1] * 3, kv_lens=[40, 1, 17], page_size=8, kv_dtype=kv_dtype,
             scales=(1.0, 0.5, 0.25, 2.0), hq=8, hkv=2, seed=9)


@cpu_only
def test_decode_split_kv_gqa():
    be = TritonBackend(kv_chunk=32)
    plan = run_case("batch_decode", qo_lens=[1] * 4, kv_lens=[100, 0, 1, 64], page_size=16, hq=12,
                    hkv=2, sinks=True, backend=be, seed=10)
    assert plan.max_splits == 4 and plan.num_merge_rows > 0


@cpu_only
def test_split_hints_from_meta():
    # BatchMeta.fixed_split_size (pages per split) and disable_split_kv are honoured
    be = TritonBackend()
    p = run_case("batch_decode", qo_lens=[1] * 2, kv_lens=[70, 20], page_size=4, hq=4, hkv=2,
                 backend=be, seed=18, check=False)
    meta = dataclasses.replace(p.meta, fixed_split_size=4)
    # 4 pages x 4 = 16 keys, rounded up to whole KV tiles (block_n 32 here): 70 keys -> 3 splits
    assert be.plan(p.problem, meta).max_splits == 3
    meta = dataclasses.replace(p.meta, disable_split_kv=True)
    assert be.plan(p.problem, meta).max_splits == 1


@cpu_only
def test_decode_qlen_gt1_split():
    # q_len_per_req 3: causal within the draft; split partitions on top
    run_case("batch_decode", qo_lens=[3] * 3, kv_lens=[50, 3, 20], page_size=4, hq=4, hkv=1,
             backend=TritonBackend(kv_chunk=32), window_left=20, seed=11)


@cpu_only
def test_decode_fully_masked_window0_alibi():
    run_case("batch_decode", qo_lens=[1] * 2, kv_lens=[33, 7], page_size=1, window_left=0,
             pos="ALIBI", soft_cap=3.0, seed=12)


@cpu_only
def test_xqa_spec_sinks():
    # planned for max_seq_len without reading seq_lens back (no sync): splits past a request's end
    # merge as empty
    be = TritonBackend(kv_chunk=32)
    plan = run_case("xqa_decode", qo_lens=[4] * 3, kv_lens=[70, 4, 33], page_size=16, hq=8, hkv=2,
                    sinks=True, spec=True, sm_scale=0.3, scales=(1.0, 1.0, 0.7, 1.0), backend=be, seed=13)
    assert plan.meta.kv_lens_host is None and plan.max_splits == 3


@cpu_only
def test_xqa_plain_fp8():
    run_case("xqa_decode", qo_lens=[1] * 3, kv_lens=[25, 9, 1], page_size=8, hq=4, hkv=4,
             kv_dtype=torch.float8_e4m3fn, sm_scale=0.2, scales=(1.0, 1.0, 1.3, 1.0), window_left=8,
             seed=14)


@cpu_only
@pytest.mark.parametrize("causal,window,custom", [(True, 9, False), (False, 20, False), (False, -1, True)])
def test_small_tiles_three_ranges(causal, window, custom):
    # block 16 x 16: many KV tiles, so the masked-head / body / masked-tail loops all run
    be = TritonBackend(config=dict(block_m=16, block_n=16, num_warps=1, num_stages=1,
                                   prefetch=causal))
    run_case("batch_prefill_paged", qo_lens=[40, 3, 25], kv_lens=[90, 50, 25], page_size=3,
             causal=causal, window_left=window, custom=custom, hq=4, hkv=2, backend=be, seed=16)


@cpu_only
def test_large_group():
    run_case("batch_decode", qo_lens=[2] * 2, kv_lens=[40, 9], page_size=16, hq=48, hkv=1,
             backend=TritonBackend(config=dict(block_m=16, block_n=16, num_warps=1, num_stages=1,
                                               prefetch=True)), seed=17)


@cpu_only
def test_head_dim_64_no_lse():
    run_case("single_prefill", qo_lens=[17], kv_lens=[33], d=64, return_lse=False, causal=True, seed=15)


@cpu_only
def test_run_rejects_other_dtype():
    plan = run_case("single_prefill", qo_lens=[4], kv_lens=[4], check=False)
    be = TritonBackend()
    q = torch.randn(4, 4, 32, dtype=torch.float32)
    with pytest.raises(TypeError):
        be.run(plan, RunArgs(q=q, k=q[:, :2], v=q[:, :2], out=torch.empty_like(q)))
    # after runs that cached a launch, other shapes still get checked (the cache key covers them)
    q = torch.randn(4, 4, 32, dtype=torch.float16)
    good = RunArgs(q=q, k=q[:, :2], v=q[:, :2], out=torch.empty_like(q), lse=torch.empty(4, 4))
    be.run(plan, good)
    be.run(plan, good)
    with pytest.raises(ValueError, match="planned"):
        be.run(plan, dataclasses.replace(good, out=torch.empty(4, 4, 16, dtype=torch.float16)))
    with pytest.raises(ValueError, match="lse must be float32"):
        be.run(plan, dataclasses.replace(good, lse=torch.empty(4, 3)))


# ----------------------------------------------------------------------------- issue 13
# GQA groups that do not divide the tile: the kernel cut the causal / window KV range of a row tile's
# last token (groups 3, 5, 7: wrong output, no error); attncore.testing.tile_model models the slip.
ODD_GROUPS = [3, 5, 6, 7, 12]
TILES16 = dict(block_m=16, block_n=16, num_warps=1, num_stages=1, prefetch=True)
DENSE16 = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False, one_loop=True,
               branch=True)


@cpu_only
def test_issue13_repro_public_api():
    import attncore
    g = torch.Generator().manual_seed(13)
    q, k, v = torch.randn(21, 7, 16, generator=g), torch.randn(76, 1, 16, generator=g), torch.randn(76, 1, 16, generator=g)
    out = attncore.single_prefill_with_kv_cache(q, k, v, causal=True, backend="triton")
    contract.assert_batch([(q, k, v)], out, causal=True)


@cpu_only
@pytest.mark.parametrize("group", ODD_GROUPS)
@pytest.mark.parametrize("longer_kv", [True, False])
@pytest.mark.parametrize("op,layout,page_size", [
    ("single_prefill", "NHD", None), ("batch_prefill_ragged", "NHD", None),
    ("batch_prefill_ragged", "HND", None), ("batch_prefill_paged", "NHD", 5),
    ("batch_prefill_paged", "HND", 16)])
def test_odd_groups_causal(group, longer_kv, op, layout, page_size):
    # the interpreter's config: 64-row x 32-key tiles once a request has 64+ packed rows.  Lengths
    # at multiples of 16 / 32 / 64 and one off, qo < kv or qo > kv (top rows see no key), plus a
    # request the slip got wrong (a row tile's last token needs one more KV tile, or key 0)
    hkv = 1 if group >= 7 else 2
    slip = slip_request(group, 64, 32, longer_kv)
    if op == "single_prefill":
        qo_lens, kv_lens = [slip[0]], [slip[1]]
    elif longer_kv:
        qo_lens, kv_lens = [16, 33, 1, slip[0]], [31, 65, 128, slip[1]]
    else:
        qo_lens, kv_lens = [17, 64, 5, slip[0]], [16, 63, 0, slip[1]]
    plan = run_case(op, qo_lens=qo_lens, kv_lens=kv_lens, page_size=page_size, layout=layout, causal=True,
                    hq=group * hkv, hkv=hkv, d=16, seed=group * 7 + len(qo_lens))
    assert (plan.cfg.block_m, plan.cfg.block_n) == (64, 32), plan.cfg  # what slip_request assumed


@cpu_only
@pytest.mark.parametrize("group", ODD_GROUPS)
@pytest.mark.parametrize("causal,window", [(True, -1), (True, 20), (False, 6)])
def test_odd_groups_small_tiles(group, causal, window):
    # 16 x 16 tiles: a group straddles most tile ends.  With a window the unmasked range starts at
    # the last token's window bound, so the slip ran a tile unmasked that the last row sees part of
    qo_lens, kv_lens = [17, 32, 3, 9], [48, 32, 64, 4]
    for longer in (True, False):
        qo, kv = slip_request(group, 16, 16, longer, causal, window)
        qo_lens, kv_lens = qo_lens + [qo], kv_lens + [kv]
    run_case("batch_prefill_paged", qo_lens=qo_lens, kv_lens=kv_lens, page_size=16, causal=causal,
             window_left=window, hq=group, hkv=1, d=16, backend=TritonBackend(config=TILES16), seed=group)


@cpu_only
@pytest.mark.parametrize("group", [3, 5, 7, 12])
def test_odd_groups_decode_split(group):
    # q_len 3 decode (causal within the draft) on 16-row tiles, split KV and the merge.  Groups 7
    # and 12 pack 21 / 36 rows: row tiles end inside a group, and kv 65 (kv 17 for 12) was hit
    be = TritonBackend(config=TILES16, kv_chunk=32)
    kv_lens = [65, 3, 127, 17]
    plan = run_case("batch_decode", qo_lens=[3] * 4, kv_lens=kv_lens, page_size=16, hq=group * 2, hkv=2,
                    backend=be, sinks=True, seed=group)
    assert plan.max_splits > 1
    assert (group * 3 <= 16) or any(slips(3, kv, group, 16, 16) for kv in kv_lens)


@cpu_only
@pytest.mark.parametrize("group", [3, 7, 12])
@pytest.mark.parametrize("qo_lens,kv_lens", [([15, 17, 33], [64, 16, 31]), ([32, 1], [31, 33])])
def test_odd_groups_dense_kernel(group, qo_lens, kv_lens):
    # the Hopper dense kernel (one program per query head, no packing) with the same shapes
    be = TritonBackend(dense=DENSE16)
    plan = run_case("batch_prefill_ragged", qo_lens=qo_lens, kv_lens=kv_lens, causal=True, hq=group,
                    hkv=1, d=64, backend=be, seed=group)
    assert plan.dense and "dense_failed" not in plan.stats, plan.stats


# Non-finite inputs (docs/semantics.md): every run_case poisons K/V slots past kv_len, spare
# pages and view padding with NaN (rule 1); these add keys left of the window (rule 2), query rows
# with a NaN (rules 3-4) and NaN rows of other requests.  The interpreter warns on NaN math.
nan_ok = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning",
                                    "ignore:invalid value encountered:RuntimeWarning")


@cpu_only
@nan_ok
@pytest.mark.parametrize("op,kw", [
    ("batch_prefill_paged", dict(page_size=16, causal=True, backend=TritonBackend(config=TILES16))),
    ("batch_prefill_paged", dict(page_size=7, causal=False)),
    ("batch_prefill_ragged", dict(causal=True, layout="HND", noncontig=True)),
    ("batch_prefill_ragged", dict(causal=False, backend=TritonBackend(config=TILES16))),
])
@pytest.mark.parametrize("window", [2, 19])
def test_nan_left_of_window_prefill(op, kw, window):
    # request 0 (kv 90, qo 5): window 2 hides whole 16- and 32-key tiles (never visited) and part of
    # the first tile visited; 19 only keys 0-65, so part of the tile at 64
    run_case(op, qo_lens=[5, 20, 0, 3], kv_lens=[90, 40, 12, 3], window_left=window, hq=6, hkv=2,
             nan_window=True, seed=window, **kw)


@cpu_only
@nan_ok
@pytest.mark.parametrize("kv_chunk", [None, 32])
@pytest.mark.parametrize("qlen,window", [(1, 0), (1, 9), (4, 5)])
def test_nan_left_of_window_decode(kv_chunk, qlen, window):
    # split partitions wholly left of the window merge as empty; the NaN never reaches P.V
    be = TritonBackend(kv_chunk=kv_chunk) if kv_chunk else TritonBackend()
    run_case("batch_decode", qo_lens=[qlen] * 3, kv_lens=[100, 33, qlen], page_size=8, hq=6, hkv=2,
             window_left=window, nan_window=True, sinks=True, backend=be, seed=qlen + window)
    run_case("xqa_decode", qo_lens=[qlen] * 2, kv_lens=[70, 9], page_size=16, hq=4, hkv=1,
             window_left=window, nan_window=True, backend=be, seed=3)


@cpu_only
@nan_ok
@pytest.mark.parametrize("op,kw,dense", [
    ("batch_prefill_paged", dict(page_size=16), False),  # unused slots of the last pages, spare pages
    ("batch_prefill_paged", dict(page_size=16, backend=TritonBackend(config=TILES16), layout="HND"), False),
    # the gather copies whole pages (NaN slots too): the dense kernel must read none past kv_len
    ("batch_prefill_paged", dict(page_size=16, d=64, backend=TritonBackend(dense=DENSE16, gather=True)), True),
    ("batch_prefill_ragged", dict(noncontig=True), False),  # request 1's rows NaN, view padding NaN
    ("batch_prefill_ragged", dict(d=64, backend=TritonBackend(dense=DENSE16)), True),  # TMA tiles past kv_len
])
def test_nan_outside_kv_range_prefill(op, kw, dense):
    # request 1 has no query rows and NaN K/V: "other requests' rows" right after request 0's
    plan = run_case(op, qo_lens=[17, 0, 33, 5], kv_lens=[33, 31, 48, 1], causal=True, hq=6, hkv=2,
                    nan_reqs=[1], seed=21, **kw)
    assert bool(plan.dense) == dense and "dense_failed" not in plan.stats, plan.stats


@cpu_only
@nan_ok
@pytest.mark.parametrize("op,kw", [
    ("batch_decode", dict(page_size=16, backend=TritonBackend(kv_chunk=32))),
    ("batch_decode", dict(page_size=3)),
    ("xqa_decode", dict(page_size=16, backend=TritonBackend(kv_chunk=32))),
])
def test_nan_outside_kv_range_decode(op, kw):
    # last pages 1/16 and 15/16 used (NaN in the rest), spare pages NaN, a split past a short request
    run_case(op, qo_lens=[1] * 4, kv_lens=[33, 1, 47, 64], hq=8, hkv=2, sinks=True, seed=22, **kw)


@cpu_only
@nan_ok
@pytest.mark.parametrize("op,kw", [
    ("batch_prefill_ragged", dict(causal=True)),
    ("batch_prefill_ragged", dict(causal=True, backend=TritonBackend(config=TILES16), sinks=True)),
    ("batch_prefill_ragged", dict(causal=True, d=64, sinks=True, backend=TritonBackend(dense=DENSE16))),
    ("batch_prefill_paged", dict(page_size=4, window_left=3, causal=True, pos="ROPE_LLAMA")),
    ("batch_prefill_paged", dict(page_size=4, custom=True, soft_cap=4.0, pos="ALIBI")),
])
def test_nan_query_row_prefill(op, kw):
    # request 0: qo > kv, so rows 0-4 see no key (causal): a NaN there gives 0 / -inf; row 9 sees
    # keys: NaN out and LSE, and only there (other heads of the token, other tokens exact).
    # Custom mask: request 0 row 0 is fully masked.  Request 2: kv 0.
    nan_q = [(0, 0, 1), (0, 9, 2), (0, 15, 5), (1, 0, 0), (1, 20, 3), (2, 1, 4)]
    run_case(op, qo_lens=[16, 21, 2], kv_lens=[11, 40, 0], hq=6, hkv=2, nan_q=nan_q, seed=23, **kw)


@cpu_only
@nan_ok
@pytest.mark.parametrize("kv_chunk", [None, 16])
@pytest.mark.parametrize("sinks", [False, True])
def test_nan_query_row_decode(kv_chunk, sinks):
    # split: every partial of the NaN row is NaN (or -inf where the window hides the split);
    # the merge must keep NaN, and give 0 / -inf to a row that saw nothing (request 2: kv 0)
    be = TritonBackend(kv_chunk=kv_chunk) if kv_chunk else TritonBackend()
    nan_q = [(0, 0, 1), (1, 0, 0), (1, 0, 5), (2, 0, 2)]
    run_case("batch_decode", qo_lens=[1] * 3, kv_lens=[70, 40, 0], page_size=8, hq=6, hkv=2,
             window_left=20, sinks=sinks, nan_q=nan_q, backend=be, seed=24)
    run_case("xqa_decode", qo_lens=[2] * 2, kv_lens=[50, 2], page_size=16, hq=6, hkv=3, sinks=sinks,
             spec=True, nan_q=[(0, 1, 4), (1, 0, 0)], backend=be, seed=25)


# ----------------------------------------------------------------------------- GPU
GPU_DTYPES = [torch.bfloat16, torch.float16]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_single_prefill(dtype, causal, d):
    run_case("single_prefill", qo_lens=[300], kv_lens=[517], hq=8, hkv=2, d=d, dtype=dtype,
             causal=causal, device="cuda", seed=d)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal,layout,noncontig", [(True, "NHD", False), (False, "HND", True),
                                                     (True, "HND", True), (False, "NHD", False)])
def test_gpu_dense_prefill(dtype, causal, layout, noncontig):
    # the Hopper dense kernel (TMA + warp specialization): ragged tails, qo > kv under causal,
    # an empty KV, GQA, sinks and LSE; elsewhere the same case runs the generic kernel
    d = 128 if causal else 64
    be = TritonBackend(kv_chunk=0)  # no split-KV: this small batch would be split (generic kernel)
    plan = run_case("batch_prefill_ragged", qo_lens=[200, 5, 0, 129, 64], kv_lens=[150, 300, 7, 129, 0],
                    causal=causal, layout=layout, noncontig=noncontig, sinks=True, hq=8, hkv=2, d=d,
                    dtype=dtype, device="cuda", seed=31, backend=be)
    if torch.cuda.get_device_capability()[0] == 9:
        assert plan.dense and "dense_skipped" not in plan.stats, plan.stats
    else:
        assert not plan.dense


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_dense_configs(causal, d):
    # every default dense config of the head dim, each forced: exact where it compiles
    from attncore.backends.triton import config as tcfg
    p = AttentionProblem(op="batch_prefill_ragged", mask="causal" if causal else "none", head_dim_qk=d,
                         head_dim_vo=d)
    for c in tcfg.dense_candidates(p, causal):
        be = TritonBackend(dense=c.as_dict(), kv_chunk=0)
        plan = run_case("batch_prefill_ragged", qo_lens=[300, 70], kv_lens=[517, 70], causal=causal, hq=8,
                        hkv=2, d=d, dtype=torch.bfloat16, device="cuda", seed=32, backend=be)
        assert plan.dense and "dense_failed" not in plan.stats, plan.stats


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_dense_repeatable(causal):
    # the warp-specialized default must be race-free: eager runs and a CUDA-graph replay give the
    # same bits, LSE included (ragged tails, qo > kv, sinks)
    qo, kv = [300, 70, 1, 129, 40], [517, 70, 5, 129, 20]
    dev = torch.device("cuda")
    i32 = dict(device=dev, dtype=torch.int32)
    qi, ki = [0], [0]
    for a, b in zip(qo, kv):
        qi.append(qi[-1] + a)
        ki.append(ki[-1] + b)
    g = torch.Generator(device=dev).manual_seed(34)
    q = torch.randn(qi[-1], 8, 128, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(ki[-1], 2, 128, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(ki[-1], 2, 128, device=dev, generator=g).to(torch.bfloat16)
    meta = BatchMeta(batch_size=len(qo), qo_indptr=torch.tensor(qi, **i32), qo_indptr_host=qi,
                     kv_indptr=torch.tensor(ki, **i32), kv_indptr_host=ki, kv_lens=torch.tensor(kv, **i32),
                     kv_lens_host=kv, params=AttnParams(sm_scale=128 ** -0.5, causal=causal), device=dev)
    p = AttentionProblem(op="batch_prefill_ragged", device_type="cuda",
                         compute_capability=torch.cuda.get_device_capability(), q_dtype=torch.bfloat16,
                         kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_qo_heads=8, num_kv_heads=2,
                         mask="causal" if causal else "none", sinks=True, return_lse=True)
    args = RunArgs(q=q, k=k, v=v, out=torch.empty_like(q), lse=torch.empty(qi[-1], 8, device=dev),
                   sinks=torch.randn(8, device=dev, generator=g))
    be = TritonBackend(kv_chunk=0)
    plan = be.plan(p, meta)
    be.run(plan, args)
    torch.cuda.synchronize()
    first = (args.out.clone(), args.lse.clone())
    for _ in range(30):
        args.out.fill_(float("nan"))
        args.lse.fill_(float("nan"))
        be.run(plan, args)
        torch.cuda.synchronize()
        assert torch.equal(args.out, first[0]) and torch.equal(args.lse, first[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.run(plan, args)
    for _ in range(10):
        args.out.fill_(float("nan"))
        args.lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(args.out, first[0]) and torch.equal(args.lse, first[1])
    if torch.cuda.get_device_capability()[0] == 9:  # the default config ran (not a fallback)
        from attncore.backends.triton import config as tcfg
        assert plan.stats["dense"] == tcfg.dense_candidates(p, causal)[0].as_dict(), plan.stats


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("page_size,layout", [(1, "NHD"), (16, "NHD"), (16, "HND")])
def test_gpu_batch_prefill_paged(dtype, page_size, layout):
    run_case("batch_prefill_paged", qo_lens=[100, 1, 0, 64, 200], kv_lens=[300, 1, 5, 64, 150],
             page_size=page_size, layout=layout, causal=True, hq=8, hkv=2, d=128, dtype=dtype,
             device="cuda", seed=21)


@gpu
@needs_cuda
def test_gpu_relaunch_fast_path():
    # relaunches of a plan skip Triton's argument binding (attncore/kernels/launch.py); a Triton whose
    # compiled-kernel interface changed would silently fall back to the slow path: caught here
    plan = run_case("batch_decode", qo_lens=[1] * 3, kv_lens=[100, 7, 300], page_size=16, hq=8, hkv=2, d=128,
                    dtype=torch.bfloat16, device="cuda", seed=37)
    (fwd, _), = plan.launch_cache.values()
    assert fwd.launcher.fast_calls >= 1  # run_case's second run (same strides, new buffers)


@gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_paged_gather(layout):
    # paged prefill through the gather + the default dense config (warp-specialized on sm_90)
    plan = run_case("batch_prefill_paged", qo_lens=[300, 70, 0, 129], kv_lens=[517, 70, 9, 100], page_size=16,
                    layout=layout, causal=True, sinks=True, hq=8, hkv=2, d=128, dtype=torch.bfloat16,
                    device="cuda", seed=36, backend=TritonBackend(gather=True, kv_chunk=0))
    if torch.cuda.get_device_capability()[0] == 9:
        assert plan.dense and plan.gather is not None and "dense_failed" not in plan.stats, plan.stats


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_features(dtype):
    run_case("batch_prefill_ragged", qo_lens=[70, 130], kv_lens=[200, 130], causal=True, soft_cap=30.0,
             pos="ALIBI", sinks=True, window_left=64, hq=8, hkv=4, d=128, dtype=dtype, device="cuda",
             noncontig=True, seed=22)
    run_case("batch_prefill_paged", qo_lens=[33, 80], kv_lens=[90, 200], custom=True, page_size=16,
             hq=4, hkv=4, d=64, dtype=dtype, device="cuda", seed=23)
    run_case("batch_prefill_paged", qo_lens=[33, 80], kv_lens=[90, 200], causal=True, page_size=16,
             pos="ROPE_LLAMA", hq=8, hkv=2, d=128, dtype=dtype, device="cuda", seed=24)


@gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_decode(dtype, kv_dtype):
    kv = [1000, 1, 0, 4096, 77]
    run_case("batch_decode", qo_lens=[1] * 5, kv_lens=kv, page_size=16, hq=32, hkv=8, d=128,
             dtype=dtype, kv_dtype=kv_dtype, scales=(1.0, 0.5, 0.25, 1.0), device="cuda", seed=25)
    run_case("batch_decode", qo_lens=[2] * 5, kv_lens=[k + 2 for k in kv], page_size=1, hq=32, hkv=8,
             d=128, dtype=dtype, kv_dtype=kv_dtype, device="cuda", sinks=True, seed=26)


@gpu
@needs_cuda
@pytest.mark.parametrize("qlen", [1, 2, 4])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_gpu_xqa(qlen, kv_dtype):
    run_case("xqa_decode", qo_lens=[qlen] * 6, kv_lens=[3000, qlen, 600, 40, 8192, 17], page_size=16,
             hq=64, hkv=8, d=128, dtype=torch.bfloat16, kv_dtype=kv_dtype, sinks=True, spec=qlen > 1,
             sm_scale=0.088, scales=(1.0, 1.0, 0.8, 1.0), window_left=1000 if qlen == 2 else -1,
             device="cuda", seed=27)


def test_fast_launcher_relaunches_compiled_kernel(monkeypatch):
    # the relaunch path hands the arguments (tensors as their addresses, constexprs appended in parameter
    # order) to the compiled kernel's launcher; a tensor no longer aligned as compiled goes back through Triton
    from attncore.core import current
    from attncore.kernels.launch import FastLauncher

    monkeypatch.setattr(current, "device_index", lambda: 0)
    monkeypatch.setattr(current, "stream", lambda index: 0)

    calls = []

    class Kernel:
        function, packed_metadata = "fn", "meta"

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *a):
            calls.append(("fast", a))

    class Fn:
        arg_names = ["X", "Y", "n", "BLOCK"]

        def __getitem__(self, grid):
            def plain(*args, **kw):
                calls.append(("plain", args, kw))
                return Kernel()
            return plain

    fl = FastLauncher(Fn(), (4,), dict(BLOCK=32, num_warps=4))
    x = torch.empty(64, dtype=torch.float16)
    y = torch.empty(64, dtype=torch.float16)[1:]  # 2-byte offset: compiled without the alignment assumption
    fl(x, y, 7)
    assert calls[-1] == ("plain", (x, y, 7), dict(BLOCK=32, num_warps=4)) and fl.fast_calls == 0
    fl(x, y, 7)
    kind, a = calls[-1]
    assert kind == "fast" and a[:4] == (4, 1, 1, 0) and fl.fast_calls == 1
    assert a[-4:] == (x.data_ptr(), y.data_ptr(), 7, 32)
    fl.at((2, 3), x, y, 9)  # a per-call grid (RoPE, append): the same compiled kernel, the grid padded to 3
    kind, a = calls[-1]
    assert kind == "fast" and a[:4] == (2, 3, 1, 0) and a[-4:] == (x.data_ptr(), y.data_ptr(), 9, 32)
    y2 = torch.empty(64, dtype=torch.float16)  # aligned where the first was not: the compiled variant runs it
    fl(x, y2, 7)
    assert calls[-1][0] == "fast" and calls[-1][1][-3] == y2.data_ptr() and fl.fast_calls == 3
    fl(x[1:], y, 7)  # not 16-byte aligned where the first was
    assert calls[-1][0] == "plain" and fl.fast_calls == 3


def test_unavailable_hint_names_the_missing_module(monkeypatch):
    """Triton's interpreter imports numpy: without it the hint must say numpy, not triton."""
    import builtins
    import sys

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "triton":
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
        return real(name, *a, **k)

    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake)
    reasons = TritonBackend().available()
    assert [r.hint for r in reasons] == ["pip install numpy"], reasons
    assert "No module named 'numpy'" in str(reasons[0])
