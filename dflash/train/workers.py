"""Build the workers a spec describes: drafter replicas and target feature extractors.

Warmup and training both build through here, so they compile the same callables for the same
config, dtypes, feature width (N·H, never [.., N, H]) and shape buckets. Each worker gets its
own config sections, resolved here: the replica the objective, the optimizer section and a
torch dtype; the target worker whether to produce soft labels (the objective's kind).
"""
from __future__ import annotations

import dataclasses

import torch

from ..models.drafter import DFlashConfig, DFlashDrafter
from ..models.drafter_init import target_layers_state
from ..models.dtypes import dtype_of
from ..models.masks import attention_backend
from ..models.features import FeatureExtractor, compile_backend
from ..models.target import hf_config, layer_ids, load_target, target_embeddings
from ..models.target_graph import CapturedFeatures
from ..models.target_output import TargetOutput
from .graph_step import graph_step_on
from .objective import SOFT_KINDS, Objective
from .packing import bucket_lengths
from .replica import DrafterReplica


def objective(spec, cfg: DFlashConfig) -> Objective:
    """The spec's objective; its head's chunk is ``compile.head_chunk`` (a speed knob)."""
    return dataclasses.replace(Objective.of(cfg, spec.batching, spec.loss),
                               head_chunk=spec.compile.head_chunk)


def buckets(spec) -> list[int]:
    b = spec.batching
    return bucket_lengths(b.token_budget, b.num_buckets)


def initial_state(cfg: DFlashConfig, seed: int, spec=None) -> dict:
    """The weights every replica starts from: seeded random, then, with ``drafter.init:
    target-layers`` (``spec`` given), the target's last decoder layers copied in
    (:func:`dflash.models.drafter_init.target_layers_state`; warm-up compiles on the random
    ones: the shapes are the same)."""
    torch.manual_seed(seed)
    # the module is dropped here: its tensors are the state, no copy (4 GB at the 8B pair's)
    state = dict(DFlashDrafter(cfg).state_dict())
    if spec is None or spec.drafter.init == "random":
        return state

    # the whole target, on the host, once: the layers copied may be past the feature layers
    # the target workers keep
    tgt = load_target(spec.target, "cpu", seed=spec.seed, need_tokenizer=False)
    state, kept = target_layers_state(state, tgt.model.model.layers, str(spec.path))
    n, total = cfg.num_hidden_layers, len(tgt.model.model.layers)
    print(f"[train] drafter.init target-layers: drafter layers 0..{n - 1} from target layers "
          f"{total - n}..{total - 1}" + (f"; kept initial (no such target weight): "
                                         f"{', '.join(kept)}" if kept else ""), flush=True)
    return state


def make_replicas(spec, cfg: DFlashConfig, init_state: dict, total_steps: int
                  ) -> list[DrafterReplica]:
    embed, head = target_embeddings(spec.target, spec.seed)
    obj, dtype = objective(spec, cfg), dtype_of(spec.drafter.dtype)
    n, nodes = len(spec.topology.drafters), spec.topology.nodes
    return [DrafterReplica(i, dev, cfg, obj, spec.optim, dtype, spec.compile.backend, embed,
                           head, init_state, total_steps, head_loss=spec.compile.head_loss,
                           graph_step=graph_step_on(spec.compile.cuda_graph_step, dev, n,
                                                    nodes))
            for i, dev in enumerate(spec.topology.drafters)]


def make_target_workers(spec) -> list[tuple[str, object]]:
    """One frozen target copy per target device, its decoder layers compiled where
    ``target.compile`` resolves to a backend; each worker maps a PackedRow to its
    :class:`~dflash.models.target_output.TargetOutput`. Truncated after the last feature layer,
    unless the objective distils: then the whole target runs (its soft labels need the last
    layers, the final norm and the LM head), in the same forward."""
    ids = layer_ids(spec.target, hf_config(spec.target))
    soft = spec.loss.kind in SOFT_KINDS
    top_k = spec.loss.kd_top_k if soft else None
    workers = []
    for dev in spec.topology.targets:
        t = load_target(spec.target, dev, seed=spec.seed,
                        num_layers=None if soft else max(ids) + 1,
                        need_tokenizer=False, attention=attention_backend(dev))
        fx = FeatureExtractor(t, compile=compile_backend(spec.target, dev, spec.compile.backend,
                                                         t.model), soft_top_k=top_k)
        if captured(spec, dev, fx):
            cap = CapturedFeatures(fx, dev)  # takes the row's host tensors: one copy in
            workers.append((dev, lambda row, cap=cap: TargetOutput(cap(
                row.input_ids, row.doc_ids, row.position_ids))))
            continue
        workers.append((dev, lambda row, fx=fx, dev=dev: fx.outputs(row, dev)))
    return workers


def captured(spec, device: str, fx) -> bool:
    """``target.cuda_graph``: auto captures a compiled extractor on a CUDA device, when it
    hands over features only (soft labels take the LM head at a row-dependent number of
    positions: not one static graph)."""
    mode = {False: "off"}.get(spec.target.cuda_graph, spec.target.cuda_graph)
    return (mode == "auto" and device.startswith("cuda") and bool(fx.compile)
            and getattr(fx, "soft_top_k", None) is None)
