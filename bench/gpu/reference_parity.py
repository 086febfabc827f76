"""Where the float32 logit gap between the reference DFlash model and ours comes from, in one
short run (issue #36): the parity of ``reference_tau.py`` taken apart.

Both models get the SAME inputs (one target forward in float32 gives the feature tensor, the
block embeddings and the positions, shared by every arm), TF32 off everywhere
(``reference_agree.precision("ieee")``), our attention on SDPA. Then:

- **weights**, tensor by tensor (max abs diff per parameter, the worst one named): the
  reference model as its ``from_pretrained`` reads the export in float32, against ours (a) as
  the bench loads it (``load_drafter`` at the spec's drafter dtype, then ``.float()``: what
  ``reference_tau.py`` compared until this script) and (b) read from the same file in float32;
- **activations**, module by module (forward hooks on the modules both models name alike:
  ``fc``, ``hidden_norm``, per layer its norms, ``q_proj``, ``q_norm``, ``o_proj``, ``mlp`` and
  the layer's output, ``norm``, then the logits): the first one where the two part;
- three **arms**: (a) on the device, (b) on the device, (c) on the CPU with (b)'s models and
  the very same input tensors, so a gap on CUDA only shows as (b) high and (c) low.

A ``verdict`` line says which: our drafter's weights (the export's dtype vs the dtype it was
loaded in), a CUDA-only numeric difference (and where the two part), or a difference on CPU too.
Exit 1 when arm (b) (the file's weights on both sides, on the device) is past ``--tol`` ×
max(1, max |logit|).

    # the H200 (about 30 s: one target forward, three drafter forwards)
    PYTHONPATH=$PWD python -m bench.gpu.reference_parity --spec specs/smollm2-quality.yaml \\
        --drafter /tmp/r/smollm2-quality/train/drafter --out bench/results/h200/reference_parity.json
    # on CPU (tests/test_reference_agreement.py): the tiny trained drafter, loaded as bfloat16
    PYTHONPATH=$PWD python -m bench.gpu.reference_parity --tiny --out /tmp/reference_parity.json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.entry import run, write_result
from bench.gpu.decode_speed import real_models
from bench.gpu.reference_agree import precision, precision_state, trained_world
from bench.gpu.reference_tau import VENDORED, load_reference, load_reference_drafter
from dflash.models.drafter import extract_features, load_drafter


def weight_diffs(ref, ours) -> dict:
    """Max abs diff per parameter of the two state dicts (the export uses the reference's
    names), the worst tensor, and any name only one side has."""
    r, o = ref.state_dict(), ours.state_dict()
    per = {k: (r[k].float().cpu() - o[k].float().cpu()).abs().max().item()
           for k in sorted(r.keys() & o.keys())}
    worst = max(per, key=per.get)
    return {"max_abs_diff": per[worst], "worst": worst, "tensors": len(per),
            "tensors_differing": sum(v > 0 for v in per.values()),
            "only_reference": sorted(r.keys() - o.keys()), "only_ours": sorted(o.keys() - r.keys()),
            "per_tensor": per}


def probe_names(layers: int) -> list[str]:
    """Modules called once per forward in both models, in forward order (``k_proj``/``k_norm``
    are not: ours runs them on the context and on the block separately)."""
    names = ["fc", "hidden_norm"]
    for i in range(layers):
        p = f"layers.{i}"
        names += [f"{p}.input_layernorm", f"{p}.self_attn.q_proj", f"{p}.self_attn.q_norm",
                  f"{p}.self_attn.o_proj", f"{p}.post_attention_layernorm", f"{p}.mlp", p]
    return names + ["norm"]


@contextlib.contextmanager
def recording(model, names):
    """Each named module's first output (float32 copy) while the block runs."""
    seen, mods = {}, dict(model.named_modules())

    def hook(name):
        def keep(_mod, _inp, out):
            t = out[0] if isinstance(out, tuple) else out  # their attention returns (out, w)
            seen.setdefault(name, t.detach().float().clone())
        return keep

    handles = [mods[n].register_forward_hook(hook(n)) for n in names]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def shared_inputs(mod, target, layer_ids, prompt, mask_token_id, block_size) -> dict:
    """One float32 target forward: the feature tensor both models get, the block embeddings
    (last prompt token + masks), positions, and the float32 lm_head."""
    tgt32 = copy.deepcopy(target).float().eval()
    dev = next(tgt32.parameters()).device
    ids = torch.tensor([list(prompt)], device=dev)
    hs = tgt32(ids, output_hidden_states=True).hidden_states
    f = extract_features(hs, layer_ids)
    C = ids.shape[1]
    block = torch.full((1, block_size), mask_token_id, device=dev)
    block[0, 0] = ids[0, -1]
    return {"features": f, "emb": tgt32.get_input_embeddings()(block), "C": C,
            "pos": torch.arange(C + block_size, device=dev)[None], "lm_head": tgt32.lm_head,
            "features_max_abs_diff": (f - mod.extract_context_feature(hs, layer_ids))
            .abs().max().item()}


