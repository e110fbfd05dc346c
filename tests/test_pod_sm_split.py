"""POD's SM split (issue 16, ``overlap="sm_split"``, and ``"auto"`` on sm_90): the work of a pair of parts, the
split the model picks and where auto declines it (the H100 sweep it was fitted to), the per-pair decision and
its memo, and green contexts' refusal off CUDA.  The split itself (two green-context streams, outputs equal to
serial bit for bit, graph capture) runs on a GPU: tests/test_pod_streams.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attncore.core import green, streams
from attncore.core import problem as problem_mod
from attncore.core.problem import AttentionProblem
from attncore.core.streams import SplitChoice, choose_split, part_work

H100_SMS = 132
PREFILL = AttentionProblem(op="single_prefill", device_type="cuda", q_dtype=torch.bfloat16,
                           kv_dtype=torch.bfloat16, out_dtype=torch.bfloat16, num_qo_heads=32, num_kv_heads=8,
                           mask="causal")
DECODE = PREFILL.replace(op="batch_decode", page_size=16)


def work(qo, batch, kv, decode=DECODE):
    return part_work(PREFILL, [(qo, qo)], decode, [kv] * batch)


def declined_because(qo) -> str:
    """What choose_split's reason says when auto declines a split with a prefill of ``qo`` causal rows."""
    if work(qo, 0, 0)[0] < streams.SPLIT_MIN_PREFILL_FLOPS:
        return "below which the split measured slower than serial"
    return "saved"


def test_part_work_counts_visible_pairs_and_bytes():
    f, b = part_work(PREFILL, [(4, 4)], DECODE, [3, 5])
    assert f == 2.0 * 10 * 32 * 256  # causal 4 x 4: 1 + 2 + 3 + 4 pairs
    assert b == 8.0 * 8 * 256 * 2  # 8 keys, 8 kv heads, K and V of d128, bf16
    f, _ = part_work(PREFILL, [(4, 6)], DECODE, [])
    assert f == 2.0 * (3 + 4 + 5 + 6) * 32 * 256  # bottom-right: row i sees kv - qo + i + 1 keys
    f, _ = part_work(PREFILL, [(6, 4)], DECODE, [])
    assert f == 2.0 * (1 + 2 + 3 + 4) * 32 * 256  # qo > kv: the first rows see nothing
    f, _ = part_work(PREFILL.replace(mask="none"), [(4, 6), (2, 2)], DECODE, [])
    assert f == 2.0 * (24 + 4) * 32 * 256
    _, b8 = part_work(PREFILL, [], DECODE.replace(kv_dtype=torch.float8_e4m3fn), [8])
    assert b8 == b / 2


@pytest.mark.parametrize("qo,batch,kv,want", [
    (2048, 64, 4096, 40),  # PD1: measured best 40 (0.415 ms against 0.454 serial)
    (4096, 32, 4096, 96),  # PD2: measured 0.419 at 96, serial 0.474
    (2048, 32, 4096, 64),  # measured 0.232 at 64 against 0.279 serial (the decode on 60 SMs: a cliff)
])
def test_split_where_the_h100_sweep_gained(qo, batch, kv, want):
    c = choose_split(*work(qo, batch, kv), H100_SMS)
    assert isinstance(c, SplitChoice) and c.worth and c.prefill_sms == want, c
    assert c.split_s <= streams.SPLIT_MARGINS["default"] * c.serial_s
    assert f"prefill on {want} of 132 SMs" in c.reason


@pytest.mark.parametrize("qo,batch,kv", [
    (512, 8, 1024),  # both parts short: the split measured 1.68x slower
    (512, 128, 16384),  # the decode dwarfs the prefill
    (8192, 8, 4096),  # the prefill dwarfs the decode
    (2048, 32, 16384),
])
def test_no_split_where_the_h100_sweep_lost(qo, batch, kv):
    c = choose_split(*work(qo, batch, kv), H100_SMS)
    assert not c.worth and c.prefill_sms is not None and declined_because(qo) in c.reason, c


