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

# ---- after the FlexAttention target path (Qwen3-8B 1+1 on two H200s, target anchors) ----------
Q = D / "qwen3-8b-2gpu"
on = json.loads((Q / "qwen3-8b-2gpu__bench__report.json").read_text())
off = json.loads((Q / "qwen3-8b-2gpu__gateoff_bench__report.json").read_text())
off_t = json.loads((Q / "qwen3-8b-2gpu__gateoff_train__manifest.json").read_text())
on_t = json.loads((Q / "qwen3-8b-2gpu__train__manifest.json").read_text())
wq = json.loads((Q / "qwen3-8b-2gpu__warmup__manifest.json").read_text())
print("\nqwen3-8b-2gpu (1 target on cuda:0 + 1 drafter on cuda:1, block 16, budget 16384)")
for k in ("tokens_per_s", "samples_per_s", "target_mfu", "drafter_mfu", "target_busy_fraction",
          "time_to_first_step_s", "recompiles_after_warmup", "race_errors", "gate_wait_s"):
    print(f"  {k:24s} gate on {on[k]}   gate off {off[k]}")
print(f"  {'step time (s)':24s} on {on['step_time']['mean_s']:.4f} off "
      f"{off['step_time']['mean_s']:.4f}; busy/step on {on['step_time']['busy_s_per_step']}")
print(f"  {'tokens/s on / off':24s} {on['tokens_per_s'] / off['tokens_per_s']:.4f}")
print(f"  {'gate-off run: gate stats':24s} {off_t['gate']}  (NoGate: no waits, no holds)")
print(f"  {'warm start (s) on/off':24s} {on_t['warm_start']['seconds']} / "
      f"{off_t['warm_start']['seconds']}")
print(f"  {'warmup compiles (s)':24s} {[(c['callable'], c['seconds']) for c in wq['compiled']]}")
for f in ("target_anchor.json", "target_anchor_32b.json"):
    a = json.loads((D / f).read_text())
    print(f"\n{f}: peak {a['peak']['flops_per_s'] / 1e12:.0f} TFLOP/s, {a['device']}, "
          f"torch {a['torch']}, transformers {a['transformers']}")
    for r in a["runs"]:
        for path in ("hf_plain", "ours_dense_sdpa", "ours_flex", "ours_flex_truncated"):
            if path in r:
                x = r[path]
                print(f"  {r['model']:10s} {path:20s} {x['tokens_per_s']:>9,.0f} tok/s  "
                      f"MFU {x['mfu']:.1%}  ({x['layers_run']} layers)")
        print("  ratios:", {k: v for k, v in r.items() if k.startswith("ratio")})

# ---- reports with the balance and hardware sections (issue #17 and later) -------------------
for rep in sorted(D.glob("*/*bench__report.json")):
    r = json.loads(rep.read_text())
    if "balance" not in r or "skipped" in r["balance"]:
        continue
    b, hw = r["balance"], r.get("hardware", {})
    print(f"\n{rep.parent.name}/{rep.name}: {hw.get('gpu_count')} x {hw.get('models')} "
          f"driver {hw.get('driver')}; tok/s {r['tokens_per_s']}, target MFU {r['target_mfu']}, "
          f"drafter MFU {r['drafter_mfu']} (while busy {r.get('drafter_mfu_while_busy')})")
    print(f"  per GPU: target {b['target_tokens_per_s_per_gpu']:,.0f} tok/s, drafter "
          f"{b['drafter_tokens_per_s_per_gpu']:,.0f} tok/s at {b['anchors']['max_anchors']} "
          f"anchors; drafter idle {b['drafter_idle_fraction']:.3f}; recommended max_anchors "
          f"{b['anchors']['recommended_max_anchors']}")
    for p in b["projection"]["splits"]:
        print(f"  {p['targets']} targets + {p['drafters']} drafters: {p['tokens_per_s']:>9,.0f} "
              f"tok/s ({p['tokens_per_s'] / p['targets']:,.0f} per target GPU); at the "
              f"recommended anchors {p['tokens_per_s_at_recommended_anchors']:,.0f}")

# ---- every pipeline MFU over both denominators, the drafter recounted (bench/mfu_denominators.py)
m = json.loads((D / "mfu_denominators.json").read_text())["runs"]
print("\nMFU over the measured matmul peak / over the 989 TFLOP/s datasheet peak "
      "(drafter: lm_head 2x; as reported: 3x)")
for name, r in m.items():
    cells = []
    for k in ("target_mfu", "drafter_mfu", "drafter_mfu_while_busy"):
        if k in r:
            v = r[k]
            cells.append(f"{k} {v['over_measured_peak']:.3f} / {v['over_datasheet_peak']:.3f} "
                         f"(reported {v['committed_over_measured_peak']:.3f})")
    print(f"  {name} (measured peak {r['measured_peak_flops_per_s'] / 1e12:.1f} TFLOP/s): "
          + "; ".join(cells))
