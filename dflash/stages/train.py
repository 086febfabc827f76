"""The train stage: warm start, race-free threaded training, checkpoints, export, manifest.

``dflash train specs/<name>.yaml`` → results/<name>/train/{manifest.json, metrics.jsonl,
status.json, checkpoints/, drafter/}. A killed run started again resumes from the newest good
checkpoint (Snakemake keeps the checkpoints: they are not declared outputs).

The phases (prepare → resume → warm start → train steps → check replicas → export → manifest)
are :func:`dflash.train.trainer.train`, which the bench stage's timed run shares. With
``topology.nodes`` > 1 the stage runs once per node under torchrun (:mod:`dflash.runtime.launch`
starts it); :func:`dflash.runtime.distributed.supervise` makes every rank exit promptly, naming
the rank at fault, whatever fails.
"""
from __future__ import annotations

from ..eval.tau_monitor import TauMonitor
from ..runtime import distributed
from ..runtime.faults import injected_failures
from ..train.trainer import train
from ..train.tracker import check_tracker
from . import StageContext


def run(ctx: StageContext) -> dict:
    """The train stage: results/<spec>/train/{manifest.json, metrics.jsonl, status.json,
    checkpoints/, drafter/}; resumes from the newest good checkpoint of the same run."""
    out = ctx.results / "train"
    check_tracker(ctx.spec)  # monitor.tensorboard without the package: refused before any work
    comm = distributed.init(ctx.spec.topology.drafters[0])
    if comm is None:
        return train(ctx, out, persist=True, fail_at=injected_failures(), monitor=TauMonitor)
    return distributed.supervise(comm, lambda: train(
        ctx, out, persist=True, fail_at=injected_failures(comm.rank), comm=comm,
        monitor=TauMonitor))
