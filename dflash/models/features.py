"""The target's features on packed rows: :class:`FeatureExtractor` (the feature layers' hidden
states, and soft labels for a distilling objective, from one forward) and the compiled per-layer
path (:func:`packed_layer`, one regional compile shared by every layer). The FlexAttention
interface :func:`dflash.models.target.load_target` registers for ``attention="flex"`` is
:mod:`dflash.models.flex_interface`.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from .. import settings
from ..errors import SpecError
from ..spec.types import TargetSpec
from .layers import compile_region, out_mlp, qkv, rope_of, unsupported_reason
from .masks import document_block_mask, document_dense_mask
from .target_output import SoftLabels, TargetOutput, soft_positions_on

if TYPE_CHECKING:
    from .target import Target


def packed_layer(layer, x, cos, sin, rope, mask, kernel_options=None):
    """One decoder layer on a packed row: the layer math of :mod:`dflash.models.layers` with the
    document mask as a FlexAttention BlockMask (CUDA) or a dense boolean mask (SDPA). Compiled
    once per process (:func:`dflash.models.layers.compile_region`), shared by every layer.
    ``kernel_options``: flex_attention's (``DFLASH_FLEX_KERNEL_OPTIONS``; None: inductor's)."""
    q, k, v = qkv(layer, x, cos, sin, rope)
    scale, gqa = layer.self_attn.scaling, q.shape[1] != k.shape[1]
    if isinstance(mask, torch.Tensor):  # the dense boolean mask
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    else:  # a BlockMask: flex attention traced into the layer's graph
        o = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa,
                           kernel_options=kernel_options)
    B, L = x.shape[:2]
    return out_mlp(layer, x, o.transpose(1, 2).reshape(B, L, -1))


_COMPILED_LAYERS: dict[str, Any] = {}
_COMPILED_LOCK = threading.Lock()


def compiled_packed_layer(backend: str):
    """The process's one compiled :func:`packed_layer` per backend (every target worker and
    every layer shares it: one dynamo cache, one graph per shape bucket)."""
    with _COMPILED_LOCK:
        if backend not in _COMPILED_LAYERS:
            _COMPILED_LAYERS[backend] = compile_region(packed_layer, backend)
        return _COMPILED_LAYERS[backend]


def compile_backend(target: TargetSpec, device: str, backend: str, model=None) -> str | None:
    """``target.compile`` resolved for one device: the torch.compile backend the feature
    extractor's decoder layers use, or None (eager HF forward).

    ``auto``: on for CUDA with ``compile.backend`` inductor (the fusions are the point), off on
    CPU (a compile costs more than a CPU run's few steps save). ``on``: ``compile.backend`` on
    any device. With ``model`` given, an architecture :mod:`dflash.models.layers` cannot run turns
    ``auto`` off and makes ``on`` a SpecError.
    """
    # YAML 1.1 reads a bare `compile: off` as False: both spellings mean the same
    mode = {True: "on", False: "off"}.get(target.compile, target.compile)
    if mode == "off" or (mode == "auto" and not (device.startswith("cuda")
                                                 and backend == "inductor")):
        return None
    why = unsupported_reason(model) if model is not None else None
    if why:
        if mode == "on":
            raise SpecError(f"target.compile: 'on' cannot compile this target's decoder layers: "
                            f"{why}; use 'auto' or 'off'")
        return None
    return backend


class FeatureExtractor:
    """Runs the frozen target on packed rows and returns the feature layers' hidden states.

    Only the decoder layers up to max(layer_ids) run (the model is loaded truncated) and only
    those layers' outputs are kept, never all hidden states: 65 layers of a 16×3072 batch do not
    fit in 141 GB. Output: [1, L, N·H] in the target dtype, i.e. the concatenation the drafter's
    ``fc`` expects (never [1, L, N, H]).

    ``soft_top_k`` k (a distilling objective; the target loaded whole): :meth:`outputs` also
    returns the target's top-k next-token log-probs at the row's response positions
    (:func:`~dflash.models.target_output.soft_positions`), from the same forward: the last
    layers, the final norm and the LM head run after the features are taken, the head at those
    positions only, ``SOFT_CHUNK`` positions at a time (the [P, vocab] logits never exist whole).

    ``compile`` None: HF's forward, the feature layers' outputs read by forward hooks. A backend
    name: the layers run one by one through :func:`compiled_packed_layer` (regional compilation;
    the same math on the same modules, so the same features up to summation order). Every call
    must then run inside the compile gate (its first call per row length compiles).

    Read once here: ``DFLASH_FLEX_KERNEL_OPTIONS``. The document BlockMask is built eagerly from
    the documents' boundaries (:func:`~dflash.models.masks.document_block_mask`): no mask graph.
    """

    SOFT_CHUNK = 2048

    def __init__(self, target: Target, compile: str | None = None,
                 soft_top_k: int | None = None):
        self.target = target
        self.base = target.model.get_decoder() if hasattr(target.model, "get_decoder") \
            else target.model.model
        self.compile = compile
        self.soft_top_k = soft_top_k
        if soft_top_k is not None and len(self.base.layers) < target.config.num_hidden_layers:
            raise ValueError("soft labels need the whole target (load_target num_layers=None)")
        self._captured: dict[int, Any] = {}
        self.flex_options = settings.flex_kernel_options()
        if compile:
            self._layer = compiled_packed_layer(compile)
            self._rope = rope_of(self.base.layers[0])
        else:
            for lid in target.layer_ids:
                self.base.layers[lid].register_forward_hook(self._hook(lid))

    def _hook(self, lid: int):
        def hook(_module, _inputs, output):
            self._captured[lid] = output[0] if isinstance(output, tuple) else output
        return hook

    def __call__(self, input_ids, doc_ids, position_ids):
        return self._run(input_ids, doc_ids, position_ids, final=False)[0]

    def outputs(self, row, device: str):
        """The :class:`~dflash.models.target_output.TargetOutput` of a PackedRow on ``device``:
        features, and soft labels when ``soft_top_k`` is set."""
        ids, doc, pos = (t.to(device) for t in (row.input_ids, row.doc_ids, row.position_ids))
        if self.soft_top_k is None:
            return TargetOutput(self(ids, doc, pos))
        feats, last = self._run(ids, doc, pos, final=True)
        return TargetOutput(feats, self._soft(last[0], soft_positions_on(row, device)))

    def _run(self, input_ids, doc_ids, position_ids, final: bool):
        """(features, the final-norm hidden states [1, L, H] or None) of one forward."""
        self._captured.clear()
        mask = (document_block_mask(doc_ids)
                if self.target.attention == "flex" else document_dense_mask(doc_ids))
        # no_grad, not inference_mode: the drafter saves these features for its backward.
        with torch.no_grad():
            if self.compile:
                x = self._layers(input_ids[None], position_ids[None], mask)
                last = self.base.norm(x) if final else None
            else:
                out = self.base(input_ids=input_ids[None], position_ids=position_ids[None],
                                attention_mask=mask, use_cache=False)
                last = out.last_hidden_state if final else None  # after the final norm
            feats = torch.cat([self._captured[i] for i in self.target.layer_ids], dim=-1)
        self._captured.clear()
        return feats, last

    def _soft(self, last, positions):
        """Top-k log-softmax of the LM head at ``positions`` of ``last`` [L, H], chunked."""
        head = self.target.model.get_output_embeddings()
        ids, lps = [], []
        with torch.no_grad():
            for s in range(0, max(1, positions.numel()), self.SOFT_CHUNK):  # >= 1: P may be 0
                lp = torch.log_softmax(head(last[positions[s:s + self.SOFT_CHUNK]]).float(), -1)
                top = lp.topk(self.soft_top_k, dim=-1)
                ids.append(top.indices.to(torch.int32))  # vocab < 2**31: half the bytes
                lps.append(top.values)
        return SoftLabels(positions, torch.cat(ids), torch.cat(lps))

    def _layers(self, input_ids, position_ids, mask):
        """Every loaded layer (as HF's forward runs them); returns the last layer's output."""
        x = self.base.embed_tokens(input_ids)
        cos, sin = self.base.rotary_emb(x, position_ids)  # the model's own rope, once per row
        want = set(self.target.layer_ids)
        for i, layer in enumerate(self.base.layers):
            x = self._layer(layer, x, cos, sin, self._rope, mask, self.flex_options)
            if i in want:
                self._captured[i] = x
        return x