@torch.inference_mode()
def arm(ref, ours, x: dict, names: list[str], tol: float) -> dict:
    """Both forwards on the same tensors ``x``; per probed module the max abs diff and the
    reference's max |value|; the first module past ``tol`` × that scale (relative: a module
    whose values are small, such as ``fc``'s, parts as visibly as one whose values are large)."""
    emb, f, pos, C, head = x["emb"], x["features"], x["pos"], x["C"], x["lm_head"]
    with recording(ref, names) as a:
        h_ref = ref(position_ids=pos, noise_embedding=emb, target_hidden=f, is_causal=False)
    with recording(ours, names) as b:
        h_ours = ours(emb, f, pos[:, C:], pos[:, :C], mask=None, attention="sdpa")
    a["logits"], b["logits"] = head(h_ref).float(), head(h_ours).float()
    rows = [{"module": n, "max_abs_diff": (a[n] - b[n]).abs().max().item(),
             "scale": a[n].abs().max().item()} for n in [*names, "logits"]]
    first = next((r["module"] for r in rows
                  if r["max_abs_diff"] > tol * r["scale"]), None)
    return {"device": str(pos.device), "logits_max_abs_diff": rows[-1]["max_abs_diff"],
            "logits_max_abs": rows[-1]["scale"], "first_parting": first, "modules": rows,
            "drafts_equal": bool((a["logits"][0, 1:].argmax(-1)
                                  == b["logits"][0, 1:].argmax(-1)).all())}


def on_cpu(x: dict) -> dict:
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else
                copy.deepcopy(v).cpu() if isinstance(v, torch.nn.Module) else v)
            for k, v in x.items()}


def verdict(w_loaded: dict, w_file: dict, arms: dict, tol_of, loaded: str, file: str) -> str:
    """One sentence: which of the three the arms show."""
    a, b, c = (arms.get(k) for k in ("as_loaded", "from_file", "from_file_cpu"))
    gap = lambda r: r["logits_max_abs_diff"] > tol_of(r)  # noqa: E731
    if w_file["max_abs_diff"] > 0:
        return (f"the export read two ways gives different tensors ({w_file['worst']}: "
                f"{w_file['max_abs_diff']:.3g}): a loader difference")
    if not gap(b):
        if gap(a):
            return (f"our drafter's weights: loaded as {loaded} and upcast they differ from the "
                    f"export's {file} tensors the reference reads (up to "
                    f"{w_loaded['max_abs_diff']:.3g}, {w_loaded['worst']}), logits "
                    f"{a['logits_max_abs_diff']:.3g}; with the file's weights on both sides the "
                    f"logits agree to {b['logits_max_abs_diff']:.3g}")
        return f"no gap: logits agree to {b['logits_max_abs_diff']:.3g} either way"
    if c is not None and not gap(c):
        return (f"CUDA only: with the same weights and inputs {b['device']} differs by "
                f"{b['logits_max_abs_diff']:.3g}, the CPU by {c['logits_max_abs_diff']:.3g}; "
                f"they part first at {b['first_parting']}")
    return (f"a difference on CPU too (logits {(c or b)['logits_max_abs_diff']:.3g}): they part "
            f"first at {(c or b)['first_parting']}")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref-dir", default=str(VENDORED), help="z-lab checkout or folder with "
                    "model.py (default: the vendored copy, tests/reference_zlab)")
    ap.add_argument("--tiny", action="store_true", help="CPU: the tiny target and the drafter "
                    "trained on it (bench/gpu/reference_agree.trained_world)")
    ap.add_argument("--train-steps", type=int, default=300, help="--tiny: drafter steps")
    ap.add_argument("--loaded-dtype", default="bfloat16", choices=("bfloat16", "float16"),
                    help="--tiny: the dtype our drafter is loaded in for arm (a) (with --spec: "
                    "the spec's drafter dtype)")
    ap.add_argument("--spec", help="spec of the target (and MT-Bench prompts)")
    ap.add_argument("--drafter", help="exported drafter folder (with --spec)")
    ap.add_argument("--prompt", type=int, default=0, help="which MT-Bench first turn")
    ap.add_argument("--tol", type=float, default=1e-4,
                    help="max abs diff allowed, times max(1, max |value|), per module")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not a.tiny and not (a.spec and a.drafter):
        ap.error("give --tiny, or --spec and --drafter")
    return a


