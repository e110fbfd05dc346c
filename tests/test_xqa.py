"""xqa backend: capabilities and compile checks (CPU), numerics against the fp64 golden (GPU).

CPU: the backend reports why it is unavailable, refuses what it does not serve, and its CUDA sources
compile for sm_80 and sm_90 with nvcc (no GPU needed).  GPU (``@pytest.mark.gpu``): every case runs
the backend on fresh random inputs with NaN-poisoned outputs and compares each request with
the fp64 golden with the conformance suite's checker and tolerance rule
(``attncore.testing.contract.assert_batch``: 2x the error of the same attention computed by torch in
the backend's dtype plus a rounding atol, for outputs and LSE; rows that see no key exactly 0 / -inf).
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from attncore.core.backend import AttnParams, BatchMeta, RunArgs
from attncore.core.mask import pack_spec_mask
from attncore.core.problem import AttentionProblem
from attncore.testing import runner
from attncore.testing.contract import assert_batch, page_table


def _rank(backend, problem) -> int:
    """auto's rank of a shipped backend: the rule table (attncore.core.ranking)."""
    from attncore.core.ranking import rule_rank

    return rule_rank(backend, problem).rank

gpu = pytest.mark.gpu
HAS_GPU = torch.cuda.is_available()


def _backend():
    """The backend; ``XQA_TEST_TUNE`` (e.g. ``kpw32st2``) runs the GPU tests on a tuning variant."""
    import re

    from attncore.backends.xqa.backend import XqaBackend
    from attncore.backends.xqa.specs import TUNE

    b = XqaBackend()
    tune = os.environ.get("XQA_TEST_TUNE", "")
    if tune:
        b.tune = tuple((k, int(v)) for k, v in re.findall(r"(%s)(\d+)" % "|".join(TUNE), tune))
    return b


def _problem(op="xqa_decode", *, q=torch.bfloat16, kv=None, out=None, hq=32, hkv=8, d=128, ps=16, layout="NHD",
             window=-1, sinks=False, q_len=1, spec=False, lse=False, cc=(9, 0), device="cuda", scales=False):
    kv = kv or q
    return AttentionProblem(op=op, device_type=device, compute_capability=cc if device == "cuda" else None,
                            q_dtype=q, kv_dtype=kv, out_dtype=out or q, num_qo_heads=hq, num_kv_heads=hkv,
                            head_dim_qk=d, head_dim_vo=d, page_size=ps, kv_layout=layout, mask="causal",
                            window_left=window, sinks=sinks, q_len_per_req=q_len, spec_mask=spec,
                            return_lse=lse, fp8_scales=scales)


# --------------------------------------------------------------------------------------- CPU
def test_plugin_returns_backend():
    from attncore.backends.xqa import plugin

    bs = plugin.attncore_backends()
    assert len(bs) == 1 and bs[0].name == "xqa"


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU reason")
def test_unavailable_reason_without_gpu():
    reasons = _backend().available()
    assert reasons, "xqa must report why it cannot run without a GPU"
    assert any("cuda" in str(r).lower() or "nvcc" in str(r).lower() for r in reasons)


def test_claims_and_refusals():
    b = _backend()
    ok = [
        _problem(),
        _problem(q=torch.float16, hq=64, hkv=8, q_len=4, spec=True, sinks=True, window=128),
        _problem(kv=torch.float8_e4m3fn, out=torch.float8_e4m3fn, scales=True),
        _problem(op="batch_decode", d=64, ps=1, layout="HND", hq=16, hkv=1),
        _problem(d=256, ps=128, hq=8, hkv=8, cc=(8, 0), lse=True),
    ]
    for p in ok:
        assert b.reasons(p) == [], (p.describe(), [str(r) for r in b.reasons(p)])
    bad = {
        "op": _problem(op="batch_prefill_paged"),
        "op-single": _problem(op="single_prefill"),
        "device": _problem(device="cpu"),
        "head_dim": _problem(d=96),
        "page_size": _problem(ps=3),
        "cc": _problem(cc=(8, 9)),
        "cc-old": _problem(cc=(7, 5)),
        "nvfp4": _problem(kv=torch.uint8),
        "out": _problem(out=torch.float8_e4m3fn),  # fp8 out needs fp8 KV
        "out-fp16": _problem(out=torch.float16),
        "kv-mismatch": _problem(q=torch.float16, kv=torch.bfloat16),
        "spec-on-batch-decode": _problem(op="batch_decode", spec=True),
        "softcap": _problem().replace(soft_cap=True),
        "alibi": _problem().replace(pos_encoding="ALIBI"),
        "custom-mask": _problem().replace(mask="custom"),
    }
    for name, p in bad.items():
        rs = b.reasons(p)
        assert rs, f"{name}: {p.describe()} must be refused"
        assert all(str(r) for r in rs)
    nv = [str(r) for r in b.reasons(_problem(kv=torch.uint8))]
    assert any("NVFP4" in s for s in nv)


def test_key_for_swaps_up_to_8_rows():
    """At most 8 rows per kv head go to the swapped-product kernel, as each KV width's knob says; more
    rows, or the knob off, do not."""
    b = _backend()
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    b.swap_for_fp8, b.swap_for_16bit = True, False
    assert b.key_for(_problem(kv=e4, hq=32, hkv=8), 1).swap            # group 4
    assert b.key_for(_problem(kv=e5, hq=16, hkv=4, d=256), 2).swap     # 4 x 2 draft rows
    assert not b.key_for(_problem(kv=e4, hq=32, hkv=4), 2).swap        # 16 rows
    assert not b.key_for(_problem(hq=32, hkv=8), 1).swap               # 16-bit KV, its knob off
    b.swap_for_16bit = True
    assert b.key_for(_problem(hq=32, hkv=8), 1).swap
    assert b.key_for(_problem(q=torch.float16, hq=8, hkv=8, d=64), 1).swap  # MHA: one row
    assert not b.key_for(_problem(hq=64, hkv=4), 1).swap               # 16 rows
    b.swap_for_fp8 = False
    assert not b.key_for(_problem(kv=e4, hq=32, hkv=8), 1).swap


