#!/usr/bin/env bash
# Host time of plan(), run() and the one-call functions (issue 15 item 1) on one GPU, this tree against an
# earlier one in the same run.  Per round, each tree in turn (alternating, so the machine's drift hits both):
#   scripts/profile_plan.py --batch 4 --reps 200: decode plan()/run() on auto, xqa, triton, cuda_fa2; paged
#     prefill plan()/run() on triton, cuda_fa2; single_prefill / single_decode on auto, triton, cuda_fa2
#     (this tree's profile_plan.py for both trees: it has the one-call ops)
#   python3 -m attncore.cli bench --latency (auto, triton, cuda_fa2, xqa; no FlashInfer)
# The table last: us per call, the median over ROUNDS rounds, before -> after and their ratio.
# BEFORE (optional $1): a directory holding an earlier tree, e.g.
#   git archive -o .old/before.tar REV attncore backends pyproject.toml plugins   (here; carry .old), then on
#   the device:  mkdir -p /tmp/before && tar xf .old/before.tar -C /tmp/before
# It runs with PYTHONPATH=$BEFORE (its attncore/backends/{triton,cuda_fa2,xqa} linked to its backends/ as the
# editable install maps them); this tree is installed with pip -e.  cuda_fa2 and xqa JIT-build their kernels on
# first use (into $ATTNCORE_CACHE_DIR, shared by both trees: no kernel differs): a warm-up pass runs first.
# Usage on the device machine:  [ROUNDS=3] bash scripts/gpu_host_time.sh [/tmp/before]
BEFORE=${1:-}
source scripts/gpu_common.sh
gpu_header
[ "${SKIP_INSTALL:-0}" = 1 ] || install_tree plugins/attncore-sdpa  # SKIP_INSTALL=1: already installed
stamp "installed"
REPO=$PWD
ROUNDS=${ROUNDS:-3}
LOG="$OUT/host_time"; mkdir -p "$LOG"
if [ -n "$BEFORE" ]; then
  for b in triton cuda_fa2 xqa; do
    [ -e "$BEFORE/attncore/backends/$b" ] || ln -s "../../backends/$b" "$BEFORE/attncore/backends/$b"
  done
fi
CASES=()
for be in auto xqa triton cuda_fa2; do CASES+=("decode $be"); done
for be in triton cuda_fa2; do CASES+=("paged_prefill $be"); done
for op in single_prefill single_decode; do for be in auto triton cuda_fa2; do CASES+=("$op $be"); done; done

one_tree() {  # $1: label (before/after), $2: tree dir or "" (the installed one), $3: round
  local label=$1 tree=$2 r=$3 pp=() c
  [ -n "$tree" ] && pp=(env "PYTHONPATH=$tree")
  (cd "${tree:-$REPO}" && for c in "${CASES[@]}"; do
    set -- $c
    echo "$label $r $1 $2 :: $(timeout 300 "${pp[@]}" python3 "$REPO/scripts/profile_plan.py" --op "$1" --backend "$2" \
      --batch 4 --reps 200 2>&1 | tail -1)"
  done) >> "$LOG/profile.txt"
  (cd "${tree:-$REPO}" && timeout 600 "${pp[@]}" python3 -m attncore.cli bench --latency --backend auto --backend triton \
    --backend cuda_fa2 --backend xqa --json "$LOG/latency_${label}_$r.json" > "$LOG/latency_${label}_$r.txt" 2>&1)
  stamp "$label round $r: exit $?"
}

: > "$LOG/profile.txt"
one_tree warmup "" 0  # builds and autotunes; not counted
[ -n "$BEFORE" ] && one_tree warmup "$BEFORE" 0
for r in $(seq "$ROUNDS"); do
  [ -n "$BEFORE" ] && one_tree before "$BEFORE" "$r"
  one_tree after "" "$r"
done
grep -h "Error\|Traceback" "$LOG/profile.txt" | sort | uniq -c | head -10
cat "$LOG"/latency_after_"$ROUNDS".txt
python3 - "$LOG" <<'EOF'
import glob, json, re, statistics, sys
from collections import defaultdict

log = sys.argv[1]
vals = defaultdict(list)  # (label, row) -> [us]
for line in open(f"{log}/profile.txt"):
    m = re.match(r"(\w+) (\d+) (\w+) (\w+) :: (.*)", line)
    if not m or m.group(1) == "warmup":
        continue
    label, _, op, be, text = m.groups()
    chose = re.search(r"\(chose (\w+)\)", text)
    be = f"{be}({chose.group(1)})" if be == "auto" and chose else be
    for metric, pat in (("plan", r"plan ([\d.]+) us"), ("run", r"run ([\d.]+) us"), ("call", r"call ([\d.]+) us")):
        x = re.search(pat, text)
        if x:
            vals[(label, f"profile_plan {op} {metric} {be}")].append(float(x.group(1)))
for path in glob.glob(f"{log}/latency_*_*.json"):
    label = path.split("latency_")[1].split("_")[0]
    if label == "warmup":
        continue
    for row, cells in json.load(open(path))["rows"].items():
        for col, v in cells.items():
            if isinstance(v, (int, float)):
                vals[(label, f"bench --latency {col} {row.split()[-1]}")].append(float(v))
rows = sorted({r for _, r in vals})
print("\nhost time per call, us (median of the rounds; before -> after, after/before)")
print("| case | before | after | ratio |\n|---|---|---|---|")
for r in rows:
    b, a = vals.get(("before", r)), vals.get(("after", r))
    mb = statistics.median(b) if b else None
    ma = statistics.median(a) if a else None
    ratio = f"{ma / mb:.2f}" if mb and ma else "-"
    print(f"| {r} | {'-' if mb is None else f'{mb:.1f}'} | {'-' if ma is None else f'{ma:.1f}'} | {ratio} |")
EOF
stamp "done"
