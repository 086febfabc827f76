"""cap8_figures.json: round 10's cap-8 arm beside round 8's uncapped recipe, by one rule.

The hold ended in the cap-8 bench stage's decode sweep, after it had logged every τ set and
before it wrote report.json, so the figures come from what the run left: the bench log's τ
lines, the train manifest's steady state and busy/wait seconds, and the drafter's MFU over the
datasheet peak recomputed from each run's metrics.jsonl with the bench stage's own counting
rule (dflash.train.flops.drafter_useful_flops over the steady-state window). Round 8's figure
recomputed this way is checked against its report.json. The target's MFU needs the dataset's
document lengths (not brought back) and is left out. Per epoch: each round's steady_state.json
(`python -m bench.steady_state_from_metrics ... --skip 5 --token-budget 8192`).
    PYTHONPATH=. .venv/bin/python bench/results/h200/round10-2026-12-02/cap8_figures.py"""
import json
from pathlib import Path

from bench.figures_from_log import figures
from bench.metrics_file import read_metrics
from dflash.models.drafter import DFlashConfig
from dflash.spec.load import load_spec
from dflash.train.flops import DATASHEET_PEAKS, drafter_useful_flops

R = Path(__file__).resolve().parent
H200 = R.parent
PEAK = DATASHEET_PEAKS[("H200", "bfloat16")][0]


def tau_sets(log: str) -> dict:
    """The bench log's τ lines (bench.figures_from_log), under this file's keys."""
    out = {}
    for name, v in figures(log)["tau"].items():
        out[name] = {"tau": v["tau_simulated"], "prompts": v["prompts"]}
        if "real" in v:
            r = v["real"]
            out[name]["real_batch1"] = {"prompts": r["prompts"], "tau": r["tau"],
                                        "speedup": r["speedup_over_target_only"],
                                        "lossless": r["lossless"]}
    return out


def train_figures(spec_path: Path, manifest: Path, metrics: Path) -> dict:
    m = json.loads(manifest.read_text())
    rows = read_metrics(metrics)
    st = m["steady_state"]
    window = rows[len(rows) - st["steps"]:]
    dcfg = DFlashConfig.of_spec(load_spec(spec_path))
    flops = sum(drafter_useful_flops(dcfg, r["tokens"], r["labelled"]) for r in window)
    n_run = m["steps"]["run_now"]
    busy = {k: v / n_run for k, v in m["busy_s"].items()}
    wait = {k: v / n_run for k, v in m["wait_s"].items()}
    d_busy = busy["drafter-0"] * len(window)
    return {"tokens_per_s": st["tokens_per_s"], "step_ms": 1e3 * st["step_time_s"],
            "steps": m["steps"]["total"], "train_s": m["train_s"], "wall_s": m["wall_s"],
            "busy_ms_per_step": {k: round(1e3 * v, 2) for k, v in busy.items()},
            "wait_ms_per_step": {k: round(1e3 * v, 2) for k, v in wait.items()},
            "target_busy_fraction": m["busy_s"]["target-0"] / (m["busy_s"]["target-0"]
                                                               + m["wait_s"]["target-0"]),
            "labelled_per_step": sum(r["labelled"] for r in window) / len(window),
            "drafter_mfu_datasheet": flops / st["seconds"] / PEAK,
            "drafter_mfu_while_busy_datasheet": flops / d_busy / PEAK,
            "final_loss": m["final_loss"]}


r8 = H200 / "round8-2026-12-02/lease"
r8_report = json.loads((r8 / "r/smollm2-quality__bench__report.json").read_text())
before = train_figures(H200.parent.parent.parent / "specs/smollm2-quality.yaml",
                       r8 / "r/smollm2-quality__train__manifest.json",
                       r8 / "r/smollm2-quality__train__metrics.jsonl.gz")
before["report_drafter_mfu_datasheet"] = r8_report["mfu_datasheet"]["drafter_mfu"]
before["tau"] = {k: {"tau": v["tau"], "prompts": v["prompts"]}
                 for k, v in r8_report["acceptance"]["sets"].items()}
lease = R / "lease"
after = train_figures(lease / "r/smollm2-recipe.sweep/specs/smollm2-recipe-cap8.yaml",
                      lease / "r/smollm2-recipe-cap8__train__manifest.json",
                      lease / "r/smollm2-recipe-cap8__train__metrics.jsonl.gz")
after["tau"] = tau_sets((lease / "logs/smollm2-recipe-cap8/bench.log").read_text())
out = {"note": __doc__.split("\n\n")[0], "before": {"run": "round 8, smollm2-quality", **before},
       "after": {"run": "round 10, smollm2-recipe-cap8 (loss.max_position 8)", **after},
       "speedup_tokens_per_s": after["tokens_per_s"] / before["tokens_per_s"]}
(R / "cap8_figures.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
