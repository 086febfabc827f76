"""Training checkpoints: everything an exact resume needs, written atomically, checksummed.

``checkpoints/step-00000040/`` holds ``model.safetensors`` (drafter weights, fp32 masters),
``optim.safetensors`` (AdamW moments and step counters) and ``state.json`` (step, LR schedule,
counters, the sample ids each epoch trained on, the sha256 of both tensor files). The folder is
written under a temporary name and renamed, so it exists complete or not at all. Nothing is
unpickled: tensors via safetensors, the rest JSON. The sampler position and the anchor RNG are
functions of (seed, step), so the step number is the whole data-order state. ``state.json`` is
sealed (:func:`dflash.artifacts.manifest.seal`): it is part of the checksummed set, so a checkpoint whose
step or schedule was edited is refused like one with damaged tensors.

A training run writes them beside its steps (:class:`Writer`): the step that saves takes a
:func:`snapshot` (host copies), a background thread does :func:`write`; :func:`save` is both at
once. :func:`resume_point` is the resume policy: which checkpoint (if any) a run continues from.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import SpecError
from ..artifacts.manifest import fsync_dir, atomic_write_json, is_sealed, plain_mode, seal, sha256_file

CKPT_VERSION = 2  # 2: state.json sealed


def _optim_tensors(opt: torch.optim.Optimizer, params: list) -> tuple[dict, dict]:
    index = {id(p): i for i, p in enumerate(params)}
    tensors, scalars = {}, {}
    for p, st in opt.state.items():
        i = index[id(p)]
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{i}.{k}"] = v.detach().to("cpu", copy=True).contiguous()
            else:
                scalars[f"{i}.{k}"] = v
    return tensors, scalars


def _plain(v):
    """``v`` with its 0-d tensors as numbers, for JSON: a capturable optimizer
    (compile.cuda_graph_step) keeps its lr as a device tensor, and its schedule's base and
    last lrs follow it."""
    if torch.is_tensor(v):
        return v.item()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    return v


def _load_group(group: dict, saved: dict) -> None:
    """A saved param group into ``group``; a tensor hyper-parameter (the capturable lr) is
    filled in place, since a captured step reads that very tensor."""
    for k, v in saved.items():
        if torch.is_tensor(group.get(k)):
            group[k].fill_(v)
        else:
            group[k] = v


@dataclass
class Snapshot:
    """One checkpoint's content on the host, taken at a step boundary: copies of the drafter's
    weights and the optimizer's tensors, and everything ``state.json`` holds but the files'
    sha256. Later steps may change the replica freely; the snapshot stays the step's."""
    step: int
    model: dict
    optim: dict
    state: dict


def snapshot(step: int, replica, counters: dict, run_fingerprint: dict,
             epochs_seen: dict | None = None, nodes: int = 1) -> Snapshot:
    """The checkpoint of ``step`` as host copies (``copy=True``: a CPU replica's tensors would
    otherwise be the live ones). ``epochs_seen``: the sample ids each epoch trained on so far
    (the exactly-once record); ``nodes``: the world size that wrote it (the data sharding
    depends on it)."""
    model_sd = {k: v.detach().to("cpu", copy=True).contiguous()
                for k, v in replica.model.state_dict().items()}
    otensors, oscalars = _optim_tensors(replica.opt, replica.params)
    state = {"version": CKPT_VERSION, "step": step, "counters": copy.deepcopy(counters),
             "nodes": nodes, "run_fingerprint": dict(run_fingerprint),
             "epochs_seen": copy.deepcopy(epochs_seen or {}), "optim_scalars": oscalars,
             # _plain rebuilds every dict, list and tuple: copies, not the live ones
             "sched": _plain(replica.sched.state_dict()),
             "param_groups": [{k: _plain(v) for k, v in g.items() if k != "params"}
                              for g in replica.opt.param_groups]}
    return Snapshot(step, model_sd, otensors, state)