@pytest.mark.parametrize("qo,batch,kv", [(256, 8, 8192), (512, 64, 1024), (1024, 32, 2048), (1024, 32, 4096),
                                         (768, 128, 1024)])
def test_no_split_of_a_short_prefill(qo, batch, kv):
    """Prefills under SPLIT_MIN_PREFILL_FLOPS (up to 1k causal rows here) lost on the split on the H200 whatever the
    model gave it: auto declines, saying why; the split's SMs are still chosen (overlap="sm_split" takes them)."""
    c = choose_split(*work(qo, batch, kv), H100_SMS, margin=streams.SPLIT_MARGINS["H200"])
    assert not c.worth and c.prefill_sms is not None, c
    assert "GFLOP, under the 15 below which the split measured slower than serial" in c.reason
    c = choose_split(*work(1536, 8, 8192), H100_SMS, margin=streams.SPLIT_MARGINS["H200"])  # 1.12x measured
    assert c.worth and "GFLOP" not in c.reason, c


def test_split_sizes_are_multiples_of_the_granularity():
    for sms in (16, 78, 108, 132):
        s = choose_split(*work(2048, 64, 4096), sms).prefill_sms
        assert s % green.GRANULARITY == 0 and 0 < s < sms
    c = choose_split(*work(2048, 64, 4096), 12)
    assert c.prefill_sms is None and not c.worth and "too few to split" in c.reason


def _metas(qo, batch, kv):
    p = SimpleNamespace(qo_lens_host=[qo], kv_lens_host=[qo], batch_size=1)
    d = SimpleNamespace(qo_lens_host=[1] * batch, kv_lens_host=[kv] * batch, batch_size=batch, max_seq_len=kv)
    return p, d


