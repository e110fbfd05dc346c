"""Measured selection: ``attncore tune`` writes a table per device into the cache, and auto ranks by
it where it has data for the problem's class (attncore.core.ranking, attncore.cli.tune)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import attncore
from attncore.cli import bench
from attncore.core import ranking
from attncore.core import registry
from attncore.core import selector
from attncore.core import tables
from attncore.cli import tune
from attncore.core.problem import AttentionProblem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_SRC = os.path.join(ROOT, "plugins", "attncore-sdpa")
if PLUGIN_SRC not in sys.path:
    sys.path.insert(0, PLUGIN_SRC)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "e4m3": torch.float8_e4m3fn}


@pytest.fixture
def cache(monkeypatch, tmp_path, clean_registry):
    """An empty cache directory, the sdpa plugin registered (as CI installs it), tables re-read."""
    d = tmp_path / "cache"
    monkeypatch.setenv("ATTNCORE_CACHE_DIR", str(d))
    monkeypatch.delenv("ATTNCORE_TUNE", raising=False)
    monkeypatch.delenv("ATTNCORE_BACKEND", raising=False)
    if "sdpa" not in registry.entries():
        from attncore_sdpa import SdpaBackend

        registry.register_backend(SdpaBackend(), origin="test")
    tables.reload()
    yield d
    tables.reload()


def problem_of(e, device="cpu", cc=None, hkv=2):
    q = DTYPES[e["q_dtype"]]
    return AttentionProblem(op=e["op"], device_type=device, compute_capability=cc, q_dtype=q,
                            kv_dtype=DTYPES[e["kv_dtype"]], out_dtype=q, num_qo_heads=e["group"] * hkv,
                            num_kv_heads=hkv, head_dim_qk=e["head_dim"], head_dim_vo=e["head_dim"],
                            page_size=e["page_size"], mask=e["mask"])


def entry(op="single_prefill", times=None, failed=None, page_size=None, len_bucket="kv1-256", batch_bucket="B1",
          **kw):
    e = dict(op=op, mask="causal", head_dim=64, group=2, q_dtype="fp16", kv_dtype="fp16", page_size=page_size,
             len_bucket=len_bucket, batch_bucket=batch_bucket, times_ms=times or {}, failed=failed or {})
    e.update(kw)
    return e


def write_table(path, entries, **meta):
    t = {"format": 1, "attncore": attncore.__version__, "device": "hand-made", "device_type": "cpu",
         "compute_capability": None, "date": "2026-11-24", "quick": True, "entries": entries, **meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(t))
    tables.reload()
    return path


def cpu_table(entries, **meta):
    return write_table(tables.cache_path(tables.cpu_name()), entries, **meta)


P = problem_of(entry())


def test_tune_quick_on_cpu_end_to_end(tmp_path, monkeypatch, cache):
    """`attncore tune --quick` runs on the CPU and writes the table; explain then ranks by it and
    auto picks the fastest measured candidate of every grid point."""
    env = dict(os.environ, ATTNCORE_CACHE_DIR=str(cache), TRITON_INTERPRET="1", PYTHONPATH=PLUGIN_SRC)
    env.pop("ATTNCORE_TUNE", None)
    j = tmp_path / "tune.json"
    r = subprocess.run([sys.executable, "-m", "attncore.cli", "tune", "--quick", "--device", "cpu", "--json", str(j)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    path = tables.cache_path(tables.cpu_name())
    assert path.exists() and f"table: {path}" in r.stdout
    table = json.loads(path.read_text())
    assert table == json.loads(j.read_text())
    assert table["device"] == tables.cpu_name() and table["quick"] and table["attncore"] == attncore.__version__
    assert {e["op"] for e in table["entries"]} == set(tune.TUNE_OPS)
    assert all(e["times_ms"].get("reference", 0) > 0 for e in table["entries"])  # the reference runs everywhere
    tables.reload()
    for e in table["entries"]:
        p = problem_of(e)
        ex = attncore.explain(p)
        assert ex.ranking == "measured", str(ex)
        candidates = [n for n, _ in ex.ranked]
        fastest = min(t for n, t in e["times_ms"].items() if n in candidates)
        # the fastest, or one within ranking.MEASURED_TIE of it (a tie, ordered by rule)
        assert e["times_ms"][ex.chosen] <= fastest * (1 + ranking.MEASURED_TIE), str(ex)
        assert selector.select(p).name == ex.chosen
    r = subprocess.run([sys.executable, "-m", "attncore.cli", "explain", "--op", "batch_decode", "--device", "cpu",
                        "--q-dtype", "float16", "--heads", "4/2", "--head-dim", "64"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "ranking: measured times, fastest first; from the cache table " + str(path) in r.stdout
    assert "(fastest)" in r.stdout and "kv1-256 B2-4 decode (B2 qo1 kv128): " in r.stdout


def test_a_hand_made_table_decides(cache):
    assert attncore.explain(P).chosen == "reference"  # by rule: the reference (0) above sdpa (-1) on CPU
    cpu_table([entry(times={"sdpa": 1.0, "reference": 2.0})])
    ex = attncore.explain(P)
    assert ex.chosen == "sdpa" and ex.ranking == "measured"
    assert selector.select(P).name == "sdpa"
    text = str(ex)
    assert "sdpa (priority -1): measured 1 ms (fastest)" in text
    assert "reference (priority 0): measured 2 ms (2.00x the fastest)" in text
    cpu_table([entry(times={"sdpa": 3.0, "reference": 2.0})])
    assert selector.select(P).name == "reference"


def test_entries_measured_on_another_gpu_say_so(cache):
    """An entry that names its own device (re-measured elsewhere and merged, as the shipped table's d256 prefill
    points) shows it in explain's evidence and in the table's description."""
    cpu_table([entry(times={"sdpa": 1.0, "reference": 2.0}, device="NVIDIA H200",
                     shape={"batch": 1, "qo": 16, "kv": 128})])
    text = str(attncore.explain(P))
    assert "(B1 qo16 kv128) on NVIDIA H200: 1 ms" in text
    assert "1 entries, 1 of them on NVIDIA H200)" in text


def test_measured_times_within_the_tie_go_by_rule(cache):
    """Times within ranking.MEASURED_TIE of the fastest are a tie, which the rule table orders (on the CPU the
    reference ranks 0, sdpa -1); beyond it the faster one wins; explain says which."""
    tie = 1 + ranking.MEASURED_TIE
    cpu_table([entry(times={"sdpa": 1.0, "reference": 0.99 * tie})])
    ex = attncore.explain(P)
    assert ex.chosen == "reference" and selector.select(P).name == "reference"
    assert "a tie, which the rule table orders" in str(ex)
    cpu_table([entry(times={"sdpa": 1.0, "reference": 1.01 * tie})])
    assert attncore.explain(P).chosen == "sdpa" and selector.select(P).name == "sdpa"


def test_unavailable_unknown_and_refusing_backends_in_the_table_are_skipped(cache):
    cpu_table([entry(times={"xqa": 0.001, "nosuch": 0.001, "cuda_fa2": 0.001, "sdpa": 2.0, "reference": 1.0}),
               entry("batch_decode", page_size=16, times={"sdpa": 0.001, "reference": 1.0})])
    ex = attncore.explain(P)
    assert ex.chosen == "reference"
    assert not {"xqa", "nosuch", "cuda_fa2"} & {n for n, _ in ex.ranked}
    d = problem_of(entry("batch_decode", page_size=16))
    ex = attncore.explain(d)
    assert "sdpa" in ex.refused and ex.chosen == "reference" and ex.ranking == "measured"


def test_unmeasured_candidates_follow_the_measured_ones_by_rule(cache):
    # sdpa measured in one of two buckets only: it is not ranked by time, but after the measured ones
    cpu_table([entry(times={"reference": 5.0, "sdpa": 0.1}),
               entry(times={"reference": 5.0}, failed={"sdpa": "error: boom"}, len_bucket="kv257-1024")])
    ex = attncore.explain(P)
    names = [n for n, _ in ex.ranked]
    assert ex.chosen == "reference" and names.index("reference") < names.index("sdpa")
    assert "measured in 1 of 2 deciding buckets (error: boom): after the measured ones, by rule sdpa/other" in str(ex)
    assert "geometric mean over the buckets" in str(ex)


def test_geometric_mean_over_buckets():
    m = ranking.Measured(tables.problem_class(P), None, [
        entry(times={"a": 1.0, "b": 4.0}), entry(times={"a": 16.0, "b": 5.0}, len_bucket="kv257-1024")])
    assert m.score("a") == pytest.approx(4.0) and m.score("b") == pytest.approx(20 ** 0.5)
    assert m.score("c") is None


def test_tune_off_and_env_order_still_rule(cache, monkeypatch):
    cpu_table([entry(times={"sdpa": 1.0, "reference": 2.0})])
    assert selector.select(P).name == "sdpa"
    monkeypatch.setenv("ATTNCORE_TUNE", "0")
    ex = attncore.explain(P)
    assert ex.chosen == "reference" and ex.ranking == "rules" and "ATTNCORE_TUNE=0" in str(ex)
    assert selector.select(P).name == "reference"  # the select cache follows the variable
    monkeypatch.delenv("ATTNCORE_TUNE")
    monkeypatch.setenv("ATTNCORE_BACKEND", "reference,sdpa")  # an explicit order beats measurements
    assert selector.select(P).name == "reference"


def test_problems_outside_the_measured_classes_use_the_rules(cache):
    cpu_table([entry(times={"sdpa": 1.0, "reference": 2.0})])
    for change in (dict(return_lse=True), dict(kv_layout="HND"), dict(mask="none"), dict(head_dim_qk=128,
                                                                                         head_dim_vo=128)):
        ex = attncore.explain(P.replace(**change))
        assert ex.ranking == "rules", change
    assert tables.problem_class(P.replace(cuda_graph=True)) == tables.problem_class(P)
    for change in (dict(return_lse=True), dict(sinks=True), dict(kv_layout="HND"), dict(mask="custom"),
                   dict(q_len_per_req=2), dict(out_dtype=torch.float32),
                   dict(window_left=8), dict(pos_encoding="ALIBI"), dict(soft_cap=True)):
        assert tables.problem_class(P.replace(**change)) is None, change


def test_head_dims_that_differ_are_a_class_of_their_own(cache):
    """A 192 / 128 problem has its class (``head_dim_vo`` in the entry); an entry without the field has equal head
    dims (tables written before it existed), so it never decides for the pair, nor a pair entry for equal dims.
    (The reference is the one candidate timed: the only backend that takes the pair on every CPU machine.)"""
    pair = P.replace(head_dim_qk=192, head_dim_vo=128)
    key = tables.problem_class(pair)
    assert key.head_dim == 192 and key.head_dim_vo == 128 and key.dims == "d192x128"
    assert "single_prefill causal d192x128 g2 fp16/fp16" == key.describe()
    assert tables.problem_class(P).head_dim_vo == 64 and tables.problem_class(P).dims == "d64"
    cpu_table([entry(head_dim=192, times={"reference": 2.0})])  # 192 / 192: not the pair
    ex = attncore.explain(pair)
    assert ex.ranking == "rules" and "nothing for single_prefill causal d192x128" in ex.source, ex.source
    cpu_table([entry(head_dim=192, head_dim_vo=128, times={"reference": 2.0})])
    ex = attncore.explain(pair)
    assert ex.ranking == "measured" and ex.chosen == "reference", str(ex)
    assert "reference (priority 0): measured 2 ms (fastest)" in str(ex)
    assert attncore.explain(P.replace(head_dim_qk=192, head_dim_vo=192)).ranking == "rules"


def test_an_unreadable_table_is_ignored(cache):
    path = tables.cache_path(tables.cpu_name())
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    tables.reload()
    ex = attncore.explain(P)
    assert ex.chosen == "reference" and ex.ranking == "rules" and "unreadable" in ex.source


def test_the_shipped_sm90_default_is_valid_and_measured_or_empty():
    """The default holds no numbers until `attncore tune` measures them on an sm90 GPU (none
    invented): empty, or a table that names its device, date and timer, with positive times."""
    t = tables.read_table(tables.default_path((9, 0)), "default")
    assert t is not None and not t.error and t.meta["compute_capability"] == [9, 0]
    if t.entries:
        assert t.meta["device"] and t.meta["date"] and t.meta["timer"] and t.meta["device_type"] == "cuda"
        assert all(e["times_ms"] and all(v > 0 for v in e["times_ms"].values()) for e in t.entries)
        assert len(t._index) > 0  # every entry has a readable class


def test_a_default_table_ranks_a_cuda_problem(cache, monkeypatch, tmp_path):
    data = tmp_path / "data"
    monkeypatch.setattr(tables, "DATA_DIR", data)
    p = P.replace(device_type="cuda", compute_capability=(9, 0))
    write_table(data / "tune-sm90.json", [entry(times={"reference": 1.0, "sdpa": 2.0})], device="NVIDIA H100 80GB HBM3",
                device_type="cuda", compute_capability=[9, 0])
    ex = attncore.explain(p)
    assert ex.ranking == "measured" and ex.chosen == "reference", str(ex)
    assert "default table" in ex.source and "NVIDIA H100 80GB HBM3" in ex.source
    assert attncore.explain(P).ranking == "rules"  # a cuda table says nothing about the CPU


def test_tune_classes_are_the_problems_the_api_builds(monkeypatch):
    """Each grid point's class is the class of the problem the API plans for its workload."""
    seen = []
    real = selector.select

    def spy(problem, backend="auto", sizes=None):
        seen.append(problem)
        return real(problem, backend, sizes)

    monkeypatch.setattr(selector, "select", spy)
    pairs = [c for c in tune.grid("cpu") if c.head_dim_vo and c.q_dtype == torch.float16]  # 192 / 128
    assert {c.op for c in pairs} == {"single_prefill", "batch_prefill_ragged", "batch_prefill_paged"}
    for c in tune.grid("cpu", quick=True) + pairs:
        seen.clear()
        bench._setup(c.workload(), "reference", "cpu", c.q_dtype, 1)
        assert seen and {tables.problem_class(p) for p in seen} == {c.key()}, c.describe()


