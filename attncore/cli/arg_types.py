"""The ``attncore`` command's argument converters (argparse ``type=``): each turns one option's text into
its value or raises ``argparse.ArgumentTypeError`` saying what is expected, so a bad argument is a
one-line usage error (exit 2), never a traceback."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return x


def _int_pair(text: str, sep: str, expected: str) -> tuple:
    try:
        a, b = (int(x) for x in text.split(sep))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    return a, b


def heads(text: str) -> tuple:
    return _int_pair(text, "/", "Hq/Hkv (query heads / KV heads, e.g. 32/8; 32/32 without GQA)")


def cc(text: str) -> tuple:
    return _int_pair(text, ".", "MAJOR.MINOR, e.g. 9.0")


def device_name(text: str) -> str:
    from attncore.testing.placement import parse_device

    try:
        return parse_device(text, present=False)  # presence: main._runnable_device, a usage error naming the GPUs
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def window(text: str) -> int:
    from attncore.core.params import window_left

    try:
        return window_left(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected -1 (off) or an int >= 0, got {text!r}") from None


def dtype(kind: str):
    """A converter for dtype names, accepting those the API accepts for ``kind`` (q or kv)."""

    def convert(text: str):
        from attncore.core.checks import _DTYPE_ALIASES, ACCEPTED_Q_DTYPES, SUPPORTED_KV_DTYPES

        allowed = ACCEPTED_Q_DTYPES if kind == "q" else SUPPORTED_KV_DTYPES
        dtype = _DTYPE_ALIASES.get(text.replace("torch.", ""))
        if dtype not in allowed:
            names = ", ".join(n for n, d in _DTYPE_ALIASES.items() if d in allowed)
            raise argparse.ArgumentTypeError(f"expected one of {names}; got {text!r}")
        return dtype

    convert.__name__ = f"{kind} dtype"
    return convert


def workload(text: str) -> str:
    from attncore.cli.bench import select_workloads
    from attncore.cli.bench_pod import POD_WORKLOADS

    if text in {w.id for w in POD_WORKLOADS}:  # PD1, PD2: attncore/cli/bench_pod.py
        return text
    try:
        select_workloads([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def arch(text: str) -> str:
    from attncore.build.jit import default_arch

    arch = default_arch(text)
    if not arch.isdigit():
        raise argparse.ArgumentTypeError(f"expected an SM arch such as 90, sm90 or sm_90, got {text!r}")
    return arch
