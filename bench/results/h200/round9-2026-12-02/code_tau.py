"""code_tau.json from round 9's code-DAG bench log and train manifest: the hold was lost in the
bench stage's decode sweep, after it had logged every τ set, before it wrote report.json.
    python3 bench/results/h200/round9-2026-12-02/code_tau.py"""
import json
import re
from pathlib import Path

R = Path(__file__).resolve().parent
log = (R / "lease/logs/smollm2-code/bench.log").read_text()
sets = {}
for m in re.finditer(r"τ (\w+): ([\d.]+) over (\d+) prompts \(simulated in ([\d.]+)s(?:; real on "
                     r"(\d+): τ ([\d.]+), speed-up ([\d.]+), lossless (\w+))?\)", log):
    d = {"tau": float(m[2]), "prompts": int(m[3]), "simulated_s": float(m[4])}
    if m[5]:
        d["real"] = {"prompts": int(m[5]), "tau": float(m[6]), "speedup": float(m[7]),
                     "lossless": m[8] == "True"}
    sets[m[1]] = d
t = json.loads((R / "lease/r/smollm2-code__train__manifest.json").read_text())
out = {"source": "lease/logs/smollm2-code/bench.log (the bench stage logs each set before the "
                 "decode sweep; the hold was lost during the sweep, before report.json)",
       "spec": "specs/smollm2-code.yaml", "sets": sets, "train_steady_state": t["steady_state"],
       "train_steps": t["steps"]["total"], "train_s": t["train_s"]}
(R / "code_tau.json").write_text(json.dumps(out, indent=1))
