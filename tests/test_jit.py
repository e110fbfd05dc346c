"""attncore.build.jit on the CPU machine: nvcc builds, cache layout, file-lock reuse across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attncore.build import jit

needs_nvcc = pytest.mark.skipif(jit.find_nvcc() is None, reason="nvcc not found")

DUMMY = textwrap.dedent("""
    #include <cuda_runtime.h>
    __global__ void fill(int* x) { x[threadIdx.x] = ANSWER; }
    extern "C" int dummy_answer() { return ANSWER; }
    extern "C" int dummy_launch(int* x, cudaStream_t s) { fill<<<1, 32, 0, s>>>(x); return (int)cudaGetLastError(); }
""")


@pytest.fixture
def dummy(tmp_path, monkeypatch):
    src = tmp_path / "src" / "dummy.cu"
    src.parent.mkdir()
    src.write_text(DUMMY)
    monkeypatch.setenv("ATTNCORE_CACHE_DIR", str(tmp_path / "cache"))
    return jit.Spec("dummy", "dummy_answer", (str(src),), defines=(("ANSWER", "42"),), description="dummy answer")


def test_uri_and_cache_layout(dummy, tmp_path):
    assert dummy.uri_for("90") == "dummy_answer_sm90"
    assert jit.cache_dir("90") == tmp_path / "cache" / jit._version() / "sm90"
    p = jit.library_path(dummy, "90")
    assert p.parent == jit.cache_dir("90") / "dummy_answer_sm90"
    assert p.name.startswith("dummy_answer_sm90.") and p.suffix == ".so"


def test_hash_changes_with_source_and_flags(dummy):
    p1 = jit.library_path(dummy, "90")
    other = jit.Spec("dummy", "dummy_answer", dummy.sources, defines=(("ANSWER", "43"),))
    assert jit.library_path(other, "90") != p1
    assert jit.library_path(dummy, "80").parent.parent.name == "sm80"


def test_cache_dir_default(monkeypatch):
    monkeypatch.delenv("ATTNCORE_CACHE_DIR", raising=False)
    assert jit.cache_root() == Path.home() / ".cache" / "attncore"


def test_missing_nvcc_is_a_reason(dummy, monkeypatch):
    monkeypatch.setenv("ATTNCORE_NVCC", "/nonexistent/nvcc")
    reasons = jit.toolchain_reasons()
    assert reasons and "nvcc" in str(reasons[0])
    with pytest.raises(jit.CompileError, match="nvcc"):
        jit.build_spec(dummy, "90")


@needs_nvcc
def test_build_load_and_reuse(dummy, capfd):
    lib = jit.load(dummy, arch="80")
    assert lib.dummy_answer() == 42
    err = capfd.readouterr().err
    assert "building dummy answer sm80 ..." in err
    r = jit.build_spec(dummy, "80")
    assert not r.built and r.seconds == 0.0 and r.path.exists()
    # an edited define is a new library, the old one is kept (never rewritten while mapped)
    other = jit.Spec("dummy", "dummy_answer", dummy.sources, defines=(("ANSWER", "7"),))
    r2 = jit.build_spec(other, "80")
    assert r2.built and r2.path != r.path and r.path.exists()


@needs_nvcc
def test_compile_error_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCORE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.cu"
    bad.write_text("__global__ void k() { this is not cuda; }\n")
    spec = jit.Spec("dummy", "bad", (str(bad),))
    with pytest.raises(jit.CompileError) as e:
        jit.compile_check([spec], archs=("80",))
    assert "bad_sm80" in str(e.value) and "error" in e.value.log


_CHILD = textwrap.dedent("""
    import os, sys, time
    from attncore.build import jit
    if len(sys.argv) > 2:  # wait for the go file (imports already done)
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.005)
    spec = jit.Spec("dummy", "dummy_answer", (sys.argv[1],), defines=(("ANSWER", "42"),), description="dummy answer")
    lib = jit.load(spec, arch="80")
    print("ANSWER", lib.dummy_answer(), flush=True)
""")


@needs_nvcc
def test_file_lock_two_processes_build_once(dummy, tmp_path):
    env = dict(os.environ, ATTNCORE_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    go = tmp_path / "go"
    cmd = [sys.executable, str(script), dummy.sources[0]]
    b = subprocess.Popen(cmd + [str(go)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    a = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = a.stderr.readline()  # A holds the lock once it says it is building
    assert "building dummy answer sm80" in line, line
    go.write_text("go")  # B asks for the same library while A is compiling
    out_b, err_b = b.communicate(timeout=300)
    out_a, err_a = a.communicate(timeout=300)
    b = subprocess.CompletedProcess(b.args, b.returncode, out_b, err_b)
    assert a.returncode == 0 and b.returncode == 0, (err_a, b.stderr)
    assert "ANSWER 42" in out_a and "ANSWER 42" in b.stdout
    assert not any(l.startswith("building") for l in b.stderr.splitlines())  # B never compiled
    assert "waiting for another process building dummy answer sm80" in b.stderr
    assert "reusing dummy answer sm80" in b.stderr
    libs = list((tmp_path / "cache").rglob("dummy_answer_sm80.*.so"))
    assert len(libs) == 1


def test_registry_lists_cuda_fa2_specs():
    specs = jit.list_specs("cuda_fa2", arch="90")
    uris = [s.uri_for("90") for s in specs]
    assert "cuda_fa2_prefill_bf16_d128_causal_sm90" in uris
    assert jit.list_specs("fa2", arch="90") == specs  # alias
    s = jit.parse_uri("cuda_fa2", "cuda_fa2_decode_fp16_kve4m3_d64_none_softcap_sm80")
    assert s.uri == "cuda_fa2_decode_fp16_kve4m3_d64_none_softcap"
    with pytest.raises(ValueError):
        jit.parse_uri("cuda_fa2", "cuda_fa2_prefill_bf16_d96_causal")
    with pytest.raises(ValueError):
        jit.list_specs("no_such_backend")
