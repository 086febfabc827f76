"""Optional TensorBoard event files (``monitor.tensorboard``, off by default).

When on, every metrics.jsonl row of the train stage also goes to
``results/<spec>/train/tensorboard/`` as scalars: ``train/loss``, ``train/lr``,
``train/tokens_per_s``, ``draft_acc/k<K>`` per block position and ``tau/heldout`` (when
``monitor.tau_every_steps`` measures it). Written by torch's ``SummaryWriter``, which needs the
``tensorboard`` package: optional, not in the locks (it adds seven packages, grpcio and a native
data server among them, to every environment for an off-by-default feature). Asked for without
it, the train stage refuses at its start (and ``dflash validate`` before), naming the field.
A resumed run purges the events past its checkpoint step, as metrics.jsonl is cut there.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import SpecError

EVENTS_DIR = "tensorboard"


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def check_tracker(spec) -> None:
    if spec.monitor.tensorboard and not available():
        raise SpecError(f"{spec.path}: field 'monitor.tensorboard': true needs the optional "
                        f"package 'tensorboard', which is not installed here (pip install "
                        f"tensorboard; it is in no lock, so the env stage does not install it) "
                        f"— or set it to false")


def scalars(row: dict, tokens_per_s: float | None) -> dict[str, float]:
    """The scalars of one metrics row, by TensorBoard tag."""
    out = {"train/loss": row["loss"], "train/lr": row["lr"]}
    if tokens_per_s:
        out["train/tokens_per_s"] = tokens_per_s
    for k, a in enumerate(row.get("draft_acc") or [], 1):
        if a is not None:
            out[f"draft_acc/k{k}"] = a
    if row.get("tau_heldout") is not None:
        out["tau/heldout"] = row["tau_heldout"]
    return out


class Tracker:
    """A SummaryWriter on ``train/tensorboard`` (see the module docstring)."""

    def __init__(self, train_dir: Path, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard

        self.writer = SummaryWriter(str(train_dir / EVENTS_DIR),
                                    purge_step=start_step or None)

    def log(self, row: dict, tokens_per_s: float | None) -> None:
        for tag, value in scalars(row, tokens_per_s).items():
            self.writer.add_scalar(tag, value, row["step"])

    def close(self) -> None:
        self.writer.close()


def open_tracker(spec, train_dir: Path, start_step: int = 0) -> Tracker | None:
    if not spec.monitor.tensorboard:
        return None
    check_tracker(spec)
    return Tracker(train_dir, start_step)