def test_an_auto_plan_selects_by_the_bucket_of_its_batch(monkeypatch):
    """plan() hands selection the bucket of its batch (requests, longest query, longest KV), a forced backend
    none; a decode batch's longest query is its q_len_per_req."""
    seen = []
    real = selector.choose

    def spy(problem, backend, sizes=None):
        seen.append((problem.op, backend, sizes))
        return real(problem, backend, sizes)

    monkeypatch.setattr(selector, "choose", spy)
    ws = torch.empty(8 << 20, dtype=torch.uint8)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    qo, kv = i32([0, 3, 203, 204]), i32([0, 40, 250, 253])  # the longest query makes it a prefill bucket
    for backend in ("auto", "reference"):
        seen.clear()
        w = attncore.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(qo, kv, 4, 2, 32, causal=True, q_data_type=torch.float16)
        want = tables.Sizes(3, 200, 210).bucket("batch_prefill_ragged") if backend == "auto" else None
        assert seen == [("batch_prefill_ragged", backend, want)] and (want is None or want.shape == "prefill")
    seen.clear()
    w = attncore.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="auto")
    w.plan(i32([0, 2, 5]), i32([0, 1, 2, 3, 4]), i32([3, 1]), 4, 2, 32, 4, q_data_type=torch.float16, q_len_per_req=2)
    assert seen[-1][2] == tables.Sizes(2, 2, 9).bucket(seen[-1][0])  # kv 4 + 3 and 4 * 2 + 1


