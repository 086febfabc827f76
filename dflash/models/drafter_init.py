"""The drafter's starting weights (``drafter.init``): random, or copies of the target's last
decoder layers.

``target-layers``: drafter layer j starts as target layer ``L − n + j`` (L target layers, n
drafter layers): the attention projections, the q/k norms where the target has them (Qwen3; a
Llama target has none, so they stay at 1), the MLP and both layer norms. The drafter's own
pieces (``fc``, ``hidden_norm``, ``norm``) have no counterpart and stay as random. The names
line up because the drafter's layers carry the HF names (:mod:`dflash.models.drafter`); a shape
that differs (another hidden or intermediate size, other head counts) is a spec error naming
the field, never a silent partial copy.

Owns: :func:`target_layers_state`. Imports the top-level modules only (the target's layers are
handed in).
"""
from __future__ import annotations

import torch

from ..errors import SpecError

def target_layers_state(state: dict[str, torch.Tensor], target_layers, where: str = "<spec>"
                        ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` (a drafter state dict) with its decoder layers copied from the LAST
    ``n`` of ``target_layers`` (the target's ``model.layers``), in order; returns (new state,
    the drafter keys that kept their initial value because the target has no such weight).

    Raises :class:`SpecError` naming ``drafter.init`` (and ``drafter.num_layers``) when the
    drafter has more layers than the target or a weight's shape differs from the target's.
    """
    n = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("layers.")), default=-1)
    L = len(target_layers)
    if n > L:
        raise SpecError(f"{where}: field 'drafter.init': target-layers copies the target's last "
                        f"drafter.num_layers = {n} decoder layers, but the target has {L}")
    out = {k: v.clone() for k, v in state.items()}
    kept: list[str] = []
    sources = [dict(target_layers[L - n + j].state_dict()) for j in range(n)]
    for k, v in state.items():
        if not k.startswith("layers."):
            continue
        _, j, rest = k.split(".", 2)
        src = sources[int(j)].get(rest)
        if src is None:
            kept.append(k)
            continue
        if tuple(src.shape) != tuple(v.shape):
            raise SpecError(
                f"{where}: field 'drafter.init': target-layers needs the drafter's layers shaped "
                f"like the target's, but {k} is {tuple(v.shape)} and target layer "
                f"{L - n + int(j)}'s {rest} is {tuple(src.shape)} (a different hidden, "
                f"intermediate or head size); use drafter.init: random")
        out[k] = src.detach().to(device=v.device, dtype=v.dtype).clone()
    return out, kept


__all__ = ["target_layers_state"]
