"""Initial loss and learning vs the drafter's final-norm weight at init (real SmolLM2 target, CPU).

    python -m bench.init_norm_scale 150 bench/results/cpu/init_norm_weight_150steps.json

16 held-out chatterbot prompts, the target's greedy 48-token answers as data, the tiny spec's
1-layer drafter, AdamW lr 6e-4 (warmup 0.04, cosine), grad clip 1, 12 anchors per step, one
sequence per step; per variant the (loss, grad norm) of every step. Variants: unit weights
(ours = the reference's Qwen3 init), 0.1, 0.3, and the target's own final-norm weights.
"""
import json
import sys
import time

import torch

from dflash.eval.evalsets import load_eval_sets
from dflash.eval.tau import greedy_continuations, target_features
from dflash.decode.generate import eos_ids_of
from dflash.models.masks import PackedRow, dense_mask
from dflash.train.anchors import sample_anchors
from dflash.models.drafter import DFlashConfig, DFlashDrafter
from dflash.train.objective import Objective
from dflash.train.replica import lr_lambda
from dflash.spec.load import load_spec
from dflash.models.target import load_target, target_embeddings

torch.set_num_threads(1)
spec = load_spec("specs/tiny.yaml")
tgt = load_target(spec.target, "cpu")
cfg = DFlashConfig.of_spec(spec)
emb, head = target_embeddings(spec.target)
sets = load_eval_sets(spec, None, tgt.tokenizer, ["heldout"], 16)
ps = sets[0].prompts
conts = greedy_continuations(tgt.model, ps, 48, eos_ids_of(tgt), 16)
seqs = [p + c for p, c in zip(ps, conts)]
feats = target_features(tgt.model, seqs, cfg.target_layer_ids)
rows = []
for p, s, f in zip(ps, seqs, feats):
    L = len(s)
    loss_mask = torch.tensor([0] * len(p) + [1] * (L - len(p))).bool()
    rows.append((PackedRow(torch.tensor(s), torch.zeros(L, dtype=torch.long), torch.arange(L),
                           loss_mask, [0]), f))
res = {}
STEPS = int(sys.argv[1])
for name, w in [("ref_norm1", 1.0), ("norm0.1", 0.1), ("norm0.3", 0.3), ("target_norm", None)]:
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        if w is None:
            d.norm.weight.copy_(tgt.model.model.norm.weight)
        else:
            d.norm.weight.fill_(w)
    opt = torch.optim.AdamW(d.parameters(), lr=6e-4, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(STEPS, 0.04))
    g = torch.Generator().manual_seed(0)
    curve = []
    t = time.time()
    for step in range(STEPS):
        row, f = rows[step % len(rows)]
        b = sample_anchors(row, 12, 16, g, cfg.mask_token_id)
        h = d(emb[b.block_input_ids][None], f[None], b.block_position_ids[None],
              row.position_ids[None], dense_mask(row.doc_ids, b)[None])
        loss, _ = Objective(16, cfg.mask_token_id, 12, 1, 7.0).loss(h, head, b)
        opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        opt.step()
        sched.step()
        curve.append((round(loss.item(), 3), round(gn.item(), 2)))
    res[name] = curve
    print(name, "first", curve[:3], "last10 mean", sum(c[0] for c in curve[-10:]) / 10,
          time.time() - t, flush=True)
json.dump(res, open(sys.argv[2], "w"))
