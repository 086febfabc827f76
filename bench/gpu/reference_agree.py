"""Our decoder against the reference loop (z-lab's ``dflash_generate``), step by step: the pieces
of ``reference_tau.py`` that say whether the two agree, and how far apart they are when not.

- :func:`trained_world`: a tiny random Llama target and a drafter trained on the target's own
  greedy continuations for a few hundred steps (about 10 s on one CPU core), so that drafts are
  accepted at mixed lengths (τ ≈ 2-3 on its prompts): both loops' acceptance, context and cache
  paths are exercised, not only the bonus token. ``reference_tau.py --tiny`` and
  tests/test_reference_agreement.py run on it.
- :func:`agreement`: per prompt both sides' acceptance lengths, τ, the first step and the first
  token where they differ (a fork), and over all prompts **one τ definition on both sides**:
  ``tau`` = Σ acceptance lengths / Σ target verify forwards, pooled over prompts (the
  token-weighted τ the README and the report quote), where an acceptance length is the drafts
  accepted + 1 before any cut at eos or ``max_new_tokens``, and a step counts when its anchor
  lies before the budget's last token (:func:`budget_steps`: that drops the reference loop's one
  extra step, taken when its anchor lands exactly on the last token; ours never takes it). Each
  τ comes with its 95 % interval over prompts (:func:`dflash.eval.spread.tau_interval`).
- :func:`precision_matrix`: the float32 logit gap between the reference model and ours under
  each TF32 switch (cuBLAS matmul, cuDNN, ``float32_matmul_precision``) and each of our attention
  kernels (SDPA, flex eager, flex compiled), with torch's own SDPA kernel choice and with both
  sides forced onto the math kernel, plus the RoPE tables alone, so a GPU run says which switch
  and which kernel make the gap.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
from pathlib import Path
from typing import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.eval.spread import tau_interval
from dflash.eval.tau import greedy_continuations, target_features
from dflash.models.drafter import DFlashConfig, DFlashDrafter, export_drafter, rope_cos_sin
from dflash.models.masks import PackedRow, dense_mask
from dflash.train.anchors import sample_anchors
from dflash.train.objective import Objective

TINY_VOCAB, TINY_BLOCK, TINY_EOS = 64, 8, 2


def trained_world(tmp: Path, steps: int = 300, prompts: int = 8, max_new: int = 40):
    """(target, drafter, eos, exported folder, prompts): a 4-layer random Llama (vocabulary 64)
    and a 1-layer drafter (block 8) trained ``steps`` Adam steps on the target's greedy
    continuations of ``prompts`` random prompts, every response position an anchor (the training
    layout), then exported. Deterministic (seeded)."""
    torch.manual_seed(0)
    tc = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=4, intermediate_size=128, vocab_size=TINY_VOCAB,
                     rope_theta=10000.0, eos_token_id=TINY_EOS, bos_token_id=1, pad_token_id=0)
    target = LlamaForCausalLM(tc).eval()
    cfg = DFlashConfig.from_target_config(tc, 1, TINY_BLOCK, TINY_VOCAB - 1, layer_ids=[0, 2])
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(3, TINY_VOCAB - 1, (int(n),), generator=g).tolist()
          for n in torch.randint(5, 24, (prompts,), generator=g)]
    conts = greedy_continuations(target, ps, max_new, [TINY_EOS])
    drafter = _train(DFlashDrafter(cfg), target, cfg, ps, conts, steps)
    return target, drafter, [TINY_EOS], export_drafter(drafter, cfg, tmp / "drafter"), ps


def _train(drafter, target, cfg, ps, conts, steps):
    torch.manual_seed(2)
    seqs = [p + c for p, c in zip(ps, conts)]
    feats = target_features(target, seqs, cfg.target_layer_ids)
    emb, head = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    rows = []
    for p, s, f in zip(ps, seqs, feats):
        L = len(s)
        row = PackedRow(torch.tensor(s), torch.zeros(L, dtype=torch.long), torch.arange(L),
                        torch.tensor([0] * len(p) + [1] * (L - len(p))).bool(), [0])
        blocks = sample_anchors(row, L, cfg.block_size, None, cfg.mask_token_id)
        rows.append((row, blocks, f[None], dense_mask(row.doc_ids, blocks)[None]))
    obj = Objective(cfg.block_size, cfg.mask_token_id, max_anchors=1, token_budget=1, gamma=4.0)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for step in range(steps):
        row, blocks, f, mask = rows[step % len(rows)]
        h = drafter(emb[blocks.block_input_ids][None], f, blocks.block_position_ids[None],
                    row.position_ids[None], mask)
        loss, _ = obj.loss(h, head, blocks)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def budget_steps(acceptance_lengths: Sequence[int], max_new: int) -> list[int]:
    """The steps (acceptance lengths) whose anchor lies before the budget's last token: the
    anchor of step i is emitted token ``sum(lengths[:i])`` (the prefill's token is 0), and a
    step on the last token (``max_new - 1``) cannot emit within the budget. The reference loop
    takes that step (it runs while the anchor's position < prompt + max_new); ours does not."""
    out, at = [], 0
    for a in acceptance_lengths:
        if at >= max_new - 1:
            break
        out.append(int(a))
        at += int(a)
    return out


def first_fork(a: Sequence, b: Sequence) -> int | None:
    """The first index where two sequences differ (the shorter one's end if one is a prefix of
    the other, None if equal)."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None and len(a) != len(b):
        i = min(len(a), len(b))
    return i


def _tau(lengths: Sequence[int]) -> float | None:
    return sum(lengths) / len(lengths) if lengths else None


def agreement(ref_res: Sequence[dict], spec: Sequence, max_new: int) -> dict:
    """Per prompt and pooled, one τ definition on both sides (module doc). ``ref_res``: the
    reference loop's ``{"tokens", "acceptance_lengths"}`` per prompt; ``spec``: our
    :class:`dflash.decode.decoded.Decoded` per prompt."""
    rows = []
    for i, (r, s) in enumerate(zip(ref_res, spec)):
        ref = budget_steps(r["acceptance_lengths"], max_new)
        ours = budget_steps([a + 1 for a in s.accepted], max_new)
        step = first_fork(ref, ours)
        rows.append({"prompt": i, "tau_reference": _tau(ref), "tau_ours": _tau(ours),
                     "steps_reference": len(ref), "steps_ours": len(ours),
                     "reference_extra_steps": len(r["acceptance_lengths"]) - len(ref),
                     "acceptance_lengths_reference": ref, "acceptance_lengths_ours": ours,
                     "same_acceptance": step is None, "first_fork_step": step,
                     "first_fork_token": first_fork(r["tokens"], s.tokens)})
    ref_lens = [r["acceptance_lengths_reference"] for r in rows]
    our_lens = [r["acceptance_lengths_ours"] for r in rows]
    tr, to = tau_interval(ref_lens), tau_interval(our_lens)
    gap = (tr["tau"] - to["tau"]) / to["tau"] if tr["tau"] and to["tau"] else None
    return {"tau_definition": "sum of acceptance lengths (accepted drafts + 1, before the cut at "
            "eos / max_new_tokens) / sum of target verify forwards, pooled over prompts; a step "
            "counts when its anchor lies before the budget's last token (the reference loop's "
            "extra step dropped); 95 % interval: " + to["method"],
            "tau_reference": tr["tau"], "tau_reference_ci95": tr["ci95"],
            "tau_ours": to["tau"], "tau_ours_ci95": to["ci95"], "relative_gap": gap,
            "prompts": len(rows), "forks": sum(not r["same_acceptance"] for r in rows),
            "token_forks": sum(r["first_fork_token"] is not None for r in rows),
            "steps": sum(r["steps_ours"] for r in rows),
            "steps_equal": sum(len(r["acceptance_lengths_ours"]) for r in rows
                               if r["same_acceptance"]),
            "per_prompt": rows}


# ---------------------------------------------------------------------------------------------
# the float32 logit gap: which switch, which kernel
# ---------------------------------------------------------------------------------------------
PRECISIONS = {  # name -> (cuda.matmul.allow_tf32, cudnn.allow_tf32, float32_matmul_precision)
    "ieee": (False, False, "highest"),
    "matmul_tf32": (True, False, "high"),
    "cudnn_tf32": (False, True, "highest"),
    "all_tf32": (True, True, "high"),
}


def precision_state() -> dict:
    """The TF32 switches as they stand (what the decode ran with)."""
    return {"cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


@contextlib.contextmanager
def precision(name: str):
    """Set one row of :data:`PRECISIONS` for the block, restore the switches after."""
    mm, dnn, prec = PRECISIONS[name]
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
           torch.get_float32_matmul_precision())
    try:
        torch.set_float32_matmul_precision(prec)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = mm, dnn
        yield
    finally:
        torch.set_float32_matmul_precision(old[2])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old[:2]


def _attentions(device) -> list[tuple[str, str, bool]]:
    """(label, backend, compiled): flex only where it runs forward (CPU eager flex does)."""
    out = [("sdpa", "sdpa", False), ("flex", "flex", False)]
    if torch.device(device).type == "cuda":
        out.append(("flex_compiled", "flex", True))
    return out


def _sdpa_backend(name: str):
    """``default``: torch picks the SDPA kernel per call (theirs and ours may get different
    ones); ``math``: both forced onto the plain math kernel (matmul + softmax)."""
    return contextlib.nullcontext() if name == "default" else sdpa_kernel([SDPBackend.MATH])


@torch.inference_mode()
def precision_matrix(mod, ref32, ours, target, prompt) -> list[dict]:
    """One row per (TF32 setting, SDPA kernel choice, our attention kernel): max |logits|
    difference between the reference model and ours on one context + block (as
    ``logits_parity``), and the RoPE tables' difference (their ``Qwen3RotaryEmbedding``, a
    matmul, vs our ``rope_cos_sin``, an elementwise product) under that setting."""
    dev = next(target.parameters()).device
    tgt32, ours32 = copy.deepcopy(target).float(), copy.deepcopy(ours).float().eval()
    ids = torch.tensor([list(prompt)], device=dev)
    C, K = ids.shape[1], ours.cfg.block_size
    block = torch.full((1, K), ref32.mask_token_id, device=dev)
    block[0, 0] = ids[0, -1]
    pos = torch.arange(C + K, device=dev)[None]
    rows = []
    for name, backend in itertools.product(PRECISIONS, ("default", "math")):
        with precision(name), _sdpa_backend(backend):
            hs = tgt32(ids, output_hidden_states=True).hidden_states
            f = mod.extract_context_feature(hs, ours.cfg.target_layer_ids)
            emb = tgt32.get_input_embeddings()(block)
            l_ref = tgt32.lm_head(ref32(position_ids=pos, noise_embedding=emb, target_hidden=f,
                                        is_causal=False))
            cos_r, sin_r = ref32.rotary_emb(emb, pos)
            cos_o, sin_o = rope_cos_sin(pos, cos_r.shape[-1], ours.cfg.rope_theta, cos_r.dtype)
            rope = max((cos_r - cos_o[:, 0]).abs().max().item(),  # ours [N, 1, T, D]
                       (sin_r - sin_o[:, 0]).abs().max().item())
            for label, attn, compiled in _attentions(dev):
                row = {"precision": name, "sdpa_backend": backend, "attention": label,
                       "rope_max_abs_diff": rope}
                ours32.compile_flex = compiled
                try:  # a kernel that cannot run here is a row that says so, not the end
                    h = ours32(emb, f, pos[:, C:], pos[:, :C], mask=None, attention=attn)
                    row["logits_max_abs_diff"] = (l_ref - tgt32.lm_head(h)).abs().max().item()
                except Exception as e:  # noqa: BLE001  (recorded in the JSON)
                    row["logits_max_abs_diff"] = None
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                rows.append(row)
    return rows