def test_key_for_takes_the_split_dims_kernel_for_9_to_32_fp8_rows():
    """fp8 KV at d128 with more rows than the swapped kernel takes goes to the split-dims kernel, one 16- or 32-row
    CTA as mt says; not for 16-bit KV or other head dims, not with its knob off."""
    b = _backend()
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    q2 = b.key_for(_problem(kv=e4, hq=64, hkv=8), 2)                    # 16 rows
    q4 = b.key_for(_problem(kv=e5, q=torch.float16, hq=64, hkv=8), 4)  # 32 rows
    assert (q2.sd, q2.mt, q4.sd, q4.mt) == (True, 1, True, 2) and q4.uri.endswith("_mt2_sd")
    assert b.key_for(_problem(kv=e4, hq=64, hkv=8, cc=(8, 0)), 2).sd   # plain mma.sync: sm80 too
    assert not b.key_for(_problem(kv=e4, hq=32, hkv=8), 1).sd           # 4 rows: the swapped kernel
    assert not b.key_for(_problem(hq=64, hkv=8), 2).sd                  # 16-bit KV
    assert not b.key_for(_problem(kv=e4, hq=64, hkv=8, d=64), 2).sd
    b.sd_for_fp8 = False
    assert not b.key_for(_problem(kv=e4, hq=64, hkv=8), 2).sd


def test_share_key_declines_outside_what_was_measured():
    """A decode on a share of the SMs (POD's SM split, XqaBackend.plan_for_sms) gets two-stage CTAs only where that
    was measured (16-bit KV, d128, <= 16 rows per CTA, at most SHARE_STAGES2 of the SMs); elsewhere None."""
    from types import SimpleNamespace

    from attncore.backends.xqa.backend import SHARE_STAGES2, share_key
    from attncore.backends.xqa.specs import XqaKey

    def lib(key, stages=3):
        return SimpleNamespace(key=key, num_sms=132, stages=stages)

    share = int(SHARE_STAGES2 * 132)
    base = XqaKey("bf16", "same", "same", 128, 1)
    assert share_key(lib(base), share) == XqaKey("bf16", "same", "same", 128, 1, (("st", 2),))
    assert share_key(lib(base), share + 1) is None  # most of the SMs
    for key in (XqaKey("bf16", "e4m3", "same", 128, 1), XqaKey("bf16", "same", "same", 64, 1),
                XqaKey("bf16", "same", "same", 128, 2), XqaKey("fp16", "same", "same", 128, 1, (("kpw", 16),))):
        assert share_key(lib(key), 64) is None, key
    assert share_key(lib(base, stages=2), 64) is None  # two stages already


