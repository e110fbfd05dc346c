"""Every built-in backend runs the conformance suite (the GPU-only ones skip cleanly without a GPU)."""

import subprocess
import sys

import pytest
import torch


def _conformance(name, *args, timeout=1500):
    return subprocess.run([sys.executable, "-m", "attncore.cli", "conformance", name, "-q", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_reference_passes_on_cpu():
    r = _conformance("reference", "--attncore-device", "cpu")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout.splitlines()[-1]


def test_triton_passes_on_cpu_through_the_interpreter():
    r = _conformance("triton", "--attncore-device", "cpu", "--attncore-budget", "6")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout


def _counts(stdout):
    last = stdout.strip().splitlines()[-1]
    return {w: int(n) for n, w in (part.split()[:2] for part in last.split(" in ")[0].split(", "))}


def test_shards_partition_the_suite():
    whole = _counts(_conformance("reference", "--attncore-device", "cpu").stdout)
    parts = [_counts(_conformance("reference", "--attncore-device", "cpu", "--attncore-shard", f"{i}/3").stdout)
             for i in range(3)]
    assert sum(p.get("passed", 0) for p in parts) == whole["passed"]
    assert all(p["passed"] > 0 for p in parts)
    r = _conformance("reference", "--attncore-shard", "3/3")
    assert r.returncode != 0 and "expected I/N with 0 <= I < N" in r.stderr


@pytest.mark.parametrize("name", ["cuda_fa2", "xqa"])
def test_cuda_backends_skip_cleanly_without_a_gpu(name):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu-marked test below runs the suite")
    r = _conformance(name, "-rs")
    assert r.returncode == 0, r.stdout[-3000:]
    assert f"{name} claims devices ['cuda']; none is present here" in r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cuda_fa2", "xqa", "triton", "sdpa"])
def test_gpu_backends_pass_on_cuda(name):
    r = _conformance(name, "--attncore-device", "cuda", "--attncore-budget", "4")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
