"""The conformance suite any backend runs::

    pytest --pyargs attncore.testing.test_conformance --attncore-backend NAME [-k PATTERN] [--attncore-full]
    attncore conformance NAME [pytest args]

Cases come from the backend's declared capabilities (``attncore.testing.cases``); what each family
checks is in ``attncore.testing.runner`` and ``docs/writing-a-backend.md``.
"""

import pytest

from attncore.testing import runner


def test_numerics(attncore_case):
    """Output (and base-2 LSE) vs the fp64 golden, on NaN-poisoned outputs, inputs untouched."""
    runner.run_numerics(attncore_case)


def test_nonfinite(attncore_case):
    """NaN in one query row gives NaN there only; NaN in keys that no row may see changes nothing."""
    runner.run_nonfinite(attncore_case)


def test_refusal(attncore_case):
    """A problem just outside the claim is refused with ``Reason``s (and by the selector)."""
    runner.run_refusal(attncore_case)


def test_lse_merge(attncore_case):
    """Two halves of the keys, merged through their LSE, equal attention over all keys."""
    runner.run_merge(attncore_case)


def test_cuda_graph(attncore_case):
    """run() captured in a CUDA graph and replayed on new inputs equals eager run()."""
    runner.run_cuda_graph(attncore_case)


def test_pod(attncore_case):
    """A fused POD op: both parts in one run, each checked as its own op is (outputs, both LSEs)."""
    runner.run_pod(attncore_case)


def test_suite_status(attncore_case):
    """Fails when the backend gives the suite nothing to compute; shows skipped families."""
    c = attncore_case
    if c.family == "fail":
        pytest.fail(c.note, pytrace=False)
    if c.family == "skip":
        pytest.skip(c.note)
