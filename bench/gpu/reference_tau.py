"""The reference model's τ on our export: load our exported drafter folder with z-lab's own
``DFlashDraftModel`` (their ``dflash/model.py``: by default the verbatim copy vendored under
tests/reference_zlab/, MIT, see its README; or a checkout given by ``--ref-dir``) and decode
MT-Bench first turns greedily with THEIR speculative loop (``dflash_generate``: DynamicCache,
eager, batch 1), next to our decoder (:class:`dflash.decode.speculative.Decoder`, batch 1) on the same
prompts and ``max_new_tokens``.

Before decoding, the export contract's real test, in float32 (both models read from the
export's own float32 tensors, never ours upcast from the spec's bf16): the target features their
``extract_context_feature`` picks equal ours (the layer-id offset convention), and their model's
logits on our export equal our drafter's for one context + block (max abs diff recorded; past
``--parity-tol`` × max(1, max |logit|) the script still decodes, then exits 1). Loading fails at
once on any missing or unexpected tensor name (their ``from_pretrained`` would otherwise leave it
randomly initialised). ``--kernels`` repeats that parity under each TF32 switch and each of our
attention kernels (:func:`reference_agree.precision_matrix`): which one makes a GPU gap.

    # the H200 run (issue #36): 32 prompts, float32 end to end (identical streams expected),
    # then bf16, and the kernel matrix; ~8-10 min in all (est.): under a 10-min limit, one
    # call per dtype (--dtypes float32 --kernels, then --dtypes bfloat16)
    PYTHONPATH=$PWD python -m bench.gpu.reference_tau --spec specs/smollm2-quality.yaml \\
        --drafter results/smollm2-quality/train/drafter --prompts 32 --max-new 256 \\
        --dtypes float32,bfloat16 --kernels --out bench/results/h200/reference_agreement.json
    # on CPU (tests/test_reference_agreement.py): a tiny random target + a drafter trained on it
    PYTHONPATH=$PWD python -m bench.gpu.reference_tau --tiny --dtypes float32,bfloat16 \\
        --kernels --out /tmp/reference_tau_tiny.json

Only the reference's model file is imported (under another module name: their package is also
called ``dflash``). It needs torch, transformers (Qwen3 modules) and typing_extensions.

``--dtypes``: one run per dtype, every model (target, drafter, reference) cast to it, both
drafters from the export's tensors; ``spec`` (the default) runs the models as the spec loads
them. Where a gap remains, ``reference_parity.py`` says where it comes from. Per run, ``agreement``
(:func:`reference_agree.agreement`) has the one τ definition on both sides: Σ acceptance lengths
(accepted drafts + 1, before the cut at eos / max_new_tokens) / Σ target verify forwards, pooled
over prompts, each loop's steps counted while its anchor lies before the budget's last token
(this drops the reference loop's extra step: it runs while the anchor's position < prompt +
max_new_tokens, ours while a token is left to emit), with a 95 % bootstrap interval over
prompts; per prompt both sides' acceptance lengths and the first step / token where they fork.
``compare`` keeps the figures earlier files carry: the reference benchmark's τ (per prompt the
mean of per-step acceptance lengths, then the mean over prompts, its extra step included),
``tau_reference_same_steps`` (their first as many steps as ours took) and ``tau_emitted_ours``
(tokens emitted per verify, as decode_speed.py reports it). The top-level ``tau`` and
``ours_seconds`` are the first run's.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from packaging.version import Version
from transformers.cache_utils import Cache

from bench.entry import run
from bench.gpu.decode_speed import real_models
from bench.gpu.reference_agree import agreement, precision_matrix, precision_state, trained_world
from dflash.errors import DFlashError
from dflash.decode.speculative import Decoder
from dflash.eval.serving import timed_decode
from dflash.models.drafter import extract_features, load_drafter


def load_reference(ref_dir: str):
    """Their ``model.py`` as module ``zlab_dflash_model`` (not ``dflash``: that is ours)."""
    root = Path(ref_dir)
    path = next((p for p in (root / "dflash" / "model.py", root / "model.py") if p.is_file()),
                None)
    if path is None:
        raise DFlashError(f"--ref-dir {root}: no dflash/model.py or model.py (a checkout of "
                          f"github.com/z-lab/dflash)")
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as e:  # e.g. a transformers without the Qwen3 names it imports
        raise DFlashError(f"{path}: does not import with transformers "
                          f"{__import__('transformers').__version__}: {e}") from None
    return mod


def load_reference_drafter(mod, drafter_dir, device, dtype=torch.float32):
    """Their ``DFlashDraftModel.from_pretrained`` on our folder; any missing/unexpected tensor
    is a breach of the export contract."""
    model, info = mod.DFlashDraftModel.from_pretrained(
        str(drafter_dir), dtype=dtype, attn_implementation="sdpa", output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                  "mismatched_keys") and v}
    if bad:
        raise DFlashError(f"{drafter_dir}: the reference DFlashDraftModel does not load it "
                          f"cleanly: {bad}")
    return model.to(device).eval()


@torch.inference_mode()
def logits_parity(mod, ref32, ours, target, prompt, seed: int = 0) -> dict:
    """float32: their features vs ours for ``prompt``, then their drafter's block logits vs ours
    (context = the prompt's features, block = [last token, mask × (K-1)] after it)."""

    dev = next(target.parameters()).device
    tgt32 = copy.deepcopy(target).float()
    ours32 = copy.deepcopy(ours).float().eval()
    ids = torch.tensor([list(prompt)], device=dev)
    hs = tgt32(ids, output_hidden_states=True).hidden_states
    layer_ids = ours.cfg.target_layer_ids
    f_ours, f_ref = extract_features(hs, layer_ids), mod.extract_context_feature(hs, layer_ids)
    if ref32.target_layer_ids != layer_ids:
        raise DFlashError(f"target_layer_ids: reference reads {ref32.target_layer_ids}, "
                          f"ours {layer_ids}")
    C, K = ids.shape[1], ours.cfg.block_size
    block = torch.full((1, K), ref32.mask_token_id, device=dev)
    block[0, 0] = ids[0, -1]
    emb = tgt32.get_input_embeddings()(block)
    pos = torch.arange(C + K, device=dev)[None]
    h_ref = ref32.float()(position_ids=pos, noise_embedding=emb, target_hidden=f_ref,
                          is_causal=False)
    h_ours = ours32(emb, f_ours, pos[:, C:], pos[:, :C], mask=None)
    # the same forward through SDPA (load_drafter's default is SDPA already; a drafter built
    # for flex differs here). Which kernel or TF32 switch makes a GPU gap: --kernels.
    h_sdpa = ours32(emb, f_ours, pos[:, C:], pos[:, :C], mask=None, attention="sdpa")
    lm = tgt32.lm_head
    l_ref, l_ours, l_sdpa = lm(h_ref), lm(h_ours), lm(h_sdpa)
    return {"context_tokens": C, "block_size": K, "dtype": "float32",
            "our_attention": ours32.attention,
            "features_max_abs_diff": (f_ours - f_ref).abs().max().item(),
            "hidden_max_abs_diff": (h_ref - h_ours).abs().max().item(),
            "logits_max_abs_diff": (l_ref - l_ours).abs().max().item(),
            "logits_max_abs_diff_sdpa": (l_ref - l_sdpa).abs().max().item(),
            "logits_max_abs": l_ours.abs().max().item(),
            "drafts_equal": bool((l_ref[0, 1:].argmax(-1) == l_ours[0, 1:].argmax(-1)).all())}


def reference_decode(mod, ref, target, prompts, max_new, eos) -> list[dict]:
    """Their loop, one prompt at a time (it is batch-1 only), greedy, with their stats. On CPU
    their ``return_stats`` path calls ``torch.cuda.synchronize``: it is made a no-op there."""

    dev = next(target.parameters()).device
    real, crop = torch.cuda.synchronize, Cache.crop
    if dev.type != "cuda":
        torch.cuda.synchronize = lambda *a, **k: None
    if needs_crop_shim():
        Cache.crop = _legacy_crop(crop)
    try:
        out = []
        for p in prompts:
            ids = torch.tensor([list(p)], device=dev)
            t = time.perf_counter()
            r = mod.dflash_generate(ref, target=target, input_ids=ids, max_new_tokens=max_new,
                                    stop_token_ids=list(eos), temperature=0.0,
                                    return_stats=True)
            out.append({"tokens": r.output_ids[0, len(p):].tolist(),
                        "acceptance_lengths": list(r.acceptance_lengths),
                        "seconds": time.perf_counter() - t})
        return out
    finally:
        torch.cuda.synchronize, Cache.crop = real, crop


def needs_crop_shim() -> bool:
    """Their loop calls ``DynamicCache.crop(start)`` with an absolute length (positive): the
    legacy meaning, deprecated in transformers 5.x and gone from 5.18 on (5.17, the H200 image's,
    still has it; it raises ValueError after)."""

    return Version(__import__("transformers").__version__) >= Version("5.18")


def _legacy_crop(crop):
    """``crop(n > 0)`` as transformers <= 5.17 did it: keep the first n positions."""
    def legacy(self, n):
        if n > 0:
            have = self.get_seq_length()
            if n >= have:
                return None
            n = n - have  # negative: the number of positions to drop
        return crop(self, n)
    return legacy


def ours_decode(target, drafter, prompts, max_new, eos):
    """Our decoder at batch 1, speculative and target-only (the greedy reference)."""

    max_len = max(len(p) for p in prompts) + max_new
    kw = dict(batch=1, max_len=max_len, max_new_tokens=max_new, eos_ids=eos)
    spec, ts = timed_decode(Decoder(target, drafter, **kw), prompts)
    greedy, tg = timed_decode(Decoder(target, None, **kw), prompts)
    return spec, greedy, ts, tg


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def compare(ref_res, spec, greedy) -> dict:
    """Per prompt τ both ways and whether the token streams agree."""
    rows = []
    for i, (r, s, g) in enumerate(zip(ref_res, spec, greedy)):
        ours_acc = [a + 1 for a in s.accepted]
        rows.append({"prompt": i, "tau_reference": _mean(r["acceptance_lengths"]),
                     "tau_ours": _mean(ours_acc), "tau_emitted_ours": s.tau,
                     "tau_reference_same_steps": _mean(r["acceptance_lengths"][:len(ours_acc)]),
                     "acceptance_prefix_equal": r["acceptance_lengths"][:len(ours_acc)]
                     == ours_acc,
                     "steps_reference": len(r["acceptance_lengths"]),
                     "steps_ours": len(ours_acc),
                     "tokens_reference": len(r["tokens"]), "tokens_ours": len(s.tokens),
                     "reference_equals_ours": r["tokens"] == s.tokens,
                     "reference_equals_greedy": r["tokens"] == g.tokens,
                     "reference_seconds": r["seconds"]})
    tr = [x["tau_reference"] for x in rows if x["tau_reference"] is not None]
    to = [x["tau_ours"] for x in rows if x["tau_ours"] is not None]
    return {"per_prompt": rows, "tau_reference": _mean(tr), "tau_ours": _mean(to),
            "tau_emitted_ours": _mean([s.tau for s in spec if s.target_forwards]),
            "tau_reference_same_steps": _mean([x["tau_reference_same_steps"] for x in rows
                                               if x["tau_reference_same_steps"] is not None]),
            "prompts_identical_tokens": sum(x["reference_equals_ours"] for x in rows),
            "prompts_same_acceptance": sum(x["acceptance_prefix_equal"] for x in rows),
            "reference_identical_to_greedy": sum(x["reference_equals_greedy"] for x in rows),
            "prompts": len(rows)}


# the vendored copy of z-lab's model.py (tests/reference_zlab/README.md: commit, license, shims)
VENDORED = Path(__file__).resolve().parents[2] / "tests" / "reference_zlab"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref-dir", default=str(VENDORED), help="checkout of github.com/z-lab/"
                    "dflash (dflash/model.py) or a folder with model.py (default: the vendored "
                    "copy, tests/reference_zlab)")
    ap.add_argument("--tiny", action="store_true", help="CPU check: a tiny random target and a "
                    "drafter trained on it (τ ≈ 2-3)")
    ap.add_argument("--train-steps", type=int, default=300, help="--tiny: drafter steps")
    ap.add_argument("--spec", help="spec of the target (and MT-Bench prompts)")
    ap.add_argument("--drafter", help="exported drafter folder (with --spec)")
    ap.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--dtypes", default="spec", help="comma list of decode dtypes, each run "
                    "end to end (target, drafter, reference): float32, bfloat16; 'spec' = as "
                    "loaded (the spec's dtypes)")
    ap.add_argument("--kernels", action="store_true", help="also the float32 parity under each "
                    "TF32 switch x each of our attention kernels (which one makes the gap)")
    ap.add_argument("--parity-tol", type=float, default=1e-4,
                    help="max abs logit diff allowed in float32, times max(1, max |logit|)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    bad = [d for d in a.dtypes.split(",") if d != "spec" and d not in DTYPES]
    if bad:
        ap.error(f"--dtypes: unknown {bad} (spec, {', '.join(DTYPES)})")
    if not a.tiny and not (a.spec and a.drafter):
        ap.error("give --tiny, or --spec and --drafter")
    return a


def decode_both(mod, ref32, target, drafter, prompts, max_new, eos, dtype) -> dict:
    """Both loops on the same prompts, every model in ``dtype`` (None: as loaded). ``drafter``:
    ours as loaded (the spec's dtype) for None, else read from the export in float32 (as
    ``ref32`` is), so both sides are cast from the same tensors."""
    if dtype is not None:
        target, drafter = copy.deepcopy(target).to(dtype), copy.deepcopy(drafter).to(dtype)
    ref = copy.deepcopy(ref32).to(drafter.dtype)
    ref_res = reference_decode(mod, ref, target, prompts, max_new, eos)
    spec, greedy, ts, tg = ours_decode(target, drafter, prompts, max_new, eos)
    return {"dtype": str(drafter.dtype).removeprefix("torch."),
            "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
            "precision": precision_state(), "compare": compare(ref_res, spec, greedy),
            "agreement": agreement(ref_res, spec, max_new),
            "ours_seconds": {"speculative": ts, "target_only": tg}}


def _print_parity(par: dict) -> None:
    print(f"parity (float32): features {par['features_max_abs_diff']:.3g}, logits max abs diff "
          f"{par['logits_max_abs_diff']:.3g} ({par['our_attention']}; through SDPA "
          f"{par['logits_max_abs_diff_sdpa']:.3g}; |logits| <= {par['logits_max_abs']:.3g}), drafts "
          f"equal {par['drafts_equal']}", flush=True)


def _print_run(run: dict, max_new: int) -> None:
    g, c = run["agreement"], run["compare"]
    ci = [f"[{x[0]:.3f}, {x[1]:.3f}]" if x else "" for x in (g["tau_reference_ci95"],
                                                             g["tau_ours_ci95"])]
    print(f"{run['dtype']}: τ reference {g['tau_reference']:.3f} {ci[0]} vs ours "
          f"{g['tau_ours']:.3f} {ci[1]} (pooled, the reference's extra step dropped; "
          f"{g['relative_gap']:+.1%}) on {g['prompts']} prompts ({max_new} new tokens); forks "
          f"{g['forks']}/{g['prompts']} (token streams {g['token_forks']}); steps accepted alike "
          f"{g['steps_equal']}/{g['steps']}; per-prompt mean as the reference reports it "
          f"{c['tau_reference']:.3f}", flush=True)


def main(argv=None) -> int:
    a = parse(argv)
    mod = load_reference(a.ref_dir)
    dev = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    tmp = tempfile.TemporaryDirectory()
    if a.tiny:
        target, drafter, eos, ddir, prompts = trained_world(Path(tmp.name), a.train_steps)
        max_new = min(a.max_new, 40)
    else:
        target, drafter, eos, _, prompts = real_models(a.spec, a.drafter, dev, a.prompts)
        ddir, max_new = Path(a.drafter), a.max_new
    # float32 on both sides means the export's tensors on both sides: ours loaded at the spec's
    # dtype (bfloat16) and upcast is the float32 masters rounded, which the reference never is.
    # On CPU that rounding alone makes a gap of round 6's relative size (reference_parity.py)
    drafter32 = load_drafter(ddir, dev, torch.float32)[0].eval()
    prompts = prompts[:a.prompts]
    out = {"command": " ".join(sys.argv if argv is None else ["reference_tau.py", *argv]),
           "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor(),
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "reference": {"file": str(Path(mod.__file__).resolve()), "loop": "dflash_generate "
                         "(their speculative loop: DynamicCache, eager, batch 1)",
                         "sha256": hashlib.sha256(Path(mod.__file__).read_bytes()).hexdigest(),
                         "crop_shim": needs_crop_shim()},
           "drafter": str(ddir), "max_new_tokens": max_new, "precision": precision_state()}
    ref = load_reference_drafter(mod, ddir, dev, torch.float32)
    out["parity"] = par = logits_parity(mod, ref, drafter32, target, prompts[0])
    _print_parity(par)
    # relative to the logits' scale: float32 kernels (their SDPA call, our attention) may sum
    # in another order on the GPU; a wrong tensor, rope or layer id is orders of magnitude more
    tol = a.parity_tol * max(1.0, par["logits_max_abs"])
    par["tolerance"] = tol
    par["ok"] = par["features_max_abs_diff"] == 0 and par["logits_max_abs_diff"] <= tol
    if not par["ok"]:  # still decode (the τ's say how much it matters), fail at the end
        print(f"error: export contract: the reference model disagrees with ours (logits "
              f"{par['logits_max_abs_diff']:.3g} > {tol:.3g}, features "
              f"{par['features_max_abs_diff']:.3g})", file=sys.stderr, flush=True)
    if a.kernels:
        out["kernels"] = rows = precision_matrix(mod, ref, drafter32, target, prompts[0])
        for r in rows:
            got = (f"{r['logits_max_abs_diff']:.3g}" if r["logits_max_abs_diff"] is not None
                   else r["error"])
            print(f"  parity {r['precision']:>11} x sdpa {r['sdpa_backend']:<7} x ours "
                  f"{r['attention']:<13}: logits {got}, rope tables "
                  f"{r['rope_max_abs_diff']:.3g}", flush=True)
    out["runs"] = []
    for d in a.dtypes.split(","):
        dt = DTYPES.get(d)
        run = decode_both(mod, ref, target, drafter if dt is None else drafter32, prompts,
                          max_new, eos, dt)
        out["runs"].append(run)
        _print_run(run, max_new)
    # the first run as the keys earlier files carry (per-prompt means, as the reference reports)
    out["tau"], out["ours_seconds"] = out["runs"][0]["compare"], out["runs"][0]["ours_seconds"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0 if par["ok"] else 1


if __name__ == "__main__":
    run(main)
