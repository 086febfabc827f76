"""What the serving engines' DFlash loaders require of an exported drafter folder, as one check.

Read at the source (2026-12-01; docs/serving.md has the details and the file names):

* **SGLang** (``python/sglang/srt/models/dflash.py``, ``speculative/dflash_utils.py``): the
  model class is found by ``architectures`` (``EntryClass = DFlashDraftModel``);
  ``parse_dflash_draft_config`` reads ``dflash_config.target_layer_ids`` (0-based ids of the
  target layers whose OUTPUT is a feature, "HF style"; SGLang captures "before layer i" and adds
  1 itself), ``dflash_config.mask_token_id`` (an int >= 0, not a bool) else the string
  ``mask_token``, ``block_size`` and ``num_target_layers`` (in ``dflash_config`` or top level),
  ``num_hidden_layers``; ``fc.weight`` must be [H, len(target_layer_ids)·H] (else it raises);
  ``hidden_act`` must be ``silu``; one ``layer_types`` entry per layer. Its ``load_weights``
  SKIPS unknown tensor names silently, so a misnamed tensor would stay uninitialised.
* **vLLM** (``model_executor/models/qwen3_dflash.py``, registry entry ``"DFlashDraftModel":
  ("qwen3_dflash", "DFlashQwen3ForCausalLM")``): a Qwen3 config (``model_type`` qwen3, rope from
  ``rope_parameters`` / ``rope_theta``); the fc input size comes from
  ``eagle_aux_hidden_state_layer_ids`` (HF hidden-state indices: layer id + 1) and, in newer
  versions only, from ``dflash_config.target_layer_ids`` + 1; tensors are prefixed ``model.``;
  ``embed_tokens`` / ``lm_head`` absent means the target's are shared.
* **z-lab/dflash** ``DFlashDraftModel`` (the reference): the same tensor names (``layers.*``,
  ``fc``, ``hidden_norm``, ``norm``), ``dflash_config`` with ``mask_token_id`` and
  ``target_layer_ids``, top-level ``block_size``; q/k norms per head (Qwen3), no biases.

:func:`serving_contract` raises ONE :class:`dflash.errors.DFlashError` listing every breach,
naming the file and field; ``target_config`` (the target's HF config dict) adds the pairing
checks (vocabulary, width, layer count).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ..errors import DFlashError

DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
LAYER_TENSORS = {  # name -> shape, in terms of H (hidden), I (intermediate), Q (heads·D), K (kv)
    "self_attn.q_proj.weight": ("Q", "H"), "self_attn.k_proj.weight": ("K", "H"),
    "self_attn.v_proj.weight": ("K", "H"), "self_attn.o_proj.weight": ("H", "Q"),
    "self_attn.q_norm.weight": ("D",), "self_attn.k_norm.weight": ("D",),
    "input_layernorm.weight": ("H",), "post_attention_layernorm.weight": ("H",),
    "mlp.gate_proj.weight": ("I", "H"), "mlp.up_proj.weight": ("I", "H"),
    "mlp.down_proj.weight": ("H", "I"),
}


def _int(cfg: dict, key: str, bad: list[str], low: int = 1) -> int | None:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        bad.append(f"{key}: {v!r} (an integer >= {low})")
        return None
    return v


def config_breaches(cfg: dict[str, Any]) -> list[str]:
    """Every way ``cfg`` (config.json) breaks what the loaders read."""
    bad: list[str] = []
    if cfg.get("architectures") != ["DFlashDraftModel"]:
        bad.append(f"architectures: {cfg.get('architectures')!r} (SGLang and vLLM look up "
                   f"['DFlashDraftModel'])")
    if cfg.get("model_type") != "qwen3":
        bad.append(f"model_type: {cfg.get('model_type')!r} (vLLM builds a Qwen3 config)")
    if cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act: {cfg.get('hidden_act')!r} (SGLang supports only silu)")
    if cfg.get("attention_bias", False):
        bad.append("attention_bias: true (the export has no bias tensors)")
    if cfg.get("tie_word_embeddings", False):
        bad.append("tie_word_embeddings: true (the drafter shares the target's embedding and "
                   "lm_head; it has neither)")
    n = {k: _int(cfg, k, bad) for k in ("hidden_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads",
                                          "head_dim", "intermediate_size", "vocab_size",
                                          "max_position_embeddings", "num_target_layers")}
    if n["num_attention_heads"] and n["num_key_value_heads"] and \
            n["num_attention_heads"] % n["num_key_value_heads"]:
        bad.append("num_attention_heads: not a multiple of num_key_value_heads")
    block = cfg.get("block_size", (cfg.get("dflash_config") or {}).get("block_size"))
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        bad.append(f"block_size: {block!r} (an integer >= 2, top level: the reference reads it "
                   f"there)")
    bad += _rope_breaches(cfg)
    bad += _dflash_breaches(cfg, n)
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n["num_hidden_layers"]
                              or any(t != "full_attention" for t in types)):
        bad.append(f"layer_types: {types!r} (one 'full_attention' per layer: the drafter has no "
                   f"sliding-window layers)")
    if cfg.get("dtype") not in DTYPES:
        bad.append(f"dtype: {cfg.get('dtype')!r} (one of {', '.join(DTYPES)})")
    return bad


def _rope_breaches(cfg: dict) -> list[str]:
    theta = cfg.get("rope_theta")
    rp = cfg.get("rope_parameters")
    bad = []
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        bad.append(f"rope_theta: {theta!r} (a number > 0; older loaders read it)")
    if rp is not None:
        if not isinstance(rp, dict) or rp.get("rope_type", "default") != "default" or \
                rp.get("rope_theta", theta) != theta:
            bad.append(f"rope_parameters: {rp!r} (rope_type 'default' and the same rope_theta: "
                       f"the drafter's RoPE is unscaled)")
    return bad


def _dflash_breaches(cfg: dict, n: dict) -> list[str]:
    dc = cfg.get("dflash_config")
    if not isinstance(dc, dict):
        return [f"dflash_config: {dc!r} (an object with mask_token_id and target_layer_ids)"]
    bad = []
    mask = dc.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0 or \
            (n["vocab_size"] and mask >= n["vocab_size"]):
        bad.append(f"dflash_config.mask_token_id: {mask!r} (an integer in [0, vocab_size))")
    ids = dc.get("target_layer_ids")
    L = n["num_target_layers"]
    if not isinstance(ids, list) or not ids or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < (L or 1 << 30)
            for i in ids):
        bad.append(f"dflash_config.target_layer_ids: {ids!r} (non-empty 0-based ids of target "
                   f"layers whose output is a feature, each < num_target_layers {L})")
    elif cfg.get("eagle_aux_hidden_state_layer_ids") != [i + 1 for i in ids]:
        bad.append(f"eagle_aux_hidden_state_layer_ids: "
                   f"{cfg.get('eagle_aux_hidden_state_layer_ids')!r} (vLLM reads the feature "
                   f"layers here as hidden-state indices: {[i + 1 for i in ids]})")
    return bad


def expected_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The exact tensor set (name -> shape) the loaders map, nothing more, nothing less."""
    H, I, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    dims = {"H": H, "I": I, "D": D, "Q": cfg["num_attention_heads"] * D,
            "K": cfg["num_key_value_heads"] * D}
    out = {f"layers.{i}.{k}": tuple(dims[x] for x in v)
           for i in range(cfg["num_hidden_layers"]) for k, v in LAYER_TENSORS.items()}
    out["norm.weight"] = out["hidden_norm.weight"] = (H,)
    out["fc.weight"] = (H, len(cfg["dflash_config"]["target_layer_ids"]) * H)
    return out


