"""prefill90's clock64 timeline (csrc/fa2_sm90_trace.cuh, backends/cuda_fa2/scripts/sm90_trace.py): the traced
build compiles and exports its dump, the default build carries none of it, and the summary's phase arithmetic."""

import importlib.util
import os
import sys

import pytest

from attncore.build import jit
from attncore.backends.cuda_fa2 import specs

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "backends", "cuda_fa2", "scripts", "sm90_trace.py")


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("sm90_trace", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m
    spec.loader.exec_module(m)
    yield m
    sys.modules.pop(spec.name, None)


def _stamps(mod, tiles: int, phases_at) -> list:
    """Stamps of CTA slot 0 for every role: tile t's phase p at 1000 * t + phases_at[role][p]."""
    out = [0] * (mod.SLOTS * mod.ROLES * mod.TILES * mod.PHASES)
    for role in range(mod.ROLES):
        for t in range(tiles):
            for p, off in phases_at[role].items():
                out[((0 * mod.ROLES + role) * mod.TILES + t) * mod.PHASES + p] = 1000 * t + off + 1
    return out


def test_summary_phase_medians(mod):
    producer = {0: 0, 1: 300, 2: 700}
    plain = {0: 0, 1: 20, 2: 220, 3: 620, 4: 700, 5: 900}
    pipe = {0: 0, 1: 10, 7: 40, 6: 240, 2: 260, 3: 760, 5: 770, 4: 800}
    lines = mod.summary(_stamps(mod, 12, [producer, plain, pipe]), "W")
    prod, c0, c1 = (next(ln for ln in lines if f"CTA 0 {name}" in ln)
                    for name in ("producer", "consumer 0", "consumer 1"))
    assert "period  1000" in prod and "wait empty 300, issue 400" in prod
    assert "wait full 20, S 200, softmax 400, rescale+pack 80, P V 200" in c0
    assert "turn 30, issue 200, S wait 20, softmax 500, P V wait 10, pack 30" in c1
    assert any("CTA 1: 0 tiles traced" in ln for ln in lines)


@pytest.mark.skipif(jit.find_nvcc() is None, reason="nvcc not found")
def test_traced_build_compiles_and_the_default_has_no_trace(monkeypatch):
    key = specs.Fa2Key("prefill90", "bf16", "same", 128, "causal", pipe=True, ws=True)
    monkeypatch.setenv("ATTNCORE_NVCC_FLAGS", "-DFA2_TRACE=1")
    traced = jit.compile_check([key.spec()], archs=("90",), ptxas_verbose=True)[0]
    monkeypatch.delenv("ATTNCORE_NVCC_FLAGS")
    plain = jit.compile_check([key.spec()], archs=("90",), ptxas_verbose=True)[0]
    # the trace buffer is a __device__ global of 4 x 3 x 256 x 12 stamps: ptxas counts its bytes in the traced build
    assert "294912 bytes gmem" in traced.log and " 0 bytes gmem" in plain.log, (traced.log, plain.log)
    assert "warning" not in traced.log and "warning" not in plain.log, plain.log
