"""Issue 16, SM-split probe: does POD gain when prefill and decode run on disjoint sets of SMs?

Session 10 (BENCHMARKS 2g) found that prefill and decode CTAs sharing an SM overlap but do not gain: the
decode slows by as much as the prefill hides.  The other design the issue names is an SM split: the
decode (bandwidth-bound) keeps enough SMs to hold its bandwidth, the prefill (compute-bound) takes the rest.
PD1's prefill is ~12 SM-ms of work, so the split pays only if the decode keeps its speed on ~100 of 132 SMs.

This probe measured that (session 15; the model of attncore.core.streams.choose_split is fitted to its
figures).  CUDA green contexts (attncore.core.green: the driver's SM split, one green context and stream per
part) give streams whose kernels run only on a given number of SMs.  For PD1 and PD2 and the POD sweep
(attncore/cli/bench_pod.py) it times, with triton.testing.do_bench (median):
  - the decode alone on N SMs, the prefill alone on N SMs;
  - both at once, the prefill on S SMs and the decode on the rest, forked from and joined to the current
    stream (outputs, NaN-poisoned first, must equal the serial run's bit for bit);
  - serial on all SMs (the reference);
  - with --open, one part on its SMs and the other on a plain stream (every SM), the confined one launched
    first.

    python scripts/gpu_pod_smsplit.py [--json PATH] [--workloads PD1,PD2|sweep] [--prefill auto,fa2p90]
                                      [--splits 16,24,...] [--open]

Needs a GPU with green-context support (CUDA 12.4+ driver).  SM counts are multiples of 8 (sm_90's
partition granularity).  Raw results of session 15: benchmarks/results/pod-smsplit-probe-*-s15.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attncore.cli.bench_pod import POD_WORKLOADS, SWEEP  # noqa: E402
from attncore.core import green  # noqa: E402
from gpu_pod_coresident import DECODES, PREFILLS, WORKLOADS, Inputs, _poison  # noqa: E402


class GreenStreams:
    """The device's SM splits (attncore.core.green), as the probe asks for them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.total = green.sm_count(device)

    def pair(self, n: int):
        """((stream, SMs), (stream, SMs)): n SMs (as the driver rounds them) and the rest."""
        return green.split(self.device, n)


def on(stream, fn):
    """Run fn on stream, ordered after the current stream's work and joined back into it."""
    cur = torch.cuda.current_stream()
    stream.wait_stream(cur)
    with torch.cuda.stream(stream):
        fn()
    cur.wait_stream(stream)


def split(sp, sd, run_p, run_d):
    """run_p on sp and run_d on sd, launched in that order, forked from and joined to the current stream."""
    cur = torch.cuda.current_stream()
    sp.wait_stream(cur)
    sd.wait_stream(cur)
    with torch.cuda.stream(sp):
        run_p()
    with torch.cuda.stream(sd):
        run_d()
    cur.wait_stream(sp)
    cur.wait_stream(sd)


