"""Scaling across nodes: tokens/s of N nodes against the same per-node topology on 1 node.

On two H200s of one host (2 simulated nodes x 1 GPU, target and drafter sharing each GPU; the
train stage runs 2 local processes under torchrun, NCCL between them), from the repo root:

    SPECS=qwen3-8b-1node-shared DAG_TIMEOUT=560 timeout 590 bash bench/gpu/run_all.sh dag
    SPECS=qwen3-8b-2node-shared DAG_TIMEOUT=560 timeout 590 bash bench/gpu/run_all.sh dag
    # then, on the files that came back (results.tgz unpacked into bench/results/h200/multinode):
    python -m bench.multinode_scaling bench/results/h200/multinode \
        --one qwen3-8b-1node-shared --many qwen3-8b-2node-shared \
        --out bench/results/h200/multinode/scaling.json

Either results/<spec>/train/manifest.json or run_all.sh's <spec>__train__manifest.json is read.
Scaling efficiency = tok/s(N nodes) / (N x tok/s(1 node)); all-reduce seconds per step are the
mean over ranks of each rank's time from its local gradient sum being ready to the global sum
being there (transfer plus waiting for the slowest rank).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _manifest(root: Path, spec: str, stage: str, name: str) -> dict | None:
    for p in (root / f"{spec}__{stage}__{name}", root / spec / stage / name):
        if p.is_file():
            return json.loads(p.read_text())
    return None


def summary(root: Path, spec: str) -> dict:
    t = _manifest(root, spec, "train", "manifest.json")
    if t is None:
        raise SystemExit(f"{root}: no train manifest for {spec}")
    d = t.get("distributed", {"nodes": 1})
    st = t["steady_state"]
    return {"spec": spec, "nodes": d.get("nodes", 1), "backend": d.get("backend"),
            "tokens_per_s": st.get("tokens_per_s"), "step_time_s": st.get("step_time_s"),
            "steady_steps": st.get("steps"), "steps": t["steps"]["total"],
            "allreduce_s_per_step": d.get("allreduce_s_per_step_mean"),
            "allreduce_s_per_step_by_rank": d.get("allreduce_s_per_step_by_rank"),
            "allreduce_bytes_per_step": d.get("allreduce_bytes_per_step"),
            "replicas_identical_across_ranks": d.get("replicas_identical_across_ranks"),
            "recompiles_after_warmup": t["gate"]["recompiles_after_warmup"],
            "race_errors": t["gate"]["race_errors"], "final_loss": t.get("final_loss")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path, help="results/ or a folder of run_all.sh's files")
    ap.add_argument("--one", default="qwen3-8b-1node-shared")
    ap.add_argument("--many", default="qwen3-8b-2node-shared")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    one, many = summary(a.root, a.one), summary(a.root, a.many)
    eff = (many["tokens_per_s"] / (many["nodes"] * one["tokens_per_s"])
           if one["tokens_per_s"] and many["tokens_per_s"] else None)
    step = many["step_time_s"]
    res = {"one_node": one, "n_nodes": many, "nodes": many["nodes"],
           "scaling_efficiency": eff,
           "allreduce_share_of_step": (many["allreduce_s_per_step"] / step
                                       if step and many["allreduce_s_per_step"] else None)}
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