def test_split_count_for_a_share_of_the_sms():
    """PD1's decode (64 requests x 8 kv heads = 512 CTAs of 4096 keys, 64-key tiles): one split fills two waves of
    the whole GPU's 264 slots and of 92 SMs' 276; on 84 SMs (252 slots) one split would leave a third wave of 8
    CTAs, each reading a whole request, so the count for that share splits."""
    from attncore.backends.xqa import plan as xplan

    assert xplan.choose_splits(512, 64, 132 * 2) == 1
    assert xplan.choose_splits(512, 64, 92 * 3) == 1
    s = xplan.choose_splits(512, 64, 84 * 3)
    assert s > 1 and -(-512 * s // 252) * (-(-64 // s) + 2) < 3 * (64 + 2)


def test_priority():
    b = _backend()
    assert _rank(b, _problem(cc=(9, 0))) == 70
    assert _rank(b, _problem(cc=(8, 0))) == 40


def test_uri_roundtrip_and_splits():
    from attncore.backends.xqa import plan as xplan, specs

    tuned = specs.XqaKey("bf16", "e4m3", "same", 128, 1, (("kpw", 32), ("st", 2)))
    swapped = specs.XqaKey("fp16", "e5m2", "same", 64, 1, (("kpw", 16),), swap=True)
    for k in specs.default_keys() + [specs.XqaKey("fp16", "e5m2", "e4m3", 64, 2), tuned, swapped]:
        s = specs.parse(k.uri + "_sm90")
        assert s.uri == k.uri
    assert tuned.uri.endswith("_mt1_tkpw32st2") and ("XQA_KPW", "32") in tuned.spec().defines
    assert swapped.uri.endswith("_mt1_sw_tkpw16") and ("XQA_SWAP", "1") in swapped.spec().defines
    sd = specs.XqaKey("bf16", "e4m3", "same", 128, 2, (("st", 3),), sd=True)
    assert specs.parse(sd.uri + "_sm90").uri == sd.uri == "xqa_decode_bf16_kve4m3_d128_mt2_sd_tst3"
    assert ("XQA_SD", "1") in sd.spec().defines
    for bad in (specs.XqaKey("bf16", "same", "same", 128, 1, sd=True), specs.XqaKey("bf16", "e4m3", "same", 64, 1,
                                                                                     sd=True),
                specs.XqaKey("bf16", "e4m3", "same", 128, 1, swap=True, sd=True)):
        with pytest.raises(ValueError, match="split-dims kernel .* serves fp8 KV at head_dim 128, without _sw"):
            bad.spec()
    for bad in (specs.XqaKey("bf16", "same", "same", 128, 2, swap=True), specs.XqaKey("bf16", "e4m3", "same", 128, 2,
                                                                                      swap=True)):
        with pytest.raises(ValueError, match="swapped-product kernel .* serves mt1 only"):
            bad.spec()
    with pytest.raises(ValueError):
        specs.XqaKey("bf16", "e4m3", "same", 128, 1, (("nope", 1),)).spec()
    with pytest.raises(ValueError):
        specs.parse("xqa_decode_bf16_d96_mt1")
    with pytest.raises(ValueError):
        specs.XqaKey("bf16", "same", "e4m3", 128, 1).spec()
    # split policy: a full batch stays unsplit, one long request fills the GPU
    assert xplan.choose_splits(512, 64, 264) == 1
    assert xplan.choose_splits(8, 512, 264) >= 16
    assert xplan.choose_splits(128, 256, 264) == 2


def test_params_struct_layout():
    import ctypes

    from attncore.backends.xqa.binding import XqaParams

    # 13 pointers, 13 int64 strides, 14 int32, 2 floats, 2 int32 (mirrors csrc/xqa_params.h)
    assert ctypes.sizeof(XqaParams) == 13 * 8 + 13 * 8 + 14 * 4 + 2 * 4 + 2 * 4


def _nvcc():
    from attncore.build import jit

    return jit.find_nvcc()


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_sources_compile_sm80_sm90():
    """Representative specializations compile for sm_80 and sm_90 without register spills."""
    from attncore.build import jit
    from attncore.backends.xqa.specs import XqaKey

    keys = [XqaKey("bf16", "same", "same", 128, 1), XqaKey("bf16", "e4m3", "same", 128, 2),
            XqaKey("fp16", "e4m3", "e4m3", 256, 1), XqaKey("fp16", "e5m2", "same", 64, 2),
            XqaKey("bf16", "e4m3", "same", 128, 1, swap=True), XqaKey("bf16", "e4m3", "same", 128, 2, sd=True)]
    res = jit.compile_check([k.spec() for k in keys], archs=("80", "90"), ptxas_verbose=True)
    assert len(res) == 2 * len(keys)
    for r in res:
        spills = [ln for ln in r.log.splitlines() if "spill" in ln and "0 bytes spill stores" not in ln]
        assert not spills, (r.spec.uri, r.arch, spills)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_fp8_d128_ring_defaults(tmp_path, monkeypatch):
    """fp8 KV at d128: the swapped kernel streams 64-key tiles through two stages and the 16-row main kernel 128-key
    tiles through two (4 and 3 CTAs per SM on the H200, bench/xqa.md session 50); tuning options still override."""
    import ctypes

    from attncore.build import jit
    from attncore.backends.xqa.specs import XqaKey

    monkeypatch.setenv("ATTNCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTNCORE_JIT_QUIET", "1")
    got = {}
    for k in (XqaKey("bf16", "e4m3", "same", 128, 1, swap=True), XqaKey("fp16", "e5m2", "same", 128, 1),
              XqaKey("bf16", "e4m3", "same", 128, 1, (("kpw", 32), ("st", 3)), swap=True)):
        lib = ctypes.CDLL(str(jit.build_spec(k.spec(), "90").path))
        info = (ctypes.c_int * 8)()
        lib.xqa_info(info)
        got[k.uri] = (info[0], info[1], info[4])  # rows per CTA, keys per tile, stages
    assert list(got.values()) == [(8, 64, 2), (16, 128, 2), (8, 128, 3)], got


# --------------------------------------------------------------------------------------- GPU helpers
def _rand_kv(shape, dtype, device):
    x = torch.randn(shape, device=device, dtype=torch.float32)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (x * 2).to(dtype)
    return x.to(dtype)


class Case:
    """Random paged decode batch, in block-table form (xqa_decode) or CSR form (batch_decode)."""

    def __init__(self, *, op="xqa_decode", B=3, hq=32, hkv=8, d=128, ps=16, kv_lens=None, q_len=1,
                 dtype=torch.bfloat16, kv_dtype=None, out_dtype=None, layout="NHD", window=-1, sinks=False,
                 spec=False, lse=False, bmm1=None, bmm2=1.0, o_scale=1.0, tuple_cache=False, seed=0,
                 q_noncontig=False, cuda_graph=False, pdl=False):
        dev = torch.device("cuda")
        gen = random.Random(seed)
        torch.manual_seed(seed)
        self.__dict__.update({k_: v_ for k_, v_ in locals().items() if k_ != "self"})
        kv_dtype = kv_dtype or dtype
        out_dtype = out_dtype or dtype
        self.kv_dtype, self.out_dtype = kv_dtype, out_dtype
        if kv_lens is None:
            kv_lens = [gen.randint(q_len, 700) for _ in range(B)]
        self.kv_lens = kv_lens
        B = len(kv_lens)
        self.B = B
        pt = page_table(kv_lens, ps)  # shuffled pages, 3 spare
        self.pages, total = pt.pages, pt.total
        if layout == "NHD":
            shape = (total, 2, ps, hkv, d)
        else:
            shape = (total, 2, hkv, ps, d)
        cache = _rand_kv(shape, kv_dtype, dev)
        if tuple_cache:
            self.k_cache, self.v_cache = cache[:, 0].contiguous(), cache[:, 1].contiguous()
        else:
            self.k_cache, self.v_cache = cache[:, 0], cache[:, 1]
        if q_noncontig:
            qbig = torch.randn(B * q_len, hq, d + 64, device=dev).to(dtype)
            self.q = qbig[:, :, 32:32 + d]
        else:
            self.q = torch.randn(B * q_len, hq, d, device=dev).to(dtype)
        self.sm_scale = bmm1 if bmm1 is not None else 1.0 / math.sqrt(d)
        self.sinks_t = (torch.randn(hq, device=dev) * 2).float() if sinks else None
        self.mask_t = None
        self.mask_bool = None
        if spec:
            bits = torch.rand(B, q_len, q_len) < 0.6
            bits |= torch.eye(q_len, dtype=torch.bool)[None]
            self.mask_bool = bits
            self.mask_t = pack_spec_mask(bits).to(dev)
        maxp = max([len(pg) for pg in self.pages] + [1])
        bt = torch.full((B, maxp + 2), 10 ** 6, dtype=torch.int32)  # garbage past the used pages
        for i, pg in enumerate(self.pages):
            if pg:
                bt[i, :len(pg)] = torch.tensor(pg, dtype=torch.int32)
        self.block_tables = bt.to(dev)
        self.seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
        self.op = op
        self.problem = AttentionProblem(
            op=op, device_type="cuda", compute_capability=tuple(torch.cuda.get_device_capability()),
            q_dtype=dtype, kv_dtype=kv_dtype, out_dtype=out_dtype, num_qo_heads=hq, num_kv_heads=hkv,
            head_dim_qk=d, head_dim_vo=d, page_size=ps, kv_layout=layout, mask="causal", window_left=window,
            sinks=sinks, fp8_scales=(bmm2 != 1.0 or o_scale != 1.0), return_lse=lse, q_len_per_req=q_len,
            spec_mask=spec, cuda_graph=cuda_graph)
        params = AttnParams(sm_scale=self.sm_scale, causal=True, window_left=window)
        qo_host = [i * q_len for i in range(B + 1)]
        qo = torch.tensor(qo_host, dtype=torch.int32, device=dev)
        if op == "xqa_decode":
            self.meta = BatchMeta(batch_size=B, qo_indptr=qo, qo_indptr_host=qo_host,
                                  block_tables=self.block_tables, seq_lens=self.seq_lens,
                                  kv_lens=self.seq_lens, max_seq_len=max(kv_lens + [0]), page_size=ps,
                                  params=params, q_len_per_req=q_len, device=dev)
        else:
            indices = torch.tensor(pt.indices or [0], dtype=torch.int32, device=dev)
            self.meta = BatchMeta(batch_size=B, qo_indptr=qo, qo_indptr_host=qo_host,
                                  kv_indptr=torch.tensor(pt.indptr, dtype=torch.int32, device=dev),
                                  kv_indptr_host=pt.indptr, kv_indices=indices,
                                  kv_last_page_len=torch.tensor(pt.last_page_len, dtype=torch.int32, device=dev),
                                  kv_lens=self.seq_lens, kv_lens_host=list(kv_lens), page_size=ps,
                                  params=params, q_len_per_req=q_len, device=dev)

    def new_out(self):
        out = torch.empty(self.q.shape, dtype=self.out_dtype, device=self.q.device)
        if self.out_dtype.is_floating_point and self.out_dtype.itemsize == 1:
            out.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        else:
            out.fill_(float("nan"))
        lse = torch.full(self.q.shape[:2], float("nan"), device=self.q.device) if self.lse else None
        return out, lse

    def args(self, out, lse):
        return RunArgs(q=self.q, k=self.k_cache, v=self.v_cache, out=out, lse=lse, sinks=self.sinks_t,
                       v_scale=self.bmm2, o_scale=self.o_scale, spec_mask=self.mask_t, enable_pdl=self.pdl)

    def run(self, backend=None, plan=None):
        backend = backend or _backend()
        assert backend.reasons(self.problem) == [], [str(r) for r in backend.reasons(self.problem)]
        plan = plan or backend.plan(self.problem, self.meta)
        out, lse = self.new_out()
        backend.run(plan, self.args(out, lse))
        torch.cuda.synchronize()
        return out, lse, plan

    def run_checked(self, backend=None):
        """``run()``, then ``check()`` its output; returns (out, lse, plan)."""
        out, lse, plan = self.run(backend)
        self.check(out, lse)
        return out, lse, plan

    def request_kv(self, i):
        pg = self.pages[i]
        n = self.kv_lens[i]
        if not pg:
            shp = (0, self.hkv, self.d)
            return torch.zeros(shp, dtype=self.kv_dtype), torch.zeros(shp, dtype=self.kv_dtype)
        idx = torch.tensor(pg, device=self.q.device)
        if self.layout == "NHD":
            k = self.k_cache[idx].reshape(-1, self.hkv, self.d)[:n]
            v = self.v_cache[idx].reshape(-1, self.hkv, self.d)[:n]
        else:
            k = self.k_cache[idx].transpose(1, 2).reshape(-1, self.hkv, self.d)[:n]
            v = self.v_cache[idx].transpose(1, 2).reshape(-1, self.hkv, self.d)[:n]
        return k.cpu(), v.cpu()

    def check(self, out, lse):
        """Every request against the fp64 golden (``contract.assert_batch``: the tolerance rule on
        outputs and LSE, no unwritten element, empty requests exactly 0 / -inf)."""
        ql, reqs, masks = self.q_len, [], []
        for i, n in enumerate(self.kv_lens):
            k, v = self.request_kv(i)
            reqs.append((self.q[i * ql:(i + 1) * ql], k, v))
            spec = self.spec and n > 0  # draft rows: the spec mask over the last q_len keys (else causal)
            masks.append(torch.cat([torch.ones(ql, n - ql, dtype=torch.bool), self.mask_bool[i]], 1) if spec else None)
        assert_batch(reqs, out, lse, masks=masks, causal=True, window_left=self.window, sm_scale=self.sm_scale,
                     sinks=self.sinks_t, v_scale=self.bmm2, o_scale=self.o_scale)


# --------------------------------------------------------------------------------------- GPU tests
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_basic(dtype, group, layout):
    hkv = 4
    c = Case(B=4, hq=hkv * group, hkv=hkv, dtype=dtype, layout=layout, kv_lens=[1, 16, 333, 700], seed=group)
    c.run_checked()


@gpu
@pytest.mark.parametrize("ps", [1, 2, 4, 8, 32, 64, 128])
def test_gpu_page_sizes(ps):
    c = Case(ps=ps, hq=16, hkv=4, kv_lens=[ps, 3 * ps, 5 * ps + 1, 257], seed=ps, layout="HND" if ps % 2 else "NHD")
    c.run_checked()


@gpu
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_head_dims(d, dtype):
    c = Case(d=d, hq=16, hkv=2, dtype=dtype, kv_lens=[5, 64, 300], seed=d)
    c.run_checked()


@gpu
@pytest.mark.parametrize("q_len", [2, 4])
@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("group", [1, 8, 16])
def test_gpu_spec_decode(q_len, spec, group):
    c = Case(q_len=q_len, spec=spec, hq=2 * group, hkv=2, kv_lens=[q_len, 65, 400], seed=q_len * 10 + group)
    c.run_checked()


@gpu
def test_gpu_spec_mask_long_draft():
    c = Case(q_len=7, spec=True, hq=8, hkv=2, kv_lens=[7, 100], d=64, seed=7)
    c.run_checked()


@gpu
@pytest.mark.parametrize("window", [0, 5, 100])
@pytest.mark.parametrize("q_len", [1, 3])
def test_gpu_window(window, q_len):
    c = Case(window=window, q_len=q_len, hq=16, hkv=4, kv_lens=[q_len, 64, 130, 700], seed=window + q_len)
    c.run_checked()


@gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_sinks(q_len):
    c = Case(sinks=True, q_len=q_len, hq=64, hkv=8, kv_lens=[q_len, 50, 600], seed=31)
    c.run_checked()


@gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_sink_far_above_row_max_keeps_lse_finite(q_len):
    """A sink 128+ (base 2, ~88.7 nats) above every logit of its row: folded as ex2(sink - row max) it
    overflowed to inf (LSE +inf, output 0).  Half the heads get sinks of ~100 nats, the others the
    usual ones; a short batch (one CTA per row) and one long request (split KV: the merge folds the
    sink too).  Legal inputs without ALiBi: sinks are any float32, q.k * bmm1_scale is unbounded."""
    b = _backend()
    for kw in (dict(B=3, kv_lens=[q_len, 70, 600], seed=43), dict(B=1, kv_lens=[9000], seed=44)):
        c = Case(q_len=q_len, hq=16, hkv=2, lse=True, sinks=True, **kw)
        c.sinks_t[0::2] += 100.0
        out, lse, plan = c.run(b)
        if kw["B"] == 1:
            assert plan.num_splits > 1
        assert torch.isfinite(lse).all(), lse[~torch.isfinite(lse)][:4]
        c.check(out, lse)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("group", [4, 8])
def test_gpu_fp8_kv(dtype, kv_dtype, group):
    c = Case(dtype=dtype, kv_dtype=kv_dtype, hq=4 * group, hkv=4, q_len=1 if group == 4 else 2,
             kv_lens=[1, 77, 500], bmm1=0.7 / math.sqrt(128), bmm2=0.5, seed=group)
    c.run_checked()


@gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_fp8_kv_head_dims(d):
    c = Case(d=d, kv_dtype=torch.float8_e4m3fn, hq=8, hkv=2, kv_lens=[3, 200], layout="HND", seed=d)
    c.run_checked()


@gpu
@pytest.mark.parametrize("kv", ["fp8", "16bit"])
@pytest.mark.parametrize("case", ["window_sinks_lse", "split", "spec_draft", "page1_empty", "e5m2_fp16_hnd", "d64",
                                  "d256_mha"])
def test_gpu_swapped_kernel(case, kv):
    """The swapped-product kernel (<= 8 rows per kv head), fp8 or 16-bit KV, on every feature the main kernel
    serves: window, sinks, LSE, split-KV, spec-decode drafts, page size 1, empty requests, HND, e5m2, fp16,
    head dims 64 / 256, one row per kv head."""
    e4 = torch.float8_e4m3fn if kv == "fp8" else None  # None: the q dtype
    e5 = torch.float8_e5m2 if kv == "fp8" else None
    c = {"window_sinks_lse": lambda: Case(kv_dtype=e4, hq=32, hkv=8, window=100, sinks=True, lse=True,
                                          kv_lens=[1, 150, 900], seed=21),
         "split": lambda: Case(kv_dtype=e4, B=1, hq=64, hkv=8, kv_lens=[9000], lse=True, sinks=True, seed=22),
         "spec_draft": lambda: Case(kv_dtype=e4, hq=8, hkv=2, q_len=2, spec=True, lse=True, kv_lens=[2, 60, 700],
                                    seed=23),
         "page1_empty": lambda: Case(op="batch_decode", kv_dtype=e4, hq=6, hkv=2, q_len=1, ps=1, lse=True,
                                     kv_lens=[0, 3, 700], seed=24),
         "e5m2_fp16_hnd": lambda: Case(dtype=torch.float16, kv_dtype=e5, hq=8, hkv=8, layout="HND",
                                       bmm2=0.5, kv_lens=[5, 400], seed=25),
         "d64": lambda: Case(kv_dtype=e4, d=64, hq=16, hkv=4, lse=True, kv_lens=[33, 1000], seed=27),
         "d256_mha": lambda: Case(kv_dtype=e4, d=256, hq=4, hkv=4, kv_lens=[7, 300, 2000], seed=28)}[case]()
    b = _backend()
    b.swap_for_16bit = True
    out, lse, plan = c.run(b)
    assert plan.lib.key.swap and plan.lib.rows == 8
    if case == "split":
        assert plan.num_splits > 1
    c.check(out, lse)


@gpu
@pytest.mark.parametrize("case", ["q2_window_sinks_lse", "q4_spec", "split", "rows12", "rows40", "page1_empty",
                                  "e5m2_fp16_hnd", "slack", "fp8_out"])
def test_gpu_split_dims_kernel(case):
    """The split-dims kernel (fp8 KV, d128, 9-32 rows per CTA): window, sinks, LSE, spec-decode drafts, split-KV, a
    partly filled CTA, a second m-group, page size 1, empty requests, e5m2 / fp16 / HND, row maxima moving past the
    slack between tiles, fp8 output."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    c = {"q2_window_sinks_lse": lambda: Case(kv_dtype=e4, hq=64, hkv=8, q_len=2, window=100, sinks=True, lse=True,
                                             kv_lens=[2, 150, 900], seed=31),
         "q4_spec": lambda: Case(kv_dtype=e4, hq=64, hkv=8, q_len=4, spec=True, lse=True, kv_lens=[4, 61, 700],
                                 seed=32),
         "split": lambda: Case(kv_dtype=e4, B=1, hq=64, hkv=8, q_len=2, kv_lens=[9000], lse=True, sinks=True,
                               seed=33),
         "rows12": lambda: Case(kv_dtype=e4, hq=24, hkv=2, lse=True, kv_lens=[1, 64, 65, 1000], seed=34),
         "rows40": lambda: Case(kv_dtype=e4, hq=40, hkv=4, q_len=4, lse=True, kv_lens=[5, 300], seed=35),
         "page1_empty": lambda: Case(op="batch_decode", kv_dtype=e4, hq=32, hkv=2, ps=1, lse=True,
                                     kv_lens=[0, 3, 700], seed=36),
         "e5m2_fp16_hnd": lambda: Case(dtype=torch.float16, kv_dtype=e5, hq=32, hkv=4, q_len=2, layout="HND",
                                       bmm2=0.5, kv_lens=[5, 400], seed=37),
         "slack": lambda: Case(kv_dtype=e4, hq=64, hkv=8, q_len=2, bmm1=2.0, lse=True, kv_lens=[1, 40, 700, 3000],
                               seed=38),
         "fp8_out": lambda: Case(kv_dtype=e4, out_dtype=e4, bmm2=2.0, o_scale=0.5, hq=64, hkv=8, q_len=3,
                                 kv_lens=[1, 90, 400], seed=39)}[case]()
    out, lse, plan = c.run(_backend())
    assert plan.lib.key.sd and plan.lib.rows == (32 if case in ("q4_spec", "rows40", "fp8_out") else 16)
    if case == "split":
        assert plan.num_splits > 1
    c.check(out, lse)


@gpu
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("bmm1", [0.5, 2.0])
def test_gpu_row_max_slack(kv_dtype, bmm1):
    """Logits ~6-23x the usual spread: row maxima that grow between tiles by more than ac::kMaxSlack (O rescaled)
    and by less (the stale max kept, P up to 2^8), in the main kernel and the swapped fp8 one."""
    c = Case(kv_dtype=kv_dtype, hq=16, hkv=4, bmm1=bmm1, lse=True, kv_lens=[1, 40, 700, 3000], seed=26)
    c.run_checked()


@gpu
def test_gpu_fp8_output():
    c = Case(kv_dtype=torch.float8_e4m3fn, out_dtype=torch.float8_e4m3fn, bmm2=2.0, o_scale=0.5, hq=32, hkv=8,
             kv_lens=[1, 90, 400], seed=5)
    c.run_checked()


@gpu
def test_gpu_scales_and_lse():
    c = Case(bmm1=0.05, bmm2=1.7, o_scale=0.8, lse=True, sinks=True, hq=16, hkv=2, kv_lens=[1, 64, 129, 512],
             seed=9)
    c.run_checked()


@gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_split_kv(q_len):
    """One long request: the KV range is split across CTAs and merged by the last one; runs repeat
    (the arrival counters reset themselves)."""
    c = Case(B=1, q_len=q_len, hq=32, hkv=8, kv_lens=[9000], lse=True, sinks=True, seed=q_len)
    b = _backend()
    out, lse, plan = c.run(b)
    assert plan.num_splits > 1
    c.check(out, lse)
    for _ in range(3):
        out2, lse2, _ = c.run(b, plan)
        assert torch.equal(out2, out)
    # uneven lengths with splits, including an empty request
    c = Case(B=3, hq=8, hkv=2, kv_lens=[0, 5000, 37], lse=True, seed=3)
    out, lse, plan = c.run(b)
    assert plan.num_splits > 1
    c.check(out, lse)
    assert (out[0].float() == 0).all() and torch.isinf(lse[0]).all()


@gpu
def test_gpu_batch_decode_csr():
    c = Case(op="batch_decode", B=5, hq=32, hkv=8, kv_lens=[1, 16, 17, 320, 1000], lse=True, tuple_cache=True,
             seed=11)
    c.run_checked()
    c = Case(op="batch_decode", B=2, hq=8, hkv=8, kv_lens=[0, 40], lse=True, layout="HND", seed=12)
    c.run_checked()


@gpu
def test_gpu_noncontiguous_q_and_pdl():
    c = Case(q_noncontig=True, pdl=True, hq=32, hkv=8, kv_lens=[100, 2000], seed=13)
    c.run_checked()


@gpu
def test_gpu_out_preallocated_view():
    c = Case(hq=16, hkv=4, kv_lens=[10, 300], seed=14)
    b = _backend()
    plan = b.plan(c.problem, c.meta)
    big = torch.full((c.q.shape[0], c.hq, c.d * 2), float("nan"), dtype=c.dtype, device="cuda")
    out = big[:, :, :c.d]
    b.run(plan, c.args(out, None))
    torch.cuda.synchronize()
    c.check(out, None)
    assert torch.isnan(big[:, :, c.d:].float()).all()


@gpu
def test_gpu_cuda_graph_replay():
    c = Case(hq=32, hkv=8, kv_lens=[50, 6000], sinks=True, cuda_graph=True, seed=15)
    b = _backend()
    plan = b.plan(c.problem, c.meta)
    out, lse = c.new_out()
    args = c.args(out, lse)
    b.run(plan, args)
    torch.cuda.synchronize()
    eager = out.clone()
    out.fill_(float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            b.run(plan, args)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        out.fill_(float("nan"))
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    c.check(out, None)


@gpu
def test_gpu_large_group_rows():
    """64 query heads on 4 kv heads with 4 draft rows: 64 rows per kv head -> 2 m-groups of 32."""
    c = Case(hq=64, hkv=4, q_len=4, spec=True, kv_lens=[4, 200, 1500], seed=16)
    c.run_checked()


@gpu
def test_gpu_fp8_large_q_prescale():
    """bf16 q beyond fp16 range with fp8 KV: the CTA's power-of-two prescale keeps it finite."""
    c = Case(kv_dtype=torch.float8_e4m3fn, hq=16, hkv=4, kv_lens=[3, 300], bmm1=1e-6, seed=17)
    c.q = (c.q.float() * 3e5).to(torch.bfloat16)
    c.run_checked()


@gpu
@pytest.mark.parametrize("dtype,kv_dtype,d,mt_rows", [
    (torch.bfloat16, torch.float8_e4m3fn, 128, 8), (torch.float16, torch.float8_e4m3fn, 64, 32),
    (torch.bfloat16, torch.float8_e5m2, 128, 4), (torch.bfloat16, torch.bfloat16, 128, 32),
    (torch.bfloat16, torch.float8_e4m3fn, 128, 32), (torch.float16, torch.float8_e5m2, 128, 16)])
def test_gpu_sm80_code_path_via_ptx(tmp_path, dtype, kv_dtype, d, mt_rows):
    """The sm_80 code (software fp8 widening, no PDL instructions) run on this GPU: compiled to
    compute_80 PTX only, so the driver JIT-compiles it for the device with __CUDA_ARCH__ == 800.  The
    kernel is the one this GPU's plan picks: swapped (<= 8 rows), split-dims (fp8 at d128, 16 / 32 rows),
    main (the rest)."""
    import ctypes
    import subprocess

    from attncore.build import jit
    from attncore.backends.xqa import binding

    b = _backend()
    hkv = 2
    q_len = 2 if mt_rows == 32 else 1
    hq = hkv * mt_rows // q_len
    c = Case(dtype=dtype, kv_dtype=kv_dtype, d=d, hq=hq, hkv=hkv, q_len=q_len, kv_lens=[q_len, 100, 3000],
             sinks=True, seed=d + mt_rows)
    plan = b.plan(c.problem, c.meta)
    assert plan.lib.key.sd == (kv_dtype != dtype and d == 128 and mt_rows > 8)
    spec = plan.lib.key.spec()
    so = tmp_path / "xqa_ptx80.so"
    flags = list(jit.DEFAULT_FLAGS) + [f"-D{k}={v}" for k, v in spec.defines] + [f"-I{i}" for i in spec.include_dirs]
    cmd = [jit.find_nvcc()] + flags + ["-gencode", "arch=compute_80,code=compute_80", "-shared",
                                       spec.sources[0], "-o", str(so)]
    subprocess.run(cmd, check=True, capture_output=True)
    plan.lib = binding.wrap_library(plan.lib.key, ctypes.CDLL(str(so)), torch.cuda.current_device())
    out, lse = c.new_out()
    b.run(plan, c.args(out, lse))
    torch.cuda.synchronize()
    c.check(out, lse)


@gpu
@pytest.mark.parametrize("mt2", [True, False])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_gpu_fp8_policy_knobs(mt2, splits):
    """Both tilings of 32 fp8 rows (one 32-row CTA, two 16-row CTAs) and forced split counts."""
    b = _backend()
    b.mt2_for_fp8 = mt2
    b.split_override = splits
    c = Case(kv_dtype=torch.float8_e4m3fn, hq=16, hkv=2, q_len=4, spec=True, sinks=True, lse=True,
             kv_lens=[4, 333, 2500], seed=18)
    out, lse, plan = c.run(b)
    assert plan.m_groups == (1 if mt2 else 2)
    if splits:
        assert plan.num_splits == splits
    c.check(out, lse)


def test_own_buffer_grow_only():
    from attncore.backends.xqa import plan as xplan

    dev = torch.device("cpu")
    a = xplan.own_buffer("test", dev, 10)
    assert a.numel() >= 10 and a.dtype == torch.uint8 and (a == 0).all()
    b = xplan.own_buffer("test", dev, 5)
    assert b.data_ptr() == a.data_ptr()
    c = xplan.own_buffer("test", dev, a.numel() + 1)
    assert c.numel() > a.numel() and c.data_ptr() != a.data_ptr()
    assert any(t is a for t in xplan._POOLS[("test", None)])  # the old buffer stays alive


@gpu
def test_gpu_cuda_graph_replan_after_plan_dropped():
    """The API pattern: capture with plan A, drop A, re-plan B (new lengths) into the same index
    buffers, replay.  The split-KV workspace must outlive plan A (graph pools)."""
    import gc

    b = _backend()
    c = Case(B=2, hq=32, hkv=8, kv_lens=[40, 6000], sinks=True, cuda_graph=True, lse=True, seed=19)
    plan = b.plan(c.problem, c.meta)
    assert plan.num_splits > 1
    out, lse = c.new_out()
    args = c.args(out, lse)
    replay_graph = runner.capture_run(b, plan, args)
    del plan
    gc.collect()
    junk = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]  # reuse freed memory
    new_lens = [45, 3500]  # within the pages each request already has
    c.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    c.kv_lens = new_lens
    plan_b = b.plan(c.problem, c.meta)  # re-plan B (host work only; the graph keeps A's launch)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    replay_graph()
    torch.cuda.synchronize()
    del junk
    c.check(out, lse)
    replay = out.clone()
    out.fill_(float("nan"))
    b.run(plan_b, args)
    torch.cuda.synchronize()
    assert torch.equal(out, replay), "graph replay must equal an eager run of the re-planned plan"


