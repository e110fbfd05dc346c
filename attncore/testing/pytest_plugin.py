"""pytest plugin of the attncore conformance suite (entry point ``pytest11: attncore``).

Harmless unless used: it only adds options, and generates cases only for tests that request the
``attncore_case`` fixture (``attncore.testing.test_conformance``) when ``--attncore-backend`` is
given::

    pytest --pyargs attncore.testing.test_conformance --attncore-backend reference
    pytest --pyargs attncore.testing.test_conformance --attncore-backend mypkg.backend:MyBackend

``NAME`` is a registered backend name (entry point or ``register_backend``) or
``module:attribute`` naming a ``Backend`` instance, class or factory (handy before packaging).
"""

from __future__ import annotations

import re

import pytest

FAMILY_OF_TEST = {
    "test_numerics": "numerics",
    "test_nonfinite": "nonfinite",
    "test_refusal": "refusal",
    "test_lse_merge": "merge",
    "test_cuda_graph": "cuda_graph",
    "test_pod": "pod",
    "test_suite_status": "status",
}


def pytest_addoption(parser):
    group = parser.getgroup("attncore", "attncore backend conformance suite")
    group.addoption("--attncore-backend", action="store", default=None, metavar="NAME",
                    help="backend to check (registered name, or module:attr of a Backend)")
    group.addoption("--attncore-full", action="store_true", default=False,
                    help="many more random cases and every claimed head dim / group / page size")
    group.addoption("--attncore-budget", action="store", type=int, default=None, metavar="N",
                    help="random multi-axis cases per op (default 10, 60 with --attncore-full)")
    group.addoption("--attncore-seed", action="store", type=int, default=0, metavar="S",
                    help="seed of case sampling and inputs (default 0)")
    group.addoption("--attncore-device", action="store", default=None, metavar="DEVICE",
                    help="cpu, cuda or cuda:N (default: cuda when available and claimed, else cpu)")
    group.addoption("--attncore-stream", action="store", default="default", choices=("default", "side"),
                    help="side: run each case on a fresh stream of its device, the current device left "
                         "alone (a backend must launch on the tensors' device and its current stream)")
    group.addoption("--attncore-shard", action="store", default=None, metavar="I/N",
                    help="run only every N-th case starting at I (0 <= I < N): N processes with "
                         "I = 0..N-1 share one suite, e.g. to compile kernels on several cores")


def _shard(config):
    text = config.getoption("--attncore-shard", default=None)
    if not text:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise pytest.UsageError(f"--attncore-shard {text}: expected I/N with 0 <= I < N, e.g. 0/4")
    return int(m.group(1)), int(m.group(2))


def pytest_configure(config):
    _shard(config)
    device = config.getoption("--attncore-device", default=None)
    if device:
        from attncore.testing.placement import parse_device

        try:
            parse_device(device)
        except ValueError as e:
            raise pytest.UsageError(f"--attncore-device {e}") from None
    if config.getoption("--attncore-backend", default=None):
        _cases(config)  # an unknown backend is a usage error, reported before collection


def pytest_collection_modifyitems(config, items):
    shard = _shard(config)
    if shard is None:
        return
    i, n = shard
    # Collection order is deterministic (cases come from seeds), so the N shards partition the suite.
    keep = [it for k, it in enumerate(items) if k % n == i]
    drop = [it for k, it in enumerate(items) if k % n != i]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Each computed case runs placed on its device and the chosen stream (``placement.placed``)."""
    case = getattr(item, "funcargs", {}).get("attncore_case")
    if case is None or case.problem is None:
        return (yield)
    from attncore.testing.placement import placed

    with placed(case.device, item.config.getoption("--attncore-stream", default="default")):
        return (yield)


def _cases(config):
    cached = getattr(config, "_attncore_cases", None)
    if cached is not None:
        return cached
    from attncore.testing import resolve_backend
    from attncore.testing.cases import generate

    name = config.getoption("--attncore-backend")
    try:
        backend, unavailable = resolve_backend(name)
    except Exception as e:
        raise pytest.UsageError(f"--attncore-backend {name}: {e}") from e
    fams = generate(backend, device=config.getoption("--attncore-device"), full=config.getoption("--attncore-full"),
                    budget=config.getoption("--attncore-budget"), seed=config.getoption("--attncore-seed"),
                    unavailable=unavailable)
    config._attncore_cases = (backend, fams)
    return config._attncore_cases


def _param(case, backend):
    marks = []
    for sub, reason in (getattr(backend, "known_failures", None) or {}).items():
        if sub in case.id:
            marks.append(pytest.mark.xfail(reason=f"known failure: {reason}", strict=False))
            break
    return pytest.param(case, id=case.id, marks=marks)


def pytest_generate_tests(metafunc):
    if "attncore_case" not in metafunc.fixturenames:
        return
    family = FAMILY_OF_TEST.get(metafunc.function.__name__)
    if metafunc.config.getoption("--attncore-backend", default=None) is None:
        metafunc.parametrize("attncore_case", [pytest.param(
            None, id="no-backend", marks=pytest.mark.skip(reason="pass --attncore-backend NAME to run the suite"))])
        return
    backend, fams = _cases(metafunc.config)
    from attncore.testing.cases import COMPUTED_FAMILIES

    if family == "status":
        cases = fams.get("skip", []) + fams.get("fail", [])
        if not cases:
            n = sum(len(v) for k, v in fams.items() if k in COMPUTED_FAMILIES)
            from attncore.testing.cases import Case

            cases = [Case("ok", f"{backend.name}-collected-{n}", backend, note=f"{n} computed cases")]
    else:
        cases = fams.get(family, [])
    if not cases:
        why = f"{backend.name} claims nothing this family tests"
        if fams.get("skip") and family in COMPUTED_FAMILIES:
            why = fams["skip"][0].note
        metafunc.parametrize("attncore_case", [pytest.param(
            None, id=f"{backend.name}-none", marks=pytest.mark.skip(reason=why))])
        return
    metafunc.parametrize("attncore_case", [_param(c, backend) for c in cases])


def pytest_report_header(config):
    name = config.getoption("--attncore-backend", default=None)
    if not name:
        return None
    try:
        backend, fams = _cases(config)
    except pytest.UsageError:
        return None
    from attncore.testing.cases import pick_device

    dev, why = pick_device(backend, config.getoption("--attncore-device"))
    counts = ", ".join(f"{k} {len(v)}" for k, v in fams.items() if v)
    origin = getattr(backend, "origin", "?")
    return f"attncore conformance: backend {backend.name} ({origin}) on {dev} [{why}]: {counts}"
