"""The DFlash drafter: a few Qwen3-style layers whose K/V are injected with target features.

Shapes: N rows, Q block tokens per row (all blocks of a row, flattened), C context positions.
- context features: ``hidden_norm(fc(cat(target hidden states of the feature layers)))`` [N, C, H],
  computed once per forward and shared by every layer;
- every layer: Q from the block; K/V = concat(proj(context), proj(block)); k_norm and RoPE apply
  to both (context keys rotate by the context position ids, block queries/keys by the block
  position ids); the attention mask decides who sees what (see :mod:`dflash.models.masks`).
The target's token embedding and lm_head are frozen and shared, so they are not parameters here:
the caller embeds the block tokens and the objective's loss (:mod:`dflash.train.objective`)
takes the lm_head weight.

Parameter names match the reference ``DFlashDraftModel`` export exactly (docs/design.md §6).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from ..errors import DFlashError
from ..artifacts.manifest import atomic_path, atomic_write_json, sha256_file
from .masks import compiled_flex_attention
from .target import hf_config, layer_ids

# ---------------------------------------------------------------------------------------------
# feature layers
# ---------------------------------------------------------------------------------------------


def hidden_state_indices(layer_ids: list[int]) -> list[int]:
    """Indices into HF ``output_hidden_states`` for the given layer ids.

    HF's ``hidden_states[0]`` is the embedding output and ``hidden_states[i+1]`` the output of
    decoder layer i, so layer i lives at index i+1.
    """
    return [i + 1 for i in layer_ids]


def extract_features(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the feature layers' hidden states: [..., T, N*H] (the drafter's fc input)."""
    return torch.cat([hidden_states[i] for i in hidden_state_indices(layer_ids)], dim=-1)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