def test_merge_keeps_what_this_run_did_not_measure():
    old = {"format": 1, "device": "d", "seconds": 1, "backends": {"a": "x"},
           "entries": [entry(times={"a": 1.0, "b": 2.0}), entry(times={"a": 3.0}, len_bucket="kv257-1024")]}
    new = {"format": 1, "device": "d", "seconds": 2, "backends": {"b": "y"},
           "entries": [entry(times={}, failed={"b": "error: x"}), entry("batch_decode", page_size=16, times={"b": 1.0})]}
    m = tune.merge(old, new)
    assert len(m["entries"]) == 3 and m["backends"] == {"a": "x", "b": "y"} and m["seconds"] == 3
    e0 = m["entries"][0]
    assert e0["times_ms"] == {"a": 1.0} and e0["failed"] == {"b": "error: x"}
    assert tune.merge(dict(old, device="other"), new) is new


def test_grid_and_buckets():
    assert tables.length_bucket(4096) == "kv1025-4096" and tables.length_bucket(1) == "kv1-256"
    assert tables.length_bucket(10 ** 6) == "kv>65536"
    assert tables.batch_bucket(1) == "B1" and tables.batch_bucket(64) == "B17-64"
    full = tune.grid("cuda")
    assert {c.op for c in full} == set(tune.TUNE_OPS)
    assert len({(c.key(), c.bucket()) for c in full}) == len(full)  # no point twice
    assert {(c.head_dim, c.key().head_dim_vo) for c in full} == {(64, 64), (128, 128), (256, 256), (192, 128)}
    pairs = tune.grid("cuda", head_dims=[192])  # the 192 / 128 prefill points: single, ragged and paged (page 1, 16)
    assert {(c.op, c.page_size) for c in pairs} == {("single_prefill", None), ("batch_prefill_ragged", None),
                                                    ("batch_prefill_paged", 1), ("batch_prefill_paged", 16)}
    assert all(c.workload().dv == 128 and c.workload().d == 192 and c.group == 1 for c in pairs)
    assert [c.op for c in tune.grid("cuda", ops=["batch_decode"])] == ["batch_decode"] * sum(
        c.op == "batch_decode" for c in full)
    # short single prefill has its own points: causal a 16-row chunk and 128 over 128 keys, mask none the latter
    short = {(c.mask, c.bucket().length, c.bucket().shape) for c in full if c.op == "single_prefill" and c.kv == 128
             and c.qo > 1}
    assert short == {("causal", "kv1-256", "append"), ("causal", "kv1-256", "prefill"), ("none", "kv1-256", "prefill")}
    d256 = tune.grid("cuda", ops=["batch_prefill_paged", "single_prefill"], head_dims=[256])
    assert d256 and {(c.op, c.head_dim) for c in d256} == {("batch_prefill_paged", 256), ("single_prefill", 256)}
    assert len(d256) == sum(c.op in ("batch_prefill_paged", "single_prefill") and c.head_dim == 256 for c in full)
    with pytest.raises(ValueError, match="unknown op"):
        tune.grid("cpu", ops=["pod"])