def models(a, tmp: Path):
    """(target, our drafter as the bench loads it, the export folder, prompts, device)."""
    if a.tiny:
        target, _, _, ddir, prompts = trained_world(tmp, a.train_steps)
        loaded, _ = load_drafter(ddir, "cpu", getattr(torch, a.loaded_dtype))
        return target, loaded.eval(), ddir, prompts, "cpu"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target, loaded, _, _, prompts = real_models(a.spec, a.drafter, dev, a.prompt + 1)
    return target, loaded, Path(a.drafter), prompts, dev


def main(argv=None) -> int:
    a = parse(argv)
    mod = load_reference(a.ref_dir)
    with tempfile.TemporaryDirectory() as tmp, precision("ieee"):
        target, loaded, ddir, prompts, dev = models(a, Path(tmp))
        file_dtype = sorted({str(t.dtype).removeprefix("torch.")
                             for t in load_file(str(ddir / "model.safetensors")).values()})
        ref = load_reference_drafter(mod, ddir, dev, torch.float32)
        ours = {"as_loaded": copy.deepcopy(loaded).float().eval(),
                "from_file": load_drafter(ddir, dev, torch.float32)[0].eval()}
        cfg = loaded.cfg
        x = shared_inputs(mod, target, cfg.target_layer_ids, prompts[a.prompt],
                          ref.mask_token_id, cfg.block_size)
        names = probe_names(cfg.num_hidden_layers)
        arms = {k: arm(ref, m, x, names, a.tol) for k, m in ours.items()}
        if dev != "cpu":  # the same models and tensors on the CPU: is the gap CUDA's?
            arms["from_file_cpu"] = arm(copy.deepcopy(ref).cpu(),
                                        copy.deepcopy(ours["from_file"]).cpu(), on_cpu(x),
                                        names, a.tol)
        w = {k: weight_diffs(ref, m) for k, m in ours.items()}
    loaded_dtype = str(loaded.dtype).removeprefix("torch.")
    tol_of = lambda r: a.tol * max(1.0, r["logits_max_abs"])  # noqa: E731
    out = {"command": " ".join(sys.argv if argv is None else ["reference_parity.py", *argv]),
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "precision": precision_state(), "drafter": str(ddir), "export_dtypes": file_dtype,
           "loaded_dtype": loaded_dtype, "prompt_tokens": x["C"],
           "features_max_abs_diff": x["features_max_abs_diff"], "weights": w, "arms": arms,
           "verdict": verdict(w["as_loaded"], w["from_file"], arms, tol_of, loaded_dtype,
                              "/".join(file_dtype))}
    out["ok"] = arms["from_file"]["logits_max_abs_diff"] <= tol_of(arms["from_file"])
    _report(out)
    write_result(a.out, out)
    return 0 if out["ok"] else 1


def _report(out: dict) -> None:
    print(f"export tensors {out['export_dtypes']}; ours loaded as {out['loaded_dtype']}; "
          f"features {out['features_max_abs_diff']:.3g}", flush=True)
    for k, w in out["weights"].items():
        print(f"  weights {k:<9}: max abs diff {w['max_abs_diff']:.3g} ({w['worst']}), "
              f"{w['tensors_differing']}/{w['tensors']} tensors differ", flush=True)
    for k, r in out["arms"].items():
        print(f"  arm {k:<13} on {r['device']:<6}: logits {r['logits_max_abs_diff']:.3g} "
              f"(|logits| <= {r['logits_max_abs']:.3g}), first parting at "
              f"{r['first_parting']}, drafts equal {r['drafts_equal']}", flush=True)
    print(f"verdict: {out['verdict']}", flush=True)


if __name__ == "__main__":
    run(main)
