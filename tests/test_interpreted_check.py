"""attncore.kernels.check_interpreted: the one check (rope, MLA, the triton backend) that a Triton kernel
decorated interpreted runs on CPU tensors only and a compiled one on CUDA tensors only."""

import pytest
import torch

from attncore.kernels import check_interpreted, interpreted


class InterpretedFunction:  # the class name is what Triton's interpreter gives its decorated functions
    pass


class JITFunction:
    pass


def test_interpreted_kernel_on_cpu_and_compiled_on_cuda_pass():
    assert interpreted(InterpretedFunction()) and not interpreted(JITFunction())
    assert check_interpreted(InterpretedFunction(), torch.device("cpu"), "who", "hint") is True
    assert check_interpreted(JITFunction(), torch.device("cuda", 0), "who", "hint") is False


def test_mismatch_names_the_caller_the_state_the_device_and_the_remedy(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match=r"^attncore.rope: the Triton kernel was interpreted at import "
                       r"\(TRITON_INTERPRET='1' then\) but the tensors are on cuda:0; unset it$"):
        check_interpreted(InterpretedFunction(), torch.device("cuda", 0), "attncore.rope", "unset it")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match=r"^triton backend: kernels were compiled at import "
                       r"\(TRITON_INTERPRET=None then\) but the tensors are on cpu; set it$"):
        check_interpreted(JITFunction(), torch.device("cpu"), "triton backend", "set it", subject="kernels were")
