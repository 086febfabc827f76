"""What a distilling objective adds to a target worker's output, measured: bytes per position of
the features and of the soft labels (top-k log-probs), on the real SmolLM2-135M target (CPU is fine: bytes
do not depend on the device), and the target FLOPs the soft labels add (the layers after the
last feature layer at every position, the LM head at the soft positions; dflash.train.flops).
No timings: a shared CPU's seconds say nothing about the GPU.

    python -m bench.objective_memory --top-k 8,32,128 --out bench/results/cpu/objective_memory.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash.models.features import FeatureExtractor
from dflash.models.target import load_target
from dflash.models.target_output import soft_positions
from dflash.spec.load import section_spec
from dflash.train.flops import target_flops
from dflash.train.warm import synthetic_row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", help="the target dtype (features' bytes)")
    ap.add_argument("--row", type=int, default=1024, help="packed row length")
    ap.add_argument("--top-k", default="8,32,128")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    spec = section_spec("target", {"model": a.model, "dtype": a.dtype})
    whole = load_target(spec, "cpu", need_tokenizer=False)
    ids = whole.layer_ids
    truncated = load_target(spec, "cpu", need_tokenizer=False, num_layers=max(ids) + 1)
    V, H, n_layers = whole.config.vocab_size, whole.config.hidden_size, \
        whole.config.num_hidden_layers
    row = synthetic_row(a.row, V, seed=1, docs=4)   # 4 documents, 3/4 of each a response
    P = int(soft_positions(row.doc_ids, row.loss_mask).numel())
    base = FeatureExtractor(truncated).outputs(row, "cpu")
    docs = torch.bincount(row.doc_ids[row.doc_ids >= 0]).tolist()
    f_trunc = target_flops(whole.config, max(ids) + 1, docs)
    f_whole = target_flops(whole.config, n_layers, docs) + 2 * P * H * V
    out = {"model": a.model, "dtype": a.dtype, "vocab": V, "hidden": H,
           "target_layers": n_layers, "feature_layers": ids, "row_tokens": a.row,
           "soft_positions": P, "torch": torch.__version__,
           "features_bytes_per_position": base.features.nbytes // a.row,
           "target_flops_features_only": f_trunc, "target_flops_with_soft_labels": f_whole,
           "target_flops_ratio": round(f_whole / f_trunc, 3),
           "full_vocab_bf16_logprobs_bytes_per_position": V * 2,
           "head_chunk_transient_bytes": FeatureExtractor.SOFT_CHUNK * V * 4, "top_k": []}
    for k in [int(x) for x in a.top_k.split(",")]:
        fx = FeatureExtractor(whole, soft_top_k=k)
        res = fx.outputs(row, "cpu")
        rec = {"k": k, "soft_bytes_per_soft_position": res.soft.nbytes() // P,
               "soft_bytes_per_row": res.soft.nbytes(),
               "soft_share_of_output": round(res.soft.nbytes() / res.nbytes(), 4),
               "features_equal_feature_only_path": bool(torch.equal(res.features,
                                                                    base.features))}
        print(f"[objective_memory] top-{k}: {rec}", flush=True)
        out["top_k"].append(rec)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