@pytest.mark.parametrize("args, says", [
    (["tune", "--backend", "nosuch"], "known backends: "),
    (["tune", "--op", "pod"], "argument --op: invalid choice"),
])
def test_tune_usage_errors(args, says, capsys):
    from attncore.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_tune_list_prints_the_grid(capsys):
    from attncore.cli import main

    assert main(["tune", "--list", "--device", "cuda", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "batch_decode causal d128 g4 bf16/e4m3 p16 kv1025-4096 B17-64" in out and "7 grid points" in out


def test_each_point_is_saved_and_a_cut_off_run_resumes(cache, capsys):
    """Every grid point reaches ``on_entry`` as it is measured; ``done`` skips what a grid point holds
    already, so ``attncore tune --resume`` measures only what a cut-off run left."""
    ops = ["batch_decode", "single_prefill"]
    saved = []
    t = tune.run_tune(["reference"], quick=True, ops=ops, device="cpu", progress=lambda s: None, on_entry=saved.append)
    assert [len(s["entries"]) for s in saved] == [1, 1]
    assert [s["entries"][0] for s in saved] == t["entries"] and all(e["times_ms"]["reference"] > 0 for e in t["entries"])
    assert tune.run_tune(["reference"], quick=True, ops=ops, device="cpu", done=t, progress=lambda s: None)["entries"] == []
    cut = dict(t, entries=t["entries"][:1])  # a run cut off after its first point
    rest = tune.run_tune(["reference"], quick=True, ops=ops, device="cpu", done=cut, progress=lambda s: None)
    assert [e["op"] for e in rest["entries"]] == [t["entries"][1]["op"]]
    # a backend the earlier run did not measure is measured, alone
    more = tune.run_tune(["reference", "triton"], quick=True, ops=["batch_decode"], device="cpu", done=t,
                         progress=lambda s: None)["entries"]
    assert len(more) == 1 and set(more[0]["times_ms"]) | set(more[0]["failed"]) == {"triton"}

    from attncore.cli import main

    args = ["tune", "--quick", "--device", "cpu", "--backend", "reference", "--op", "batch_decode"]
    assert main(args) == 0 and "table: " in capsys.readouterr().out
    assert main(args + ["--resume"]) == 0
    assert "nothing left to measure" in capsys.readouterr().out
    assert len(json.loads(tables.cache_path(tables.cpu_name()).read_text())["entries"]) == 1


# --------------------------------------------------------------- selection by planned sizes (issue 17)
R = problem_of(entry("batch_prefill_ragged"))
PREFILL, APPEND = tables.Sizes(8, 2048, 2048), tables.Sizes(16, 512, 4096)  # P3's and P4's sizes


def ragged(times, len_bucket="kv1025-4096", batch_bucket="B5-16", shape=(16, 512, 4096), **kw):
    b, qo, kv = shape
    return entry("batch_prefill_ragged", times=times, len_bucket=len_bucket, batch_bucket=batch_bucket,
                 shape={"batch": b, "qo": qo, "kv": kv, "hq": 4, "hkv": 2}, **kw)


def test_sizes_pick_the_bucket_of_their_shape(cache):
    """One length and batch bucket, two shapes: sdpa wins the append point, the reference the prefill
    point; the geometric mean over both (no sizes) is sdpa's."""
    cpu_table([ragged({"sdpa": 1.0, "reference": 4.0}, shape_bucket="append"),
               ragged({"sdpa": 3.0, "reference": 2.0}, shape=(8, 2048, 2048), shape_bucket="prefill")])
    assert attncore.explain(R).chosen == "sdpa"  # sqrt(3) < sqrt(8)
    assert selector.select(R).name == "sdpa" and selector.choose(R, "auto")[1].name == "sdpa"
    ex = attncore.explain(R, sizes=PREFILL)
    assert ex.chosen == "reference" and ex.ranking == "measured"
    text = str(ex)
    assert "sizes: B8 qo2048 kv2048 -> bucket kv1025-4096 B5-16 prefill" in text
    assert "decided by: the sizes' own bucket kv1025-4096 B5-16 prefill; 1 other bucket(s) of the class not used" in text
    assert "reference (priority 0): measured 2 ms (fastest)" in text
    assert "kv1025-4096 B5-16 prefill (B8 qo2048 kv2048): 3 ms" in text and "geometric mean" not in text
    assert selector.select(R, sizes=PREFILL).name == "reference"
    assert selector.choose(R, "auto", PREFILL) == ("auto", registry.get_entry("reference").backend)
    assert selector.choose(R, None, APPEND)[1].name == "sdpa"
    assert attncore.explain(R, sizes=APPEND.bucket(R.op)).chosen == "sdpa"  # a Bucket is a sizes hint too
    text = str(attncore.explain(R))
    assert "decided by: no sizes given: the geometric mean over the class's 2 bucket(s)" in text
    assert "measured, geometric mean over the buckets, 1.732 ms (fastest)" in text


def test_nearest_bucket_when_the_sizes_own_has_no_candidate(cache):
    near = ragged({"reference": 1.0, "sdpa": 2.0}, "kv257-1024", "B2-4", (4, 1024, 1024))  # no shape_bucket field
    cpu_table([near, ragged({"sdpa": 1.0, "reference": 2.0}),  # append, the sizes' length and batch buckets
               ragged({"nosuch": 0.1}, shape=(8, 2048, 2048))])  # the sizes' own bucket, no candidate in it
    ex = attncore.explain(R, sizes=PREFILL)
    assert ex.chosen == "reference", str(ex)  # the same shape beats the same length and batch buckets
    assert ("decided by: no candidate measured in kv1025-4096 B5-16 prefill: the nearest bucket kv257-1024 B2-4 "
            "prefill (B4 qo1024 kv1024)") in str(ex)
    assert attncore.explain(R, sizes=tables.Sizes(3, 100, 3000)).chosen == "sdpa"  # append: 1 batch bucket away
    # buckets as near as each other (one shorter, one longer) decide together
    cpu_table([near, ragged({"reference": 1.0, "sdpa": 2.0}, "kv257-1024", "B5-16", (8, 1024, 1024)),
               ragged({"reference": 4.0, "sdpa": 1.0}, "kv4097-16384", "B5-16", (8, 8192, 8192))])
    ex = attncore.explain(R, sizes=PREFILL)
    assert ex.chosen == "sdpa" and ex.decided.startswith(
        "no candidate measured in kv1025-4096 B5-16 prefill: the nearest buckets kv257-1024 B5-16 prefill "
        "(B8 qo1024 kv1024) and kv4097-16384 B5-16 prefill"), str(ex)
    assert "measured, geometric mean over the buckets, 1.414 ms (fastest)" in str(ex)
    # no bucket of the shape: the nearest of another shape, said so
    cpu_table([ragged({"sdpa": 1.0, "reference": 2.0})])
    ex = attncore.explain(R, sizes=tables.Sizes(1, 300, 300))
    assert ex.chosen == "sdpa" and ex.decided.endswith("kv1025-4096 B5-16 append (B16 qo512 kv4096) (another shape)")


def test_old_entries_get_their_shape_bucket_from_their_shape():
    eb = tables.entry_shape_bucket
    assert eb(ragged({}, shape=(8, 2048, 2048))) == "prefill" and eb(ragged({}, shape=(8, 1023, 2048))) == "append"
    assert eb(ragged({}, shape=(8, 1024, 2048))) == "prefill"  # qo >= kv / 2
    assert eb(ragged({}, shape_bucket="append", shape=(8, 2048, 2048))) == "append"  # the field wins
    assert eb(entry("batch_decode", page_size=16)) == "decode" and eb(entry()) == "?"
    assert tables.entry_bucket(ragged({})) == tables.Bucket("kv1025-4096", "B5-16", "append")
    t = json.loads(tables.default_path((9, 0)).read_text())  # the shipped table: every entry has a shape bucket
    assert all(tables.entry_shape_bucket(e) in tables.SHAPES for e in t["entries"])


def test_sizes_and_buckets():
    assert tables.Sizes.of([1, 7, 3], [10, 5000, 30]) == tables.Sizes(3, 7, 5000)
    assert tables.Sizes.of([], []) == tables.Sizes(0, 0, 0)
    with pytest.raises(ValueError, match="qo_lens has 2 requests, kv_lens 1"):
        tables.Sizes.of([1, 2], [3])
    assert tables.Sizes.of((n for n in (4, 2)), range(2)) == tables.Sizes(2, 4, 1)  # any iterables
    assert PREFILL.bucket("batch_prefill_paged") == tables.Bucket("kv1025-4096", "B5-16", "prefill")
    assert APPEND.bucket("single_prefill").shape == "append" and APPEND.bucket("xqa_decode").shape == "decode"
    assert tables.Sizes.parse(" 8, 2048,2048") == PREFILL
    with pytest.raises(ValueError, match="expected B,QO,KV"):
        tables.Sizes.parse("8,2048")
    with pytest.raises(TypeError, match="sizes: expected"):
        selector.choose(R, "auto", (8, 2048, 2048))
    b = tables.Bucket("kv1025-4096", "B5-16", "prefill")
    assert b.distance(b) == (0, 0, 0) and b.distance(b._replace(shape="append", length="kv1-256")) == (1, 2, 0)
    assert b.distance(b._replace(batch="B?")) == (0, 0, len(tables.BATCH_LABELS))


def test_selection_is_cached_per_bucket_not_per_length(cache, monkeypatch):
    cpu_table([ragged({"sdpa": 1.0, "reference": 4.0}),
               ragged({"sdpa": 3.0, "reference": 2.0}, shape=(8, 2048, 2048))])
    calls = []
    real = selector._select
    monkeypatch.setattr(selector, "_select", lambda *a: calls.append(a[2]) or real(*a))
    selector._cache.clear()
    selector._chosen.clear()
    same = [tables.Sizes(8, 2048, 2048), tables.Sizes(5, 1500, 1600), tables.Sizes(16, 4096, 4096)]
    assert {selector.choose(R, "auto", s)[1].name for s in same} == {"reference"}
    assert calls == [PREFILL.bucket(R.op)]  # one bucket: selected once
    assert selector.choose(R, "auto", APPEND)[1].name == "sdpa" and len(calls) == 2
    assert selector.choose(R, "auto")[1].name == "sdpa" and calls[-1] is None and len(calls) == 3
    cpu_table([ragged({"sdpa": 9.0, "reference": 4.0})])  # a new table: selected again
    assert selector.choose(R, "auto", APPEND)[1].name == "reference"


def test_shipped_sm90_table_sends_p3_and_p4_to_cuda_fa2(monkeypatch):
    """The H100 measured triton ahead at qo = kv (P3: 0.687 vs cuda_fa2 0.763 ms) and cuda_fa2 ahead at the append
    shape (P4); the table's buckets keep them apart (a geometric mean over them gave P3 to cuda_fa2).  Since session 32
    (H200, BENCHMARKS.md 2ab: the Q copy by adds, 16-byte epilogue stores) cuda_fa2 is ahead at qo = kv too (P3 page 16
    0.613 vs 0.684 ms, page 1 0.636 vs 0.686 at the table's points), and the re-measured points say so."""
    monkeypatch.delenv("ATTNCORE_TUNE", raising=False)
    tables.reload()
    for page in (16, 1):
        p = AttentionProblem(op="batch_prefill_paged", device_type="cuda", compute_capability=(9, 0),
                             q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_qo_heads=32,
                             num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, page_size=page, mask="causal")
        m, source = ranking.measured(p)
        assert m is not None and m.table.kind == "default", source
        names = ["triton", "cuda_fa2"]

        def fastest(sizes):
            n = m.narrow(tables.bucket_of(p.op, sizes), names)
            return min(names, key=lambda x: n.score(x))

        assert fastest(PREFILL) == "cuda_fa2" and fastest(APPEND) == "cuda_fa2", page


def test_shipped_sm90_table_measures_the_192_128_pair(monkeypatch):
    """The shipped table's head dims 192 / 128 classes (single, ragged, paged prefill; measured on an H200 in session
    44) rank cuda_fa2 first at P5-d192's and P5-d192-p16's sizes, and a 192 / 192 problem finds nothing there."""
    monkeypatch.delenv("ATTNCORE_TUNE", raising=False)
    tables.reload()
    base = AttentionProblem(op="single_prefill", device_type="cuda", compute_capability=(9, 0), q_dtype=torch.bfloat16,
                            kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_qo_heads=32, num_kv_heads=32,
                            head_dim_qk=192, head_dim_vo=128, mask="causal")
    names = ["triton", "cuda_fa2"]
    for p, sizes in ((base, tables.Sizes(1, 4096, 4096)),
                     (base.replace(op="batch_prefill_ragged"), PREFILL),
                     (base.replace(op="batch_prefill_paged", page_size=16), PREFILL),
                     (base.replace(op="batch_prefill_paged", page_size=1), APPEND)):
        m, source = ranking.measured(p)
        assert m is not None and m.table.kind == "default" and m.key.dims == "d192x128", source
        n = m.narrow(tables.bucket_of(p.op, sizes), names)
        assert n.used and all(e.get("device") == "NVIDIA H200" for e in n.used)
        assert min(names, key=n.score) == "cuda_fa2", (p.op, p.page_size)
        assert n.score("triton") > 1.3 * n.score("cuda_fa2")
    m, source = ranking.measured(base.replace(head_dim_vo=192))
    assert m is None and "nothing for single_prefill causal d192 g1" in source


def test_tune_grid_has_qo_eq_kv_prefill_points_and_records_the_shape():
    full = tune.grid("cuda")
    for op, pages in (("batch_prefill_paged", (1, 16)), ("batch_prefill_ragged", (None,))):
        for page in pages:
            at = {(c.batch, c.qo, c.kv): c.bucket() for c in full if c.op == op and c.head_dim == 128
                  and c.q_dtype == torch.bfloat16 and c.page_size == page}
            assert at[(8, 2048, 2048)] == PREFILL.bucket(op) and at[(16, 512, 4096)] == APPEND.bucket(op)
            assert {b.shape for b in at.values()} == {"prefill", "append"}
    assert "batch_prefill_paged causal d128 g4 bf16/bf16 p16 kv1025-4096 B5-16 prefill (B8 qo2048 kv2048 32/8)" in [
        c.describe() for c in full]
    t = tune.run_tune(["reference"], quick=True, ops=["batch_prefill_ragged"], device="cpu", progress=lambda s: None)
    (e,) = t["entries"]
    assert e["shape_bucket"] == "prefill" == tables.entry_shape_bucket(dict(e, shape_bucket=None))  # qo 32, kv 64


def test_resume_from_a_table_without_shape_buckets_and_table_option(cache, tmp_path, capsys):
    """An old table (no shape_bucket fields) resumes: its points are not measured again; ``--table FILE``
    merges into FILE (the shipped table's copy) and keeps its note; a FILE of another device is refused."""
    ops = ["batch_decode", "batch_prefill_paged"]
    t = tune.run_tune(["reference"], quick=True, ops=ops, device="cpu", progress=lambda s: None)
    old = dict(t, note="measured by hand", entries=[{k: v for k, v in e.items() if k != "shape_bucket"}
                                                     for e in t["entries"]])
    assert tune.run_tune(["reference"], quick=True, ops=ops, device="cpu", done=old, progress=lambda s: None)[
        "entries"] == []
    f = tmp_path / "copy.json"
    f.write_text(json.dumps(dict(old, entries=old["entries"][:1])))
    from attncore.cli import main

    args = ["tune", "--quick", "--device", "cpu", "--backend", "reference", "--table", str(f)] + sum(
        (["--op", o] for o in ops), [])
    assert main(args + ["--resume"]) == 0
    got = json.loads(f.read_text())
    assert len(got["entries"]) == 2 and got["note"] == "measured by hand"
    assert "shape_bucket" not in got["entries"][0] and got["entries"][1]["shape_bucket"] == "decode"
    assert not tables.cache_path(tables.cpu_name()).exists()  # the cache untouched
    assert main(args + ["--resume"]) == 0 and "nothing left to measure" in capsys.readouterr().out
    f.write_text(json.dumps(dict(old, device="NVIDIA H100 80GB HBM3")))
    with pytest.raises(SystemExit) as ex:
        main(args + ["--resume"])
    assert ex.value.code == 2 and "--table table " in capsys.readouterr().err
    assert json.loads(f.read_text())["device"] == "NVIDIA H100 80GB HBM3"  # left as it was


def test_explain_cli_sizes(cache, capsys):
    from attncore.cli import main

    cpu_table([ragged({"sdpa": 1.0, "reference": 4.0}),
               ragged({"sdpa": 3.0, "reference": 2.0}, shape=(8, 2048, 2048))])
    base = ["explain", "--op", "batch_prefill_ragged", "--device", "cpu", "--q-dtype", "float16", "--heads", "4/2",
            "--head-dim", "64", "--mask", "causal"]
    assert main(base + ["--sizes", "8,2048,2048"]) == 0
    out = capsys.readouterr().out
    assert "chosen: reference" in out and "decided by: the sizes' own bucket kv1025-4096 B5-16 prefill" in out
    assert main(base) == 0 and "chosen: sdpa" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ex:
        main(base + ["--sizes", "8x2048"])
    assert ex.value.code == 2 and "--sizes '8x2048': expected B,QO,KV" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 1])
