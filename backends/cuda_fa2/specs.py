"""cuda_fa2 specializations: one shared library per (tile config, dtypes, head dim, mask, features).

URI grammar (``attncore build cuda_fa2 <uri>``; ``_sm<arch>`` is appended per GPU arch)::

    cuda_fa2_<prefill|prefill64|prefill90|pod90|decode>_<fp16|bf16>[_kv<e4m3|e5m2>]_d<64|128|256|192x128>
             _<none|causal|custom>[_softcap][_alibi][_rope][_pf][_pipe][_ws][_persist]

``prefill`` is the 128-row (64 for d256) Q tile with 4 warps along Q; ``prefill64`` the 64-row tile
(one m16 tile per warp), chosen for causal problems whose diagonal dominates (qo_len ~ kv_len);
``decode`` is the 16-row Q tile with 4 warps along KV (GQA rows packed), used when a request has
at most 16 packed rows.
``prefill90`` is the Hopper kernel (csrc/fa2_sm90.cuh: wgmma, 2 warpgroups x 64 rows, 128-key tiles, 192 at d64,
80 at d256 in two stages), built for sm_90a only; it serves 16-bit KV, d64/d128/d256, masks none/causal and no soft
cap / ALiBi / RoPE (plan() checks the rest: no window); and head dims qk / vo 192 / 128 (``_d192x128``, DeepSeek's
prefill shape: ``_ws`` only, as d256 in two stages with K and V on their own barriers, of 128-key tiles; the loop by
the same rule as d256's: pipelined for contiguous K/V, plain on the persistent grid for paged).
``pod90`` is prefill90's POD kernel (``fa2_sm90_pod_kernel``): the items of a prefill part (its mask, ``_pipe``
for contiguous K/V) and of a decode part (paged, the plain loop, causal, each item's K/V tiles shared between
the two consumer warpgroups) in one grid; always ``_ws``.
``_pipe`` (prefill90 and pod90): the software-pipelined loop (3 K/V stages, 2 at d256 with ``_ws``; S of the next
tile on the tensor cores while the softmax runs); with ``_ws`` its two consumer warpgroups take turns at the tensor cores
(ping-pong).  The rule (``CudaFa2Backend.sm90_pipe``): pipelined for contiguous K/V and for paged K/V at d128,
plain for paged K/V at d64 / d256 / d192x128.
``_ws`` (prefill90 and pod90): warp-specialized: a producer warpgroup (56 registers via ``setmaxnreg``) issues
every copy (Q, the K/V page gather) into a 3-stage ring handed over with mbarriers (d256: 2 stages, each K and
V tile on its own barriers), and the two consumer warpgroups (224 registers) only compute
(``CudaFa2Backend.sm90_ws``).  Without ``_pipe``, and with it at d64, the grid is persistent: one CTA per SM runs
(item, kv head) units one after the other, taking the next from a counter in the int workspace, the ring running on
across units.
``_persist`` (prefill90 ``_pipe_ws`` at d128): the pipelined loop on that persistent grid, in two stages with K and V
on their own barriers (the form measured; with three stages it was level on P1); the plan takes it for batches of
more than ``plan.PERSIST_UNITS`` units per SM on contiguous K/V (many short units: ragged 8 x 2k 4-6% faster on an
H200, BENCHMARKS.md 2ah); paged K/V keeps the one-unit grid.
``_pf`` (decode only) prefetches page ids a tile ahead into registers: chosen for page sizes <= 4,
where it measured 2.67 vs 1.96 TB/s on D1 at page 1 (H100), while it lost at page 16 (2.74 vs 2.86).
Everything else (paged/ragged, NHD/HND, window, sinks, LSE, scales, split-KV) is a run-time
parameter of the same library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from attncore.backends.cuda_fa2.dims import HEAD_DIMS, POD90_HEAD_DIMS, PREFILL90_HEAD_DIMS, PREFILL90_QK_VO
from attncore.build import jit
from attncore.core.problem import dims_name

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = str(CSRC / "fa2_attention.cu")
INCLUDE_DIRS = (str(CSRC), jit.INCLUDE_DIR)

DTYPES = {"fp16": 0, "bf16": 1}
KVS = {"same": 0, "e4m3": 1, "e5m2": 2}
MASKS = {"none": 0, "causal": 1, "custom": 2}
CONFIGS = {"prefill": 0, "decode": 1, "prefill64": 2, "prefill90": 3, "pod90": 4}
SM90_CONFIGS = ("prefill90", "pod90")  # built for sm_90a only


@dataclass(frozen=True)
class Fa2Key:
    config: str = "prefill"
    dtype: str = "bf16"
    kv: str = "same"
    head_dim: int = 128
    mask: str = "causal"
    softcap: bool = False
    alibi: bool = False
    rope: bool = False
    prefetch: bool = False  # decode: page ids fetched a tile ahead into registers (small pages)
    pipe: bool = False  # prefill90: software-pipelined main loop
    ws: bool = False  # prefill90: warp-specialized (producer warpgroup)
    persist: bool = False  # prefill90 _pipe_ws d128: on the persistent grid, two stages
    tune: Tuple[Tuple[str, str], ...] = ()  # tile-shape overrides (tuning experiments only)
    head_dim_vo: int = 0  # V's and the output's head dim where it differs from head_dim (PREFILL90_QK_VO); 0: the same

    @property
    def dims(self) -> str:
        return dims_name(self.head_dim, self.head_dim_vo or self.head_dim)

    @property
    def uri(self) -> str:
        parts = ["cuda_fa2", self.config, self.dtype]
        if self.kv != "same":
            parts.append("kv" + self.kv)
        parts += [self.dims, self.mask]
        for f in ("softcap", "alibi", "rope"):
            if getattr(self, f):
                parts.append(f)
        if self.prefetch:
            parts.append("pf")
        if self.pipe:
            parts.append("pipe")
        if self.ws:
            parts.append("ws")
        if self.persist:
            parts.append("persist")
        if self.tune:
            parts.append("t" + "".join(f"{k.lower().replace('fa2_', '')}{v}" for k, v in self.tune))
        return "_".join(parts)

    def spec(self) -> jit.Spec:
        pair = (self.head_dim, self.head_dim_vo)
        if self.config not in CONFIGS or self.dtype not in DTYPES or self.kv not in KVS or self.mask not in MASKS \
                or (self.head_dim not in HEAD_DIMS if not self.head_dim_vo else pair not in PREFILL90_QK_VO):
            raise ValueError(f"invalid cuda_fa2 specialization {self}")
        if self.head_dim_vo and not (self.config == "prefill90" and self.ws and not self.persist):
            raise ValueError(f"cuda_fa2: head dims {self.dims[1:]} are a prefill90 _ws build (no _persist): {self}")
        if self.alibi and self.rope:
            raise ValueError("cuda_fa2: alibi and rope are exclusive")
        if self.prefetch and self.config != "decode":
            raise ValueError("cuda_fa2: page-id prefetch (_pf) is a decode-tile option")
        if self.pipe and self.config not in SM90_CONFIGS:
            raise ValueError("cuda_fa2: the pipelined loop (_pipe) is a prefill90 / pod90 option")
        if self.ws and self.config not in SM90_CONFIGS:
            raise ValueError("cuda_fa2: warp specialization (_ws) is a prefill90 / pod90 option")
        if self.config == "pod90" and not self.ws:
            raise ValueError("cuda_fa2: pod90 is warp-specialized (_ws)")
        if self.persist and not (self.config == "prefill90" and self.pipe and self.ws and self.head_dim == 128):
            raise ValueError("cuda_fa2: _persist is a prefill90 _pipe_ws option at d128")
        dims = PREFILL90_HEAD_DIMS if self.config == "prefill90" else POD90_HEAD_DIMS
        if self.config in SM90_CONFIGS and (self.kv != "same" or self.mask == "custom" or self.softcap or self.alibi
                                            or self.rope or (self.head_dim not in dims and not self.head_dim_vo)):
            raise ValueError(f"cuda_fa2: {self.config} serves 16-bit KV, d{'/d'.join(map(str, dims))}, mask "
                             f"none/causal, no features: {self}")
        defines = (
            ("FA2_CONFIG", str(CONFIGS[self.config])), ("FA2_DTYPE", str(DTYPES[self.dtype])),
            ("FA2_KV", str(KVS[self.kv])), ("FA2_HEAD_DIM", str(self.head_dim)),
            ("FA2_MASK", str(MASKS[self.mask])), ("FA2_SOFTCAP", str(int(self.softcap))),
            ("FA2_ALIBI", str(int(self.alibi))), ("FA2_ROPE", str(int(self.rope))),
        ) + ((("FA2_HEAD_DIM_VO", str(self.head_dim_vo)),) if self.head_dim_vo else ()) \
            + ((("FA2_D_PF", "1"),) if self.prefetch else ()) + ((("FA2_H_PIPE", "1"),) if self.pipe else ()) \
            + ((("FA2_H_WS", "1"),) if self.ws else ()) \
            + ((("FA2_H_PERSIST", "1"), ("FA2_H_STAGES", "2")) if self.persist else ()) \
            + tuple(self.tune)
        return jit.Spec("cuda_fa2", self.uri, (SOURCE,), defines=defines, include_dirs=INCLUDE_DIRS,
                        description=self.uri.replace("_", " ").replace("cuda fa2", "cuda_fa2"),
                        arch_suffix="a" if self.config in SM90_CONFIGS else "")


_URI_RE = re.compile(
    r"^cuda_fa2_(prefill64|prefill90|pod90|prefill|decode)_(fp16|bf16)(?:_kv(e4m3|e5m2))?_d(\d+)(?:x(\d+))?"
    r"_(none|causal|custom)"
    r"((?:_softcap)?)((?:_alibi)?)((?:_rope)?)((?:_pf)?)((?:_pipe)?)((?:_ws)?)((?:_persist)?)(?:_sm\d+)?$")


def parse(uri: str) -> jit.Spec:
    m = _URI_RE.match(uri)
    if not m:
        raise ValueError(f"not a cuda_fa2 specialization URI: {uri!r} (grammar: {__doc__.split('::')[1].strip()})")
    cfg, dt, kv, d, dv, mask, sc, al, ro, pf, pi, ws, pe = m.groups()
    return Fa2Key(cfg, dt, kv or "same", int(d), mask, bool(sc), bool(al), bool(ro), bool(pf), bool(pi),
                  bool(ws), bool(pe), head_dim_vo=int(dv or 0)).spec()


def common_keys() -> List[Fa2Key]:
    """The set ``attncore build cuda_fa2`` prebuilds: 16-bit q/kv, every head dim, the masks and tile
    configs plan() picks without custom masks or features (decode is always the causal spec)."""
    keys = []
    for dt in ("bf16", "fp16"):
        for d in HEAD_DIMS:
            keys += [Fa2Key("prefill", dt, "same", d, "none"), Fa2Key("prefill", dt, "same", d, "causal"),
                     Fa2Key("decode", dt, "same", d, "causal"), Fa2Key("decode", dt, "same", d, "causal", prefetch=True)]
            if d != 256:
                keys.append(Fa2Key("prefill64", dt, "same", d, "causal"))
    return keys


def sm90_keys() -> List[Fa2Key]:
    """The Hopper (sm_90a) specializations auto uses: prefill90 (d64/d128/d256; _persist at d128; d192x128 _ws)
    and its POD kernel (d64/d128), both dtypes, masks none/causal."""
    return [Fa2Key("prefill90", dt, "same", d, m, pipe=pi, ws=ws) for dt in ("bf16", "fp16")
            for d in PREFILL90_HEAD_DIMS for m in ("none", "causal") for pi in (False, True) for ws in (False, True)] + \
        [Fa2Key("prefill90", dt, "same", 128, m, pipe=True, ws=True, persist=True) for dt in ("bf16", "fp16")
         for m in ("none", "causal")] + \
        [Fa2Key("pod90", dt, "same", d, m, pipe=pi, ws=True) for dt in ("bf16", "fp16") for d in POD90_HEAD_DIMS
         for m in ("none", "causal") for pi in (False, True)] + \
        [Fa2Key("prefill90", dt, "same", d, m, pipe=pi, ws=True, head_dim_vo=dv) for dt in ("bf16", "fp16")
         for d, dv in PREFILL90_QK_VO for m in ("none", "causal") for pi in (False, True)]


def selftest_spec() -> jit.Spec:
    """The wgmma primitive checks (csrc/fa2_sm90_selftest.cu), sm_90a only."""
    return jit.Spec("cuda_fa2", "cuda_fa2_sm90_selftest", (str(CSRC / "fa2_sm90_selftest.cu"),),
                    include_dirs=INCLUDE_DIRS, description="cuda_fa2 sm90 selftest", arch_suffix="a")


def list_specs(arch: str = "90") -> List[jit.Spec]:
    return [k.spec() for k in common_keys() + (sm90_keys() if str(arch) == "90" else [])]


def representative_keys() -> List[Fa2Key]:
    """A small set covering every code path, for the CPU compile check."""
    return [
        Fa2Key("prefill", "bf16", "same", 128, "causal"),
        Fa2Key("decode", "fp16", "same", 64, "none"),
        Fa2Key("prefill64", "bf16", "same", 64, "causal", rope=True),
        Fa2Key("prefill", "fp16", "e4m3", 256, "custom", softcap=True, alibi=True),
        Fa2Key("decode", "bf16", "e5m2", 128, "causal", rope=True, prefetch=True),
    ]

