"""Round 28's composed whole DAG: its measured prefix (env to the data stage's end, when training
may start) + round 27's train and bench stages, both on one H100; writes composed_dag.json.

    python bench/results/h100/round28-2026-12-06/compose_dag.py
"""
import json
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).parent
r27 = json.loads((HERE.parent / "round27-2026-12-06" / "quality_dag_figures.json").read_text())
r28 = json.loads((HERE / "prefix_dag_figures.json").read_text())
stages = {s["rule"]: s for s in r27["stages"]}
train_start = datetime.fromisoformat(stages["train"]["start"])
prefix27 = (train_start - datetime.fromisoformat(r27["dag_clock"]["first"])).total_seconds()
rest27 = (datetime.fromisoformat(stages["bench"]["end"]) - train_start).total_seconds()
prefix28 = r28["dag_clock"]["span_s"]
out = {"what": "the default's whole DAG (bench_smollm2-quality) with the decoders stage in "
               "parallel processes, composed: round 28's measured prefix (env start to the data "
               "stage's end, when training may start) + round 27's train and bench stages "
               "(train start to bench end), both on one H100",
       "command": "python bench/results/h100/round28-2026-12-06/compose_dag.py",
       "round27_whole_s": r27["dag_clock"]["span_s"], "round27_prefix_s": prefix27,
       "round27_train_and_bench_s": rest27, "round28_prefix_s": prefix28,
       "prefix_saved_s": prefix27 - prefix28, "composed_whole_s": prefix28 + rest27,
       "composed_whole_min": round((prefix28 + rest27) / 60, 2)}
(HERE / "composed_dag.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out, indent=1))
