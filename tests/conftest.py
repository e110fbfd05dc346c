import os

import pytest
import torch

# Triton's CPU interpreter must be chosen before triton decorates any kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# auto ranks by the rule table in tests: a tune table in the developer's cache must not change choices
# (tests of measured selection set their own cache and turn it back on)
os.environ.setdefault("ATTNCORE_TUNE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def clean_registry(monkeypatch):
    """A registry re-read from entry points and the environment, restored afterwards."""
    from attncore.core import registry

    registry.reload()
    yield registry
    for name in list(registry._manual):
        registry.unregister_backend(name)
    registry.reload()


@pytest.fixture
def cpu_backend(request):
    """For a test of CPU tensors parametrized by ``backend``: its triton case runs through Triton's
    interpreter, so it is skipped where TRITON_INTERPRET is unset (a GPU run)."""
    from attncore.kernels import interpreting

    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "triton" and not interpreting():
        pytest.skip("CPU tensors through Triton's interpreter, which TRITON_INTERPRET (unset here) selects")


@pytest.fixture
def triton_pod(request):
    """The registered Triton backend, fusing every batch (the cost model is the GPU's).  A test not marked
    gpu runs CPU tensors through Triton's interpreter: skipped where TRITON_INTERPRET is unset (a GPU run)."""
    from attncore.core import registry
    from attncore.kernels import interpreting

    if request.node.get_closest_marker("gpu") is None and not interpreting():
        pytest.skip("CPU tensors through Triton's interpreter, which TRITON_INTERPRET (unset here) selects; "
                    "the gpu-marked cases run on CUDA")

    entry = registry.entries().get("triton")
    if entry is None or entry.unavailable_reasons():
        pytest.skip("triton backend unavailable")
    b = entry.backend
    if not hasattr(b, "pod_fuse"):
        pytest.skip("the triton backend registered has no fused POD op")
    old = b.pod_fuse
    b.pod_fuse = "always"
    yield b
    b.pod_fuse = old