def measure(inp: Inputs, prefill: str, gs: GreenStreams, timer, splits: List[int], alone: bool,
            opened: bool = False) -> Dict:
    run_p, out_p, pb = inp.part("prefill", PREFILLS[prefill]())
    run_d, out_d, db = inp.part("decode", DECODES["auto"]())
    row: Dict = {"workload": inp.w.id, "prefill": prefill, "prefill_backend": pb, "decode_backend": db}

    def serial():
        run_p(), run_d()
    _poison(out_p, out_d)
    serial()
    torch.cuda.synchronize()
    ref_p, ref_d = out_p.clone(), out_d.clone()
    row["serial"] = timer(serial)
    row["prefill_all"] = timer(run_p)
    row["decode_all"] = timer(run_d)
    if alone:  # each part alone on the SMs a split gives it
        row["prefill_on"] = {gs.pair(n)[0][1]: timer(lambda: on(gs.pair(n)[0][0], run_p)) for n in splits}
        row["decode_on"] = {gs.pair(n)[1][1]: timer(lambda: on(gs.pair(n)[1][0], run_d)) for n in splits}
    row["split"] = {}
    for s in splits:
        (sp, gp), (sd, gd) = gs.pair(s)
        go = lambda: split(sp, sd, run_p, run_d)  # noqa: E731
        _poison(out_p, out_d)
        go()
        torch.cuda.synchronize()
        same = torch.equal(out_p, ref_p) and torch.equal(out_d, ref_d)
        row["split"][s] = dict(sms=(gp, gd), ms=timer(go), equal=same)
    if opened:  # one part confined to its SMs and launched first, the other free to use every SM (a plain stream):
        # the free part fills the rest and takes the confined part's SMs as they empty
        free = torch.cuda.Stream()
        row["open_p"], row["open_d"] = {}, {}
        for s in splits:
            (sp, gp), (sd, gd) = gs.pair(s)
            for key, first, second in (("open_p", (sp, run_p), (free, run_d)), ("open_d", (sd, run_d), (free, run_p))):
                go = lambda f=first, g=second: split(f[0], g[0], f[1], g[1])  # noqa: E731
                _poison(out_p, out_d)
                go()
                torch.cuda.synchronize()
                same = torch.equal(out_p, ref_p) and torch.equal(out_d, ref_d)
                row[key][s] = dict(sms=(gp, gd), ms=timer(go), equal=same)
    if alone:  # the best split captured in a CUDA graph: does replay run the parts on their SMs?
        s = min(row["split"], key=lambda k: row["split"][k]["ms"])
        (sp, _), (sd, _) = gs.pair(s)
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                split(sp, sd, run_p, run_d)
            _poison(out_p, out_d)
            g.replay()
            torch.cuda.synchronize()
            row["graph"] = dict(split=s, ms=timer(g.replay),
                                equal=torch.equal(out_p, ref_p) and torch.equal(out_d, ref_d))
        except Exception as e:  # what capture says about green-context streams is the finding
            row["graph"] = dict(split=s, error=f"{type(e).__name__}: {str(e)[:300]}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--workloads", default="PD1,PD2", help="ids of POD_WORKLOADS and SWEEP, or 'sweep'")
    ap.add_argument("--splits", default="16,24,32,40,48,56,64,72,80,88,96,104,112", help="SMs of the prefill")
    ap.add_argument("--prefill", default="auto,fa2p90")
    ap.add_argument("--open", action="store_true", help="also confine one part only, the other on every SM")
    a = ap.parse_args(argv)
    from triton.testing import do_bench

    timer = lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    gs = GreenStreams(torch.device("cuda", torch.cuda.current_device()))
    info = {"device": torch.cuda.get_device_name(), "sms": gs.total, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                            time.gmtime()),
            "rows": []}
    print(f"{info['device']}: {gs.total} SMs")
    splits = [int(x) for x in a.splits.split(",")]
    known = {w.id: w for w in POD_WORKLOADS + SWEEP}
    ids = [w.id for w in SWEEP] if a.workloads == "sweep" else a.workloads.split(",")
    for wid in ids:
        inp = Inputs(known[wid], "cuda", torch.bfloat16)
        main_wl = wid in WORKLOADS
        for pn in (a.prefill.split(",") if main_wl else ["auto"]):
            try:
                row = measure(inp, pn, gs, timer, splits, alone=main_wl, opened=a.open)
            except Exception as e:  # a prefill this machine cannot serve: the row says why
                row = {"workload": wid, "prefill": pn, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            info["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k in ("workload", "serial", "error")}))
        del inp
        torch.cuda.empty_cache()
    for r in info["rows"]:
        if "error" in r:
            print(f"{r['workload']} {r['prefill']}: {r['error']}")
            continue
        best = min(r["split"].items(), key=lambda kv: kv[1]["ms"])
        print(f"{r['workload']} {r['prefill_backend']}+{r['decode_backend']}: serial {r['serial']:.3f} "
              f"(P {r['prefill_all']:.3f}, D {r['decode_all']:.3f}) | best split P{best[1]['sms'][0]}/"
              f"D{best[1]['sms'][1]} {best[1]['ms']:.3f} = {best[1]['ms'] / r['serial']:.2f}x serial | splits "
              + " ".join(f"{s}:{v['ms']:.3f}{'' if v['equal'] else '!'}" for s, v in r["split"].items()))
        for key, what in (("open_p", "prefill confined, decode free"), ("open_d", "decode confined, prefill free")):
            if key in r:
                best = min(r[key].items(), key=lambda kv: kv[1]["ms"])
                print(f"   {what}: best P{best[1]['sms'][0]}/D{best[1]['sms'][1]} {best[1]['ms']:.3f} = "
                      f"{best[1]['ms'] / r['serial']:.2f}x serial | "
                      + " ".join(f"{s}:{v['ms']:.3f}{'' if v['equal'] else '!'}" for s, v in r[key].items()))
        if "prefill_on" in r:
            print("   prefill on N SMs " + " ".join(f"{n}:{t:.3f}" for n, t in r["prefill_on"].items())
                  + " | decode on N SMs " + " ".join(f"{n}:{t:.3f}" for n, t in r["decode_on"].items()))
            print(f"   graph: {r['graph']}")
    path = a.json or (os.path.join(os.environ["OUT"], "pod_smsplit.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
