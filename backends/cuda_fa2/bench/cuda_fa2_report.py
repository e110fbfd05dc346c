"""Render benchmarks/results/cuda_fa2-*.json (from cuda_fa2_bench.py) as a markdown table."""
import json
import sys


def render(res, build=None):
    c = res["ceilings"]
    lines = [f"Device: {res['device']}, date {res['date']}, torch {res['torch']}.",
             "",
             f"Ceilings measured in the same run: read-only {c['read_TBps']:.2f} TB/s, device copy "
             f"{c['copy_TBps']:.2f} TB/s (read+write), bf16 matmul 8192^3 {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s.",
             "",
             "| workload | cuda_fa2 ms | TFLOP/s | of matmul | torch SDPA cuDNN | torch SDPA flash (FA2) | config |",
             "|---|---|---|---|---|---|---|"]
    for r in res["prefill"]:
        cud = f"{r['sdpa_cudnn_ms']:.3f} ms / {r['sdpa_cudnn_TFLOPs']:.0f}" if "sdpa_cudnn_ms" in r else "-"
        fl = f"{r['sdpa_flash_ms']:.3f} ms / {r['sdpa_flash_TFLOPs']:.0f}" if "sdpa_flash_ms" in r else "-"
        lines.append(f"| {r['name']} | {r['ms']:.3f} | {r['TFLOPs']:.0f} | {r['TFLOPs'] / c['matmul_bf16_TFLOPs']:.0%} | "
                     f"{cud} | {fl} | {r['config']}, {r['work_items']} items{' split' if r['split'] else ''} |")
    lines += ["", "| workload | cuda_fa2 ms | TB/s | of read ceiling | run() host us | plan ms | config |", "|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        lines.append(f"| {r['name']} | {r['ms']:.3f} | {r['TBps']:.2f} | {r['TBps'] / c['read_TBps']:.0%} | "
                     f"{r['run_overhead_us']:.0f} | {r['plan_ms']:.2f} | {r['config']}, {r['work_items']} items"
                     f"{' split' if r['split'] else ''} |")
    if build:
        lines += ["", f"Cold build: {len(build['specs'])} specializations in {build['wall_s']:.1f} s wall on 16 cores "
                      f"(per specialization {min(s['seconds'] for s in build['specs']):.1f}-"
                      f"{max(s['seconds'] for s in build['specs']):.1f} s)."]
    return "\n".join(lines)


if __name__ == "__main__":
    res = json.load(open(sys.argv[1]))
    build = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else None
    print(render(res, build))