def head_dim_of(cfg) -> int:
    """Head dimension of an HF config (or its dict): ``head_dim`` where given (Qwen3), else
    hidden_size // heads (Llama)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k, None)
    return int(get("head_dim") or get("hidden_size") // get("num_attention_heads"))


def _rope_theta(hf_config) -> float:
    rp = getattr(hf_config, "rope_parameters", None)  # transformers >= 5
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 10000.0))


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 0
    max_position_embeddings: int = 32768

    def __post_init__(self):
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if not self.target_layer_ids or bad:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} must be non-empty and in "
                             f"[0, {self.num_target_layers})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")

    @classmethod
    def of_spec(cls, spec) -> "DFlashConfig":
        """The one spec -> drafter config conversion: ``spec.drafter`` sized like
        ``spec.target``, fed by the target layers :func:`dflash.models.target.layer_ids` picks."""
        tcfg = hf_config(spec.target)
        d = spec.drafter
        return cls.from_target_config(tcfg, d.num_layers, d.block_size, d.mask_token_id,
                                      layer_ids(spec.target, tcfg))

    @classmethod
    def from_target_config(cls, hf_config, num_layers: int, block_size: int, mask_token_id: int,
                           layer_ids: list[int]) -> "DFlashConfig":
        """Drafter config sized like the target (Llama or Qwen3 HF config), fed by the target's
        feature layers ``layer_ids`` (the rule that picks them: :func:`dflash.models.target.
        layer_ids`)."""
        c = hf_config
        n_target = int(c.num_hidden_layers)
        heads = int(c.num_attention_heads)
        return cls(
            hidden_size=int(c.hidden_size), num_hidden_layers=int(num_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=head_dim_of(c), intermediate_size=int(c.intermediate_size),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=_rope_theta(c),
            vocab_size=int(c.vocab_size), block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=list(layer_ids),
            num_target_layers=n_target,
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 32768)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The exported config.json: a Qwen3 config + the DFlash fields the reference loader reads."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            # both spellings: transformers 5 reads rope_parameters, older loaders rope_theta
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "initializer_range": 0.02,
            "use_cache": True,
            "dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
            # vLLM's convention for the same layers: indices into HF output_hidden_states
            # (layer i's output is hidden_states[i + 1]); older vLLM reads only this field
            # (dflash.models.export_contract)
            "eagle_aux_hidden_state_layer_ids": hidden_state_indices(self.target_layer_ids),
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        dc = d.get("dflash_config", {})
        rp = d.get("rope_parameters") or {}
        return cls(
            hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"],
            head_dim=head_dim_of(d),
            intermediate_size=d["intermediate_size"], rms_norm_eps=d["rms_norm_eps"],
            rope_theta=float(rp.get("rope_theta", d.get("rope_theta", 10000.0))),
            vocab_size=d["vocab_size"], block_size=d["block_size"],
            mask_token_id=dc["mask_token_id"], target_layer_ids=list(dc["target_layer_ids"]),
            num_target_layers=d["num_target_layers"],
            max_position_embeddings=d.get("max_position_embeddings", 32768),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 (as Qwen3 does) so bf16 training matches the reference numerics
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Default (unscaled) RoPE tables for ``position_ids`` [N, T] -> cos, sin [N, 1, T, head_dim]."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                        dtype=torch.float32) / head_dim))
    ang = position_ids.float()[..., None] * inv                       # [N, T, D/2]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def attend(q, k, v, mask, attention: str, scale: float, compile_flex: bool = False):
    """One attention interface, two exact backends.

    q [N, Hq, Q, D], k/v [N, Hkv, K, D] (GQA handled by the kernels). ``mask`` is a BlockMask for
    "flex", a bool [N, Q, K] / [Q, K] (True = attend) for "sdpa", or None for full attention.
    """
    if attention == "flex":
        fn = compiled_flex_attention() if compile_flex else flex_attention
        return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    if attention == "sdpa":
        if mask is not None:
            mask = mask[:, None] if mask.dim() == 3 else mask  # broadcast over heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    raise ValueError(f"unknown attention backend {attention!r} (expected 'flex' or 'sdpa')")


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, D
        # the names HF attention modules carry, so the shared layer pieces
        # (dflash.models.layers: qkv, attend_cache, out_mlp) run this layer too
        self.head_dim, self.scaling = D, D ** -0.5
        self.q_proj = nn.Linear(H, self.nh * D, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.o_proj = nn.Linear(self.nh * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def _heads(self, x, n):
        return x.view(*x.shape[:2], n, self.hd)

    def context_kv(self, ctx, rope_ctx):
        """K/V of the injected context (k_norm, then RoPE at the context positions).

        They depend only on the context features and their positions, never on the block, so
        speculative decoding computes them once per verified position and appends (the drafter
        KV cache, :class:`dflash.decode.eager.DrafterCache`).
        """
        k = self.k_norm(self._heads(self.k_proj(ctx), self.nkv)).transpose(1, 2)
        v = self._heads(self.v_proj(ctx), self.nkv).transpose(1, 2)
        return apply_rope(k, *rope_ctx), v

    def forward(self, x, ctx, rope_q, rope_ctx, mask, attention, compile_flex, ctx_kv=None):
        N, Q, _ = x.shape
        q = self.q_norm(self._heads(self.q_proj(x), self.nh)).transpose(1, 2)
        # K/V injection: context keys/values precede the block's own keys/values
        k_ctx, v_ctx = ctx_kv if ctx_kv is not None else self.context_kv(ctx, rope_ctx)
        k_blk = self.k_norm(self._heads(self.k_proj(x), self.nkv)).transpose(1, 2)
        v_blk = self._heads(self.v_proj(x), self.nkv).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = torch.cat([k_ctx, apply_rope(k_blk, *rope_q)], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        o = attend(q, k, v, mask, attention, self.hd ** -0.5, compile_flex)
        return self.o_proj(o.transpose(1, 2).reshape(N, Q, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_ctx, mask, attention, compile_flex, ctx_kv=None):
        # the context features are not re-normalised per layer: hidden_norm already did that
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_ctx, mask,
                               attention, compile_flex, ctx_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, attention: str = "sdpa", compile_flex: bool = False):
        super().__init__()
        self.cfg = cfg
        self.attention = attention
        self.compile_flex = compile_flex
        H = cfg.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _compute_dtype(self, block_embeds: torch.Tensor) -> torch.dtype:
        """The dtype the drafter computes in. Under autocast (training: fp32 master weights,
        bf16 compute) the caller already gives the block embeddings in the compute dtype;
        otherwise the drafter's own parameters decide, whatever dtype the target's embeddings
        and features come in (a bf16 target feeding an fp32 drafter, or the reverse)."""
        if torch.is_autocast_enabled(block_embeds.device.type):
            return block_embeds.dtype
        return self.dtype

    def context(self, target_hidden: torch.Tensor, context_position_ids: torch.Tensor,
                dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V [N, Hkv, C, D] of ``target_hidden`` [N, C, n*H] at the given
        positions. Appending the K/V of new positions along dim 2 equals recomputing them from
        all features (each position's K/V depends only on its own features and position)."""
        dt = dtype or self.dtype
        ctx = self.hidden_norm(self.fc(target_hidden.to(dt)))
        rope_ctx = rope_cos_sin(context_position_ids, self.cfg.head_dim, self.cfg.rope_theta, dt)
        return [layer.self_attn.context_kv(ctx, rope_ctx) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, target_hidden: torch.Tensor | None,
                block_position_ids: torch.Tensor, context_position_ids: torch.Tensor | None,
                mask=None, attention: str | None = None,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """Final hidden states (after ``norm``) of the block tokens.

        block_embeds [N, Q, H] (target embedding of the block tokens); target_hidden [N, C, n*H]
        (concatenated feature-layer states, see :func:`extract_features`); position ids [N, Q] and
        [N, C]; mask: BlockMask ("flex"), bool [N, Q, C+Q] ("sdpa") or None (everything visible,
        which is right for one block at inference). ``ctx_kv`` (from :meth:`context`, e.g. a
        drafter KV cache) replaces ``target_hidden`` and ``context_position_ids``.
        """
        attention = attention or self.attention
        dt = self._compute_dtype(block_embeds)
        x = block_embeds.to(dt)
        D, th = self.cfg.head_dim, self.cfg.rope_theta
        rope_q = rope_cos_sin(block_position_ids, D, th, dt)
        if ctx_kv is None:
            ctx = self.hidden_norm(self.fc(target_hidden.to(dt)))
            rope_ctx = rope_cos_sin(context_position_ids, D, th, dt)
            ctx_kv = [None] * len(self.layers)
        else:
            ctx = rope_ctx = None
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, ctx, rope_q, rope_ctx, mask, attention, self.compile_flex, kv)
        return self.norm(x)


