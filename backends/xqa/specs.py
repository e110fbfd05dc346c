"""xqa specializations: one shared library per (q dtype, kv dtype, out dtype, head dim, rows per CTA).

URI grammar (``attncore build xqa <uri>``; ``_sm<arch>`` is appended per GPU arch)::

    xqa_decode_<fp16|bf16>[_kv<e4m3|e5m2>][_oute4m3]_d<64|128|256>_mt<1|2>[_sw|_sd][_t<option><value>...]

``mt1`` packs up to 16 rows (GQA heads x draft tokens of one kv head) into one CTA, ``mt2`` up to
32 (d64/d128 only: d256 with 32 rows would spill).  ``_sw`` (``mt1``): the swapped-product kernel, 8 rows
per CTA, keys as the MMA's M (``csrc/xqa_swap.cuh``).  ``_sd`` (fp8 KV, d128): the split-dims kernel, 16 per ``mt``
rows per CTA, the warps splitting O's dims (``csrc/xqa_splitd.cuh``).  Everything else (page size,
NHD/HND, window, sinks, spec-decode mask, causal draft, LSE, scales, split-KV, PDL) is a run-time
parameter.

``_t`` carries tuning options (``XqaKey.tune``; tuning runs, ``backends/xqa/bench/xqa_tune.py``), each a name
and a number: ``kpw`` keys per warp per tile (16 or 32), ``st`` cp.async ring depth, ``mb`` CTAs per
SM the register budget is sized for, ``l2`` the cp.async L2 prefetch hint in bytes (0, 64, 128,
256), ``ms`` the softmax's max slack (attncore/ptx.cuh's kMaxSlack; 0: the max moves on every increase),
``dg`` diagnostics (1: stream the KV without computing, 2: compute without loading; wrong results, timing
only).  Without ``_t`` the kernel's defaults apply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from attncore.build import jit

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = str(CSRC / "xqa_decode.cu")
INCLUDE_DIRS = (str(CSRC), jit.INCLUDE_DIR)

DTYPES = {"fp16": 0, "bf16": 1}
KVS = {"same": 0, "e4m3": 1, "e5m2": 2}
OUTS = {"same": 0, "e4m3": 1}
HEAD_DIMS = (64, 128, 256)
TUNE = {"kpw": "XQA_KPW", "st": "XQA_STAGES", "mb": "XQA_MINB", "dg": "XQA_DIAG", "l2": "XQA_L2", "ms": "AC_MAX_SLACK"}


@dataclass(frozen=True)
class XqaKey:
    dtype: str = "bf16"
    kv: str = "same"
    out: str = "same"
    head_dim: int = 128
    mt: int = 1
    tune: Tuple[Tuple[str, int], ...] = ()  # ((option, value), ...), options in TUNE
    swap: bool = False  # the swapped-product kernel (8 rows per CTA)
    sd: bool = False  # the split-dims kernel (fp8 KV, d128)

    @property
    def uri(self) -> str:
        parts = ["xqa_decode", self.dtype]
        if self.kv != "same":
            parts.append("kv" + self.kv)
        if self.out != "same":
            parts.append("out" + self.out)
        parts += [f"d{self.head_dim}", f"mt{self.mt}"]
        if self.swap:
            parts.append("sw")
        if self.sd:
            parts.append("sd")
        if self.tune:
            parts.append("t" + "".join(f"{k}{int(v)}" for k, v in self.tune))
        return "_".join(parts)

    def spec(self) -> jit.Spec:
        if self.dtype not in DTYPES or self.kv not in KVS or self.out not in OUTS or self.head_dim not in HEAD_DIMS \
                or self.mt not in (1, 2):
            raise ValueError(f"invalid xqa specialization {self}")
        if self.out != "same" and self.kv == "same":
            raise ValueError("xqa: fp8 output needs an fp8 KV cache")
        if self.head_dim == 256 and self.mt != 1:
            raise ValueError("xqa: head_dim 256 uses mt1 only")
        if self.swap and self.mt != 1:
            raise ValueError("xqa: the swapped-product kernel (_sw) serves mt1 only (8 rows per CTA)")
        if self.sd and (self.swap or self.kv == "same" or self.head_dim != 128):
            raise ValueError("xqa: the split-dims kernel (_sd) serves fp8 KV at head_dim 128, without _sw")
        for k, v in self.tune:
            if k not in TUNE or int(v) < 0:
                raise ValueError(f"xqa: unknown tuning option {k}={v} (options: {', '.join(TUNE)})")
        defines = (
            ("XQA_DTYPE", str(DTYPES[self.dtype])), ("XQA_KV", str(KVS[self.kv])), ("XQA_OUT", str(OUTS[self.out])),
            ("XQA_HEAD_DIM", str(self.head_dim)), ("XQA_MT", str(self.mt)),
        ) + ((("XQA_SWAP", "1"),) if self.swap else ()) + ((("XQA_SD", "1"),) if self.sd else ()) \
            + tuple((TUNE[k], str(int(v))) for k, v in self.tune)
        return jit.Spec("xqa", self.uri, (SOURCE,), defines=defines, include_dirs=INCLUDE_DIRS,
                        description=self.uri.replace("_", " "))


_OPTS = "|".join(TUNE)
_URI_RE = re.compile(r"^xqa_decode_(fp16|bf16)(?:_kv(e4m3|e5m2))?(?:_out(e4m3))?_d(\d+)_mt([12])(_sw|_sd)?"
                     rf"(?:_t((?:(?:{_OPTS})\d+)+))?(?:_sm\d+)?$")


def parse(uri: str) -> jit.Spec:
    m = _URI_RE.match(uri)
    if not m:
        raise ValueError(f"not an xqa specialization URI: {uri!r} (grammar: {__doc__.split('::')[1].strip()})")
    dt, kv, out, d, mt, kern, tune = m.groups()
    opts = tuple((k, int(v)) for k, v in re.findall(rf"({_OPTS})(\d+)", tune or ""))
    return XqaKey(dt, kv or "same", out or "same", int(d), int(mt), opts, kern == "_sw", kern == "_sd").spec()


def default_keys() -> List[XqaKey]:
    """What ``attncore build xqa`` prebuilds: the common serving set (bf16/fp16, d128, both tiles and the swapped
    kernel, 16-bit and e4m3 KV, e4m3's 16- and 32-row CTAs on the split-dims kernel; the two-stage 16-bit kernels of
    a decode on a share of the SMs, XqaBackend.plan_for_sms)."""
    keys = []
    for dt in ("bf16", "fp16"):
        for kv in ("same", "e4m3"):
            for mt in (1, 2):
                keys.append(XqaKey(dt, kv, "same", 128, mt, sd=kv != "same"))
            keys.append(XqaKey(dt, kv, "same", 128, 1, swap=True))
        for sw in (False, True):
            keys.append(XqaKey(dt, "same", "same", 128, 1, (("st", 2),), swap=sw))
    return keys


def representative_keys() -> List[XqaKey]:
    """A small set covering every code path (16-bit and fp8 KV, both tiles, 16 and 32 keys per warp, fp8
    output, d64 / d128 / d256, the swapped kernel on fp8 and 16-bit KV, the split-dims kernel), for the CPU compile
    check."""
    return [XqaKey("bf16", "same", "same", 128, 1), XqaKey("bf16", "e4m3", "same", 128, 1),  # 32 keys per warp
            XqaKey("bf16", "e4m3", "same", 128, 2), XqaKey("fp16", "e4m3", "e4m3", 256, 1),
            XqaKey("fp16", "e5m2", "same", 64, 2), XqaKey("bf16", "e4m3", "same", 128, 1, swap=True),
            XqaKey("fp16", "e5m2", "e4m3", 256, 1, swap=True), XqaKey("bf16", "same", "same", 128, 1, swap=True),
            XqaKey("fp16", "same", "same", 64, 1, swap=True), XqaKey("bf16", "e4m3", "same", 128, 2, sd=True),
            XqaKey("fp16", "e5m2", "e4m3", 128, 1, sd=True)]


def list_specs(arch: str) -> List[jit.Spec]:
    return [k.spec() for k in default_keys()]