def _fake_h100(monkeypatch):
    """An H100's SM resource: its count, and splits made as the driver makes them (no streams)."""
    monkeypatch.setattr(green, "sm_count", lambda device: H100_SMS)
    monkeypatch.setattr(green, "split", lambda device, n: ((None, n), (None, H100_SMS - n)))


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(green, "unavailable", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(problem_mod, "gpu_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    _fake_h100(monkeypatch)


@pytest.mark.parametrize("gpu, sizes, splits", [
    ("NVIDIA H100 80GB HBM3", (2048, 32, 16384), False),  # model 0.904 of serial: the H100 sweep lost here
    ("NVIDIA H200", (2048, 32, 16384), True),  # ... the H200's, with the split's tail, gained 1.045x
    ("NVIDIA H200", (2048, 128, 4096), True),  # 0.904: 1.051x
    ("NVIDIA H200", (512, 8, 4096), False),  # 0.931: the split measured 1.7x slower
    ("NVIDIA H200", (512, 8, 8192), False),  # 0.893, a short prefill: measured 0.95x serial
    ("NVIDIA H200", (1024, 32, 4096), False),  # 0.885, a short prefill: 0.78x
    ("NVIDIA H200", (1536, 64, 1024), True),  # 0.892: 1.17x
    ("NVIDIA GH200 480GB", (2048, 32, 16384), False)])  # a model word: GH200 takes the default margin
def test_split_margin_follows_the_gpu_model(h100, monkeypatch, gpu, sizes, splits):
    monkeypatch.setattr(problem_mod, "gpu_name", lambda device=None: gpu)
    mp, md = _metas(*sizes)
    why = streams.Streams("auto", torch.device("cuda", 0)).decide(PREFILL, mp, DECODE, md)
    assert (why is None) == splits, why
    if not splits:
        want = declined_because(sizes[0])
        assert (f"under {1 - streams.split_margin():.0%} saved" if want == "saved" else want) in why, why


def test_decide_splits_gaining_pairs_and_keeps_the_choice(h100):
    st = streams.Streams("auto", torch.device("cuda", 0))
    mp, md = _metas(2048, 64, 4096)
    assert st.decide(PREFILL, mp, DECODE, md) is None
    assert st.choice.prefill_sms == 40 and st.pair == ((None, 40), (None, 92))
    first = st.choice
    assert st.decide(PREFILL, mp, DECODE, md) is None and st.choice is first  # same metas: the memo
    small = _metas(512, 8, 1024)
    why = st.decide(PREFILL, small[0], DECODE, small[1])
    assert st.choice is None and why.startswith("overlap='auto': serial (model: ") and "split measured slower" in why
    assert st.decide(PREFILL, small[0], DECODE, small[1]) == why and st.pair is None  # the memo of a serial pair
    forced = streams.Streams("sm_split", torch.device("cuda", 0))
    assert forced.decide(PREFILL, small[0], DECODE, small[1]) is None and forced.choice.prefill_sms > 0
    # block tables planned in graph capture carry no host lengths: the decode is bounded by the longest
    md.kv_lens_host = None
    st2 = streams.Streams("auto", torch.device("cuda", 0))
    assert st2.decide(PREFILL, mp, DECODE, md) is None and st2.choice.prefill_sms == 40


def test_streams_and_serial_never_split(h100):
    mp, md = _metas(2048, 64, 4096)
    st = streams.Streams("streams", torch.device("cuda", 0))
    assert st.decide(PREFILL, mp, DECODE, md) is None and st.choice is None
    st = streams.Streams("serial", torch.device("cuda", 0))
    assert st.decide(PREFILL, mp, DECODE, md).startswith("overlap='serial'") and st.choice is None


def test_compose_without_a_decision_runs_serially_and_says_so(h100):
    st = streams.Streams("sm_split", torch.device("cuda", 0))
    ran = []
    st.compose(lambda: ran.append("p"), lambda: ran.append("d"))
    assert ran == ["p", "d"] and st.mode == "serial" and "decide() was not called" in st.reason
    assert st.sms is None


class _FakeStream:
    """A stream that records what it waits for (compose's fork and join), for the launch-order test."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, e):
        self.log.append(f"{self.name} waits")


@pytest.mark.parametrize("first, order", [(None, ["p", "d"]), (True, ["p", "d"]), (False, ["d", "p"])])
def test_split_launches_in_the_order_asked(h100, monkeypatch, first, order):
    """compose() on an SM split queues both parts after the fork, in ``prefill_first``'s order (None:
    ``PREFILL_FIRST``), each under its own stream, and joins both into the current stream."""
    import contextlib

    log = []
    cur, sp, sd = (_FakeStream(n, log) for n in ("current", "prefill", "decode"))
    under = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cur)
    monkeypatch.setattr(torch.cuda, "Event", lambda: SimpleNamespace(record=lambda s: log.append(f"record {s.name}")))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(under.append(s.name)))
    st = streams.Streams("sm_split", torch.device("cuda", 0))
    mp, md = _metas(2048, 64, 4096)
    assert st.decide(PREFILL, mp, DECODE, md) is None
    st.pair = ((sp, 40), (sd, 92))
    ran = []
    st.compose(lambda: ran.append("p"), lambda: ran.append("d"), prefill_first=first, tail=lambda: ran.append("t"))
    assert ran == order + ["t"] and under == ["prefill" if r == "p" else "decode" for r in order] + ["decode"]
    assert log == ["record current", "prefill waits", "decode waits", "record prefill", "record decode",
                   "current waits", "current waits"]
    assert st.mode == "sm_split" and st.sms == (40, 92)


@pytest.mark.parametrize("fails, ran_want", [("d", ["p", "t"]), ("p", [])])
def test_split_tail_follows_a_queued_prefill_even_when_the_decode_raises(h100, monkeypatch, fails, ran_want):
    """The tail finishes the prefill's shared work (and resets what its launches share): queued whenever the first
    launch was, also when the decode's launch raised; never without the first; the streams are joined either way."""
    import contextlib

    log, ran = [], []
    cur, sp, sd = (_FakeStream(n, log) for n in ("current", "prefill", "decode"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cur)
    monkeypatch.setattr(torch.cuda, "Event", lambda: SimpleNamespace(record=lambda s: log.append(f"record {s.name}")))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    st = streams.Streams("sm_split", torch.device("cuda", 0))
    mp, md = _metas(2048, 64, 4096)
    assert st.decide(PREFILL, mp, DECODE, md) is None
    st.pair = ((sp, 40), (sd, 92))

    def part(name):
        def go():
            if name == fails:
                raise RuntimeError(f"{name} failed")
            ran.append(name)
        return go
    with pytest.raises(RuntimeError, match=f"{fails} failed"):
        st.compose(part("p"), part("d"), tail=part("t"))
    assert ran == ran_want and log[-2:] == ["current waits", "current waits"]


def test_run_parts_gives_the_prefills_tail_to_the_decodes_sms(h100, monkeypatch):
    """run_parts() on an SM split: the decode runs with its share's SMs, the prefill as the two launches its backend
    offers for (prefill SMs, decode SMs) (Planned.split_runs), the tail after the decode on its stream; with
    SPLIT_TAIL off, where the backend offers none, or where the model has the decode clearly ending last (the tail would
    find no work), the prefill runs whole; serially, no SMs are asked for."""
    import contextlib

    ran, asked = [], []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream("current", []))
    monkeypatch.setattr(torch.cuda, "Event", lambda: SimpleNamespace(record=lambda s: None))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(ran.append("on " + s.name)))

    class Part:
        def __init__(self, name, pair):
            self.name, self.pair = name, pair

        def run(self, args, sms=None):
            ran.append(f"{self.name} {sms}")

        def split_runs(self, args, sms, tail_sms):
            asked.append((sms, tail_sms))
            return None if not self.pair else (lambda: ran.append("first"), lambda: ran.append("tail"))

    st = streams.Streams("sm_split", torch.device("cuda", 0))
    st.pair = ((_FakeStream("prefill", []), 40), (_FakeStream("decode", []), 92))
    choice = lambda p_s, d_s: streams.SplitChoice(40, 1.0, 1.2, True, "", p_s, d_s)  # noqa: E731
    st.choice = choice(0.30, 0.32)  # the prefill ends last, or close enough that the model could be wrong
    st.run_parts(Part("p", True), None, Part("d", False), None, None)
    assert asked == [(40, 92)]
    assert ran == ["on prefill", "first", "on decode", "d 92", "on decode", "tail"]
    for part, tail_on, c in ((Part("p", False), True, st.choice), (Part("p", True), False, st.choice),
                             (Part("p", True), True, choice(0.30, 0.34))):  # the decode ends last by > 10%
        ran.clear(), asked.clear()
        monkeypatch.setattr(streams, "SPLIT_TAIL", tail_on)
        st.choice = c
        st.run_parts(part, None, Part("d", False), None, None)
        assert ran == ["on prefill", "p None", "on decode", "d 92"]
        assert asked == ([(40, 92)] if c.tail_pays else [])
    ran.clear(), asked.clear()
    st.run_parts(Part("p", True), None, Part("d", False), None, "overlap='serial': asked")
    assert ran == ["p None", "d None"] and asked == [] and st.mode == "serial"