# ---------------------------------------------------------------------------------------------
# export / load (safetensors + config.json only; nothing is ever unpickled)
# ---------------------------------------------------------------------------------------------
def export_drafter(model: DFlashDrafter, cfg: DFlashConfig, out_dir, dtype=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` with the reference names, atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous()
          for k, v in model.state_dict().items()}
    hf = cfg.to_hf_dict()
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
    else:
        hf["dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(sd, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out / "config.json", hf)
    atomic_write_json(out / EXPORT_CHECKSUMS, export_checksums(out))
    return out


EXPORT_FILES = ("config.json", "model.safetensors")
EXPORT_CHECKSUMS = "checksums.json"  # beside the weights, so a copied folder can be checked too


def export_checksums(out_dir) -> dict[str, str]:
    """sha256 of each file of an exported drafter (what the train manifest records)."""
    return {f: sha256_file(Path(out_dir) / f) for f in EXPORT_FILES}


def verify_export(out_dir, expected: dict[str, str] | None = None) -> DFlashConfig:
    """Check an exported drafter by content: every file's sha256 against ``expected`` (the train
    manifest's record) or, without it, the folder's own ``checksums.json``; then that its config
    parses. Raises :class:`DFlashError` naming the file; returns the config."""
    out = Path(out_dir)
    if expected is None:
        try:
            expected = json.loads((out / EXPORT_CHECKSUMS).read_text())
        except (OSError, ValueError) as e:
            raise DFlashError(f"{out / EXPORT_CHECKSUMS}: no readable checksums ({e}); "
                              f"not a drafter exported by dflash") from None
    for f in EXPORT_FILES:
        path = out / f
        if not path.is_file():
            raise DFlashError(f"{path}: missing from the exported drafter")
        found = sha256_file(path)
        if found != expected.get(f):
            raise DFlashError(f"{path}: damaged (sha256 {found[:12]}…, recorded "
                              f"{str(expected.get(f))[:12]}…)")
    try:
        return DFlashConfig.from_hf_dict(json.loads((out / "config.json").read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise DFlashError(f"{out / 'config.json'}: not a DFlash drafter config ({e})") from None


def load_drafter(path, device="cpu", dtype=None, attention: str = "sdpa"
                 ) -> tuple[DFlashDrafter, DFlashConfig]:
    path = Path(path)
    cfg = DFlashConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    model = DFlashDrafter(cfg, attention=attention)
    sd = load_file(str(path / "model.safetensors"), device="cpu")
    model.load_state_dict(sd, strict=True)
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model, cfg


__all__ = ["hidden_state_indices", "extract_features", "head_dim_of",
           "DFlashConfig",
           "DFlashDrafter", "attend", "export_drafter", "load_drafter", "export_checksums",
           "verify_export"]