def tensor_breaches(path: Path, cfg: dict) -> list[str]:
    """Names, shapes and dtypes of ``model.safetensors`` against :func:`expected_tensors`
    (read from the header only: no tensor is loaded)."""
    want = expected_tensors(cfg)
    with safe_open(str(path), framework="pt") as f:
        have = {k: f.get_slice(k) for k in f.keys()}
        got = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in have.items()}
    bad = [f"missing tensor {k} {list(v)}" for k, v in sorted(want.items()) if k not in got]
    bad += [f"unexpected tensor {k} (SGLang skips unknown names silently)" for k in sorted(got)
            if k not in want]
    dt = DTYPES.get(cfg.get("dtype"))
    for k, (shape, dtype) in sorted(got.items()):
        if k in want and shape != want[k]:
            bad.append(f"tensor {k}: shape {list(shape)}, config says {list(want[k])}")
        if dt and dtype != dt:
            bad.append(f"tensor {k}: dtype {dtype}, config.json dtype {cfg.get('dtype')}")
    return bad


def pairing_breaches(cfg: dict, target: dict) -> list[str]:
    """The drafter against its target's HF config: shared embedding/lm_head and feature layers."""
    bad = []
    for key, tkey in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                      ("num_target_layers", "num_hidden_layers")):
        if cfg.get(key) != target.get(tkey):
            bad.append(f"{key}: {cfg.get(key)!r}, the target's {tkey} is {target.get(tkey)!r}")
    return bad


def serving_contract(out_dir, target_config: dict | None = None) -> None:
    """Raise one :class:`DFlashError` listing every breach of the loaders' contract."""
    out = Path(out_dir)
    cpath, wpath = out / "config.json", out / "model.safetensors"
    try:
        cfg = json.loads(cpath.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"{cpath}: not readable JSON ({e})") from None
    bad = [f"{cpath.name}: {b}" for b in config_breaches(cfg)]
    if target_config is not None:
        bad += [f"{cpath.name}: {b}" for b in pairing_breaches(cfg, target_config)]
    if not bad:
        if not wpath.is_file():
            bad.append(f"{wpath.name}: missing")
        else:
            try:
                bad += [f"{wpath.name}: {b}" for b in tensor_breaches(wpath, cfg)]
            except Exception as e:  # noqa: BLE001 - a damaged file is one message, not a trace
                bad.append(f"{wpath.name}: not a readable safetensors file ({e})")
    if bad:
        raise DFlashError(f"{out}: not loadable by the serving engines' DFlash loaders: "
                          + "; ".join(bad))


__all__ = ["serving_contract", "config_breaches", "tensor_breaches", "pairing_breaches",
           "expected_tensors"]