def test_green_contexts_refused_off_cuda():
    assert green.unavailable(torch.device("cpu")) == "no SM partitions on cpu"


def _paged_tables(kv_lens, page=16):
    pages = [-(-n // page) for n in kv_lens]
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv_lens], dtype=torch.int32)
    return indptr, last


def test_batch_pod_decides_from_its_index_tables(monkeypatch):
    """BatchPOD decides the split in plan() from the tables (before planning the parts, so that parts that will
    run in turn plan into the whole float workspace); bad tables leave the decision to the parts' own checks."""
    import attncore
    from attncore import pod as _pod

    monkeypatch.setattr(_pod.Streams, "unavailable", lambda self: None)
    _fake_h100(monkeypatch)
    w = attncore.BatchPODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD")
    w._run_causal = True
    qo = torch.tensor([0, 2048], dtype=torch.int32)
    kvp, lp = _paged_tables([2048])
    kvd, ld = _paged_tables([4096] * 64)
    assert w._concurrency((qo, kvp, lp, kvd, ld), 32, 8, 128, 16, "bfloat16") is None
    assert w._streams.choice.prefill_sms == 40  # PD1, as choose_split gives it from the problems
    kvd, ld = _paged_tables([1024] * 8)
    small = w._concurrency((torch.tensor([0, 512], dtype=torch.int32), *_paged_tables([512]), kvd, ld),
                           32, 8, 128, 16, "bfloat16")
    assert small.startswith("overlap='auto': serial (model: ") and w._streams.choice is None
    bad = w._concurrency((qo, kvp, torch.tensor([99], dtype=torch.int32), kvd, ld), 32, 8, 128, 16, "bfloat16")
    assert "could not be read for the split's model" in bad and "last_page_len_p" in bad