def test_auto_picks_by_planned_sizes_on_the_h100(page, monkeypatch):
    """On an sm90 GPU with the shipped table (ATTNCORE_CACHE_DIR empty): P3's and P4's sizes go to cuda_fa2, by their
    own buckets (the H100 had P3 to Triton: 0.687 vs 0.763 ms; re-measured on an H200 in session 32: cuda_fa2 0.613 vs
    0.684 ms at page 16; test_shipped_sm90_table_sends_p3_and_p4_to_cuda_fa2 checks the same table on the CPU)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the shipped table is sm90's")
    import tempfile

    monkeypatch.setenv("ATTNCORE_CACHE_DIR", tempfile.mkdtemp())
    monkeypatch.delenv("ATTNCORE_TUNE", raising=False)
    monkeypatch.delenv("ATTNCORE_BACKEND", raising=False)
    tables.reload()
    p = AttentionProblem(op="batch_prefill_paged", device_type="cuda", compute_capability=(9, 0),
                         q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_qo_heads=32,
                         num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, page_size=page, mask="causal")
    ex = attncore.explain(p, sizes=PREFILL)
    assert ex.ranking == "measured" and ex.chosen == "cuda_fa2", str(ex)
    assert "decided by: the sizes' own bucket kv1025-4096 B5-16 prefill" in str(ex)
    assert selector.choose(p, "auto", APPEND)[1].name == "cuda_fa2"
