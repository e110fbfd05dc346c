"""The examples run (CPU smoke runs of what the README shows)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serving_loop_on_cpu():
    """examples/serving_loop.py, tiny: chunked prefill through BatchPOD, paged decode, layers under
    torch.compile; every generated token agrees with a dense causal re-run (fp32)."""
    # its RoPE runs through Triton's interpreter on the CPU, also on a machine with a GPU
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "serving_loop.py"), "--device", "cpu",
                        "--verify"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "tokens/s" in r.stdout and "agrees on 100.0% of generated tokens" in r.stdout, r.stdout
