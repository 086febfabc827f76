"""What the reference τ protocol costs (MT-Bench both turns, 2,048 new tokens, per-prompt mean;
dflash/eval/reference.py), and its τ beside ours, for one drafter on one device.

    # H200 (the integrator's session; ~1 min): the quality spec's target, a trained drafter
    PYTHONPATH=$PWD python -m bench.gpu.reference_protocol --spec specs/smollm2-quality.yaml \\
        --drafter results/smollm2-quality/train/drafter \\
        --out bench/results/h200/reference_protocol.json
    # no trained drafter: a random-weight one of the spec's shape (τ ≈ 1, the same cost)
    # CPU smoke (seconds): PYTHONPATH=$PWD python -m bench.gpu.reference_protocol --smoke
    # CPU, 8 questions (one per category), full 2,048 tokens: the answer lengths the GPU
    # estimate rests on (bench/results/cpu/reference_protocol_8q.json)
    PYTHONPATH=$PWD python -m bench.gpu.reference_protocol --spec specs/tiny.yaml --device cpu \
        --questions 8 --batch-size 8 --threads 1 --out bench/results/cpu/reference_protocol_8q.json

Writes JSON: the reference protocol's report (τ per-prompt mean and pooled, per turn, the caps,
the fast engine's setup seconds, decode steps and prefills, seconds per phase) and, with
``--ours``, our protocol's MT-Bench figures (first turns, ``--ours-max-new`` tokens) from the
same target and drafter, the two aggregation rules side by side.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dflash.decode.generate import eos_ids_of
from dflash.eval.evalsets import load_eval_sets
from dflash.eval.reference import evaluate_reference, reference_questions
from dflash.eval.tau import evaluate_sets
from dflash.models.drafter import DFlashConfig, DFlashDrafter, load_drafter
from dflash.models.dtypes import dtype_of
from dflash.models.target import load_target, target_embeddings
from dflash.spec.load import load_spec

REPO = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default=str(REPO / "specs" / "smollm2-quality.yaml"))
    ap.add_argument("--drafter", default=None, help="exported drafter (default: random weights)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--max-new", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=256, help="engine slots / HF batch")
    ap.add_argument("--ours", action="store_true", help="also our protocol on MT-Bench")
    ap.add_argument("--ours-max-new", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny spec, 2 questions, 8 tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.spec, a.device, a.questions, a.max_new = str(REPO / "specs" / "tiny.yaml"), "cpu", 2, 8
        a.ours, a.ours_max_new = True, 8



    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    spec = load_spec(a.spec)
    t0 = time.perf_counter()
    tgt = load_target(spec.target, device, seed=spec.seed)
    dt = dtype_of(spec.drafter.dtype)
    if a.drafter:
        drafter, _ = load_drafter(a.drafter, device=device, dtype=dt)
    else:
        torch.manual_seed(0)
        drafter = DFlashDrafter(DFlashConfig.of_spec(spec)).to(device=device, dtype=dt)
    drafter.eval()
    embed, head = target_embeddings(spec.target, spec.seed)
    eos = eos_ids_of(tgt)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = evaluate_reference(tgt.model, tgt.tokenizer, drafter,
                             embed.to(device=device, dtype=drafter.dtype),
                             head.to(device=device, dtype=drafter.dtype),
                             reference_questions(a.questions, spec.seed), a.max_new, eos,
                             device, a.batch_size)
    ref_s = time.perf_counter() - t0
    ours = None
    if a.ours:
        sets = load_eval_sets(spec, None, tgt.tokenizer, ["mtbench"], a.questions)
        s = evaluate_sets(tgt.model, drafter, embed, head, sets, a.ours_max_new, eos, 0,
                          device, a.batch_size)["mtbench"]
        ours = {k: s.get(k) for k in ("tau", "tau_prompt_mean", "prompts", "hit_cap",
                                      "simulated_s", "timings_s")}
    out = {"device": device, "device_name": torch.cuda.get_device_name(device)
           if device.startswith("cuda") else "cpu", "torch": torch.__version__,
           "spec": a.spec, "drafter": a.drafter or "random weights (τ meaningless; cost real)",
           "questions": a.questions, "max_new_tokens": a.max_new, "load_s": round(load_s, 3),
           "reference_wall_s": round(ref_s, 3), "reference": ref, "ours": ours,
           "command": " ".join([sys.executable, *sys.argv])}
    print(json.dumps({k: out[k] for k in ("device_name", "reference_wall_s")}
                     | {"tau_prompt_mean": ref["tau_prompt_mean"], "tau_pooled": ref["tau"],
                        "timings_s": ref["timings_s"], "hit_cap": ref["hit_cap"],
                        "mean_answer_tokens": ref["mean_answer_tokens"],
                        "ours": ours and {k: ours[k] for k in ("tau", "tau_prompt_mean")}}))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