def write(ckpt_dir: Path, snap: Snapshot, keep: int) -> Path:
    """Write ``snap`` as ``ckpt_dir/step-XXXXXXXX`` atomically (a temporary folder, its files
    fsynced and checksummed, renamed); prune to the newest ``keep``."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step-{snap.step:08d}"
    tmp = ckpt_dir / f".tmp-step-{snap.step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(snap.model, str(tmp / "model.safetensors"))
    save_file(snap.optim, str(tmp / "optim.safetensors"))
    for f in ("model.safetensors", "optim.safetensors"):
        plain_mode(tmp / f)  # safetensors writes 0600: teammates read checkpoints too
        with open(tmp / f, "rb") as fh:
            os.fsync(fh.fileno())
    state = {**snap.state, "sha256": {f: sha256_file(tmp / f) for f in ("model.safetensors",
                                                                        "optim.safetensors")}}
    atomic_write_json(tmp / "state.json", seal(state))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(ckpt_dir)
    for old in sorted(ckpt_dir.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save(ckpt_dir: Path, step: int, replica, counters: dict, keep: int,
         run_fingerprint: dict, epochs_seen: dict | None = None, nodes: int = 1) -> Path:
    """Write ``ckpt_dir/step-XXXXXXXX`` atomically, now (:func:`snapshot`, then :func:`write`);
    prune to the newest ``keep``."""
    return write(ckpt_dir, snapshot(step, replica, counters, run_fingerprint, epochs_seen,
                                    nodes), keep)


class Writer:
    """Checkpoints written beside training: the step that saves pays for its :func:`snapshot`
    (the device-to-host copies) only, one background thread does the rest (:func:`write`: the
    files, their fsync and sha256, the rename, the pruning). Round 19's 6-epoch run stalled
    ~1.0-1.3 s at each of its 22 checkpoints (metrics.jsonl's step times), writing them in the
    step. At most one write is in flight: a save first waits for the one before (its snapshot
    is all the host memory this costs). A write that failed raises at the next :meth:`save` or
    at :meth:`finish`; a kill -9 mid-write leaves the previous checkpoints, as before (the
    rename is the commit)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._pending: Future | None = None

    def save(self, ckpt_dir: Path, step: int, replica, counters: dict, keep: int,
             run_fingerprint: dict, epochs_seen: dict | None = None, nodes: int = 1) -> None:
        """:func:`save`'s arguments; returns once the snapshot is taken."""
        self.finish()
        snap = snapshot(step, replica, counters, run_fingerprint, epochs_seen, nodes)
        self._pending = self._pool.submit(write, ckpt_dir, snap, keep)

    def finish(self) -> Path | None:
        """Wait for the write in flight (its error, if it failed, raised here); its folder."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self, log=print) -> None:
        """Wait for the write in flight and stop the thread; a failed write is logged, not
        raised (a run that failed keeps its own error; one that finished called finish)."""
        try:
            self.finish()
        except Exception as e:  # noqa: BLE001 - the run's own error, if any, is the one to see
            log(f"[train] the last checkpoint was not written: {type(e).__name__}: {e}")
        finally:
            self._pool.shutdown(wait=True)


def _verify(path: Path) -> dict:
    state = json.loads((path / "state.json").read_text())
    if not isinstance(state, dict) or state.get("version") != CKPT_VERSION:
        raise ValueError(f"version {state.get('version') if isinstance(state, dict) else None}"
                         f" != {CKPT_VERSION}")
    if not is_sealed(state):
        raise ValueError("state.json checksum mismatch")
    for f, want in state["sha256"].items():
        if sha256_file(path / f) != want:
            raise ValueError(f"{f} checksum mismatch")
    return state


def latest_good(ckpt_dir: Path, log=print) -> tuple[Path, dict] | None:
    """The newest checkpoint whose checksums verify; corrupted ones are reported and skipped."""
    for path in sorted(ckpt_dir.glob("step-*"), reverse=True):
        try:
            return path, _verify(path)
        except (OSError, ValueError, KeyError) as e:
            log(f"[train] checkpoint {path} is corrupted ({e}); trying the previous one")
    return None


def load_into(path: Path, state: dict, replicas: list) -> None:
    """Load weights, optimizer and schedule state into every replica (they stay identical)."""
    model_sd = load_file(str(path / "model.safetensors"))
    otensors = load_file(str(path / "optim.safetensors"))
    for rep in replicas:
        rep.model.load_state_dict(model_sd)
        for i, p in enumerate(rep.params):
            st = {}
            for key, v in otensors.items():
                pi, name = key.split(".", 1)
                if int(pi) == i:
                    # a copy per replica: .to() on the same device returns the very tensor,
                    # and replicas sharing exp_avg/exp_avg_sq would each update it in place
                    # ("step" stays on the CPU, where non-capturable AdamW wants it; a
                    # capturable one, compile.cuda_graph_step, keeps it on the device)
                    on_dev = name != "step" or rep.opt.param_groups[0].get("capturable")
                    st[name] = v.to(p.device, copy=True) if on_dev else v.clone()
            for key, v in state["optim_scalars"].items():
                pi, name = key.split(".", 1)
                if int(pi) == i:
                    st[name] = v
            if st:
                rep.opt.state[p] = st
        for g, saved in zip(rep.opt.param_groups, state["param_groups"]):
            _load_group(g, saved)
        rep.sched.load_state_dict(state["sched"])


# what a run fingerprint's fields mean, for the line that says why checkpoints were discarded
_WHY = {"code": "the train stage's code changed", "train": "train spec fields changed",
        "shape": "shape fields changed", "dataset_sha256": "the dataset changed"}


def _foreign(found: dict, run_fingerprint: dict) -> str:
    """Why a checkpoint's run fingerprint is not this run's ('' when it is)."""
    theirs = found.get("run_fingerprint") or {}
    diff = [k for k in sorted(set(theirs) | set(run_fingerprint))
            if theirs.get(k) != run_fingerprint.get(k)]
    return "; ".join(f"{_WHY.get(k, k)} ({k} {theirs.get(k)} -> {run_fingerprint.get(k)})"
                     for k in diff)


def _decide(ckpt_dir: Path, run_fingerprint: dict, total_steps: int, nodes: int,
            spec_path, log) -> tuple[Path | None, str | None]:
    """Rank 0's decision: (checkpoint to resume or None, refusal or None)."""
    found = latest_good(ckpt_dir, log=log)
    if found is None:
        return None, None
    path, state = found
    if state.get("nodes", 1) != nodes:
        # the data sharding (which batches each node took) depends on the world size
        return None, (f"{spec_path}: field 'topology.nodes': checkpoint {path} was written by a "
                      f"run on topology.nodes = {state.get('nodes', 1)}; this spec has "
                      f"topology.nodes = {nodes}. A run resumes only on the world size that "
                      f"wrote it: set topology.nodes back to {state.get('nodes', 1)}, or delete "
                      f"{ckpt_dir} to start over")
    why = _foreign(state, run_fingerprint)
    if not why and state["step"] >= total_steps:
        # a finished run asked for again (an input manifest or an output was redone): train
        # again, so the manifest and the bench report hold this run's figures, not "0 steps"
        why = f"they hold a finished run (step {state['step']}/{total_steps})"
    if why:
        log(f"[train] starting over from step 0, checkpoints in {ckpt_dir} discarded: {why}")
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        return None, None
    return path, None


def resume_point(ckpt_dir: Path, run_fingerprint: dict, total_steps: int, nodes: int,
                 spec_path, comm=None, log=print) -> tuple[Path, dict] | None:
    """The checkpoint this run continues from, or None (start at step 0).

    Only an unfinished run with the same run fingerprint (train code, train and shape spec
    fields, dataset) and the same world size resumes; any other checkpoints are discarded, with
    one line saying why. Rank 0 decides and every rank loads what it chose (``comm``: the
    cross-node group, or None)."""
    path, refused = (None, None)
    if comm is None or comm.is_main:
        path, refused = _decide(ckpt_dir, run_fingerprint, total_steps, nodes, spec_path, log)
    if comm is not None:
        chosen, refused = comm.broadcast((str(path) if path else None, refused))
        path = Path(chosen) if chosen else None
    if refused:
        raise SpecError(refused)
    if path is None:
        return None
    return path, json.loads((path / "state.json").read_text())
