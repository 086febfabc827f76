"""The FlexAttention interface that :func:`dflash.models.target.load_target` registers with
transformers for ``attention="flex"``: the target's own forward then attends with a document
BlockMask (:class:`dflash.models.features.FeatureExtractor` builds it). Apart from the feature
extractor so that loading a target needs nothing of it (``target`` imports this module only
when asked for flex: transformers' attention registry loads its modeling code, ~1 s).
"""
from __future__ import annotations

from transformers import AttentionInterface

from .. import settings
from .masks import compiled_flex_attention

FLEX_IMPL = "packed_doc_flex"  # must not contain "flash": transformers reads that as flash-attn


def _flex_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout=0.0, **_kwargs):
    """transformers attention interface: q/k/v [B, heads, L, D] -> ([B, L, heads, D], None)."""
    out = compiled_flex_attention()(query, key, value, block_mask=attention_mask,
                                    scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
                                    kernel_options=settings.flex_kernel_options())
    return out.transpose(1, 2).contiguous(), None


def register_flex() -> str:
    """Register the interface (idempotent); its name, for ``attn_implementation``."""
    AttentionInterface.register(FLEX_IMPL, _flex_attention_forward)
    return FLEX_IMPL


__all__ = ["FLEX_IMPL", "register_flex"]
