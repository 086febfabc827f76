"""Print the figures docs/benchmarks.md quotes, straight from the committed H200 JSON files."""
import json
from pathlib import Path

D = Path(__file__).parent / "results" / "h200"


def jl(p):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


r = json.loads((D / "qwen3-8b-1gpu" / "bench__report.json").read_text())
t = json.loads((D / "qwen3-8b-1gpu" / "train__manifest.json").read_text())
w = json.loads((D / "qwen3-8b-1gpu" / "warmup__manifest.json").read_text())
print("qwen3-8b-1gpu (1 target + 1 drafter sharing one H200, block 16, budget 16384)")
for k in ("tokens_per_s", "samples_per_s", "target_mfu", "drafter_mfu", "target_busy_fraction",
          "time_to_first_step_s", "recompiles_after_warmup", "race_errors", "gate_wait_s"):
    print(f"  {k:24s} {r[k]}")
print(f"  {'peak bf16 matmul':24s} {r['peak']['flops_per_s'] / 1e12:.0f} TFLOP/s")
print(f"  {'step time (s)':24s} {r['step_time']['mean_s']:.3f}  busy/step "
      f"{r['step_time']['busy_s_per_step']}")
print(f"  {'warmup compile (s)':24s} {[c['seconds'] for c in w['compiled']]} "
      f"(stage total {w['seconds_total']})")
print(f"  {'train warm start (s)':24s} {t['warm_start']['seconds']}")
print(f"  {'recompile sigs':24s} {t['gate']['recompile_sigs']}")
for name in ("stress_on_run1.jsonl", "stress_on_run2.jsonl", "stress_off_run2.jsonl"):
    for d in jl(D / "stress" / name):
        print(f"stress gate={d['gate']:3s} seed={d['seed']:2d} errors={d['errors_total']:3d} "
              f"{d['errors']} fallbacks={d['fallbacks']} flag_stuck={d['flag_stuck_after']} "
              f"iterations={d['iterations_done']} calls/s={d['calls_per_s']}")