def _block_table_reqs(q, cache, bt, lens):
    """assert_batch's requests of a one-call xqa batch: request i's q row and its K / V gathered through block
    table row i from a combined NHD cache ``[pages, 2, page_size, Hkv, D]``."""
    ps = cache.shape[2]
    kv = [cache[bt[i, :-(-n // ps)].long()].transpose(0, 1).reshape(2, -1, *cache.shape[3:])[:, :n]
          for i, n in enumerate(lens)]
    return [(q[i:i + 1], kv[i][0], kv[i][1]) for i in range(len(lens))]


@gpu
def test_gpu_one_call_cached_launch():
    """The one-call API's later calls of a signature take its cached launch (plan_cache.XQA_LAUNCHES): new cache
    contents, another cache of the same layout and new lengths in the same seq_lens buffer are all read; a bad
    length still raises naming the request."""
    import attncore
    from attncore.core import plan_cache

    torch.manual_seed(20)
    B, hq, hkv, d, ps, pages = 3, 16, 4, 128, 16, 8
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)
    ws = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    seq = torch.tensor([100, 1, 128], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def cache():
        return torch.randn(B * pages, 2, ps, hkv, d, device="cuda", dtype=torch.bfloat16)

    def call_and_check(c, lens):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        attncore.xqa_batch_decode_with_kv_cache(q, c, ws, bt, seq, pages * ps, bmm1_scale=d ** -0.5, out=out,
                                                backend="xqa")
        assert_batch(_block_table_reqs(q, c, bt, lens), out, causal=True, sm_scale=d ** -0.5)

    c = cache()
    call_and_check(c, [100, 1, 128])
    hits = plan_cache.XQA_LAUNCHES.hits
    c.copy_(cache())
    call_and_check(c, [64, 128, 7])
    c2 = cache()
    call_and_check(c2, [1, 17, 90])
    assert plan_cache.XQA_LAUNCHES.hits == hits + 2
    with pytest.raises(ValueError, match=r"seq_lens: got seq_lens\[0\] = 129 \(request 0\)"):
        call_and_check(c2, [129, 5, 5])
    torch.cuda.synchronize()
    assert plan_cache.XQA_LAUNCHES.hits == hits + 3


@gpu
def test_gpu_one_call_tensor_scale_is_read_each_call():
    """A 1-element tensor bmm1_scale is read in every call (never part of a cached launch): a changed value changes
    the result."""
    import attncore
    from attncore.core import plan_cache

    torch.manual_seed(21)
    B, hq, hkv, d, ps, pages = 2, 8, 2, 128, 16, 4
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(B * pages, device="cuda", dtype=torch.int32).view(B, pages)
    ws = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    seq = torch.tensor([40, 64], dtype=torch.int32, device="cuda")
    c = torch.randn(B * pages, 2, ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([d ** -0.5], device="cuda")
    outs = []
    misses = plan_cache.XQA_LAUNCHES.misses
    for s in (d ** -0.5, 4 * d ** -0.5):
        scale.fill_(s)
        outs.append(attncore.xqa_batch_decode_with_kv_cache(q, c, ws, bt, seq, pages * ps, bmm1_scale=scale,
                                                            backend="xqa"))
        assert_batch(_block_table_reqs(q, c, bt, [40, 64]), outs[-1], causal=True, sm_scale=s)
    assert not torch.equal(outs[0], outs[1])
    assert plan_cache.XQA_LAUNCHES.misses == misses  # never looked up: no key for a tensor scale