def test_batch_pod_plans_serial_parts_into_the_whole_workspace(monkeypatch):
    """Where plan() decides the parts run in turn, both plan into the whole float workspace, once each (a
    plan into the halves first would plan them twice when a half is too small)."""
    from tests.test_pod_streams import _batch_pod
    from attncore import pod as _pod

    monkeypatch.setattr(_pod.Streams, "unavailable", lambda self: None)
    _fake_h100(monkeypatch)
    ws = torch.empty(4 << 20, dtype=torch.uint8)
    w, args, _ = _batch_pod(ws, torch.float32, backend="reference", fuse=False)
    assert w._split is None and w._overlap_why.startswith("overlap='auto': serial (model: ")
    assert w._prefill._float_workspace_buffer is ws and w._decode._float_workspace_buffer is ws
    w.run(*args)
    assert w.mode == "serial" and w.overlap_reason == w._overlap_why


POD_ARGS = ["explain", "--op", "pod", "--device", "cuda", "--heads", "32/8", "--head-dim", "128", "--q-dtype",
            "bfloat16", "--mask", "causal"]


TAIL = "the prefill's work left when the decode ends then moves to the decode's SMs"
NO_TAIL = "no tail for the prefill: the model has it ending first (326 us on its SMs against the decode's 368)"


@pytest.mark.parametrize("sizes,cc,sms,want,tail", [
    ("2048,2048,64,4096", "9.0", "132", "overlap='auto': SM split, the prefill on 40 SMs, the decode on 92 (model: ",
     NO_TAIL),  # PD1: the decode ends last (streams.SPLIT_TAIL_MIN_RATIO)
    ("4096,4096,32,4096", "9.0", "132", "overlap='auto': SM split, the prefill on 96 SMs, the decode on 36 (model: ",
     TAIL),  # PD2: the prefill ends last
    ("512,512,8,1024", "9.0", "132", "overlap='auto': serial (model: prefill", None),
    ("2048,2048,64,4096", "8.0", "108", "overlap='auto': serial on sm_80 (the SM split's model was fitted on "
                                        "sm_90); overlap='sm_split' would put the prefill on 32 of 108 SMs", None),
])
def test_explain_says_how_auto_runs_a_pod_of_these_sizes(capsys, sizes, cc, sms, want, tail):
    from attncore.cli import main

    main(POD_ARGS + ["--cc", cc, "--pod-sizes", sizes, "--sms", sms])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"pod sizes: prefill {sizes.split(',')[0]} x") and want in last, last
    for t in (TAIL, NO_TAIL):  # the split's tail (streams.SPLIT_TAIL), said only of a split
        assert (t in last) == (t == tail), last


@pytest.mark.parametrize("extra,err", [
    (["--pod-sizes", "1,2"], "--pod-sizes: got '1,2', expected PREFILL_QO,PREFILL_KV,DECODE_BATCH,DECODE_KV"),
    (["--pod-sizes", "1,2,-3,4"], "--pod-sizes: got '1,2,-3,4'"),
    (["--pod-sizes", "1,2,3,4", "--op", "batch_decode"], "--pod-sizes: describes a POD; give --op pod"),
])
def test_explain_pod_sizes_refuses_bad_input(capsys, extra, err):
    from attncore.cli import main

    with pytest.raises(SystemExit) as e:
        main(POD_ARGS + ["--cc", "9.0"] + extra)
    assert e.value.code == 2 and err in capsys.readouterr().err

