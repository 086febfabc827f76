"""One training process per node, joined by torch.distributed (``topology.nodes`` > 1).

torchrun (started by :mod:`dflash.runtime.launch`) gives every process RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/MASTER_PORT (its rendezvous store); :func:`init` joins the process group from them
(``env://``: NCCL when the drafters are on CUDA, gloo on CPU) with a collective timeout, plus a
gloo group for the small per-step records, and starts the :class:`Watchdog`. With one node
nothing here runs: :func:`current` is ``None`` and the stage is exactly the one-process stage.

Per step (see :class:`dflash.train.scheduler.Pipeline`): each node sums its replicas' gradients in a
fixed order, then ONE all-reduce of ``[sum, active replica count]`` across nodes; every rank
divides by the global count, so the mean weights every replica that had a batch equally (not a
mean of means) and every rank ends with the same bits.

Failure: a rank that dies (kill -9, a lost node) stops bumping its heartbeat in the rendezvous
store; a rank that fails with an error writes a failure record there. Every other rank's watchdog
sees either within seconds, stops its pipeline and exits non-zero naming the rank and its host;
collectives time out as a backstop. No rank hangs.
"""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from .. import settings
from ..errors import DFlashError


class PeerFailed(DFlashError):
    """Another rank died or failed; this one stops."""
    exit_code = 5


def is_worker() -> bool:
    return settings.dist_worker() and "RANK" in os.environ


def select_local_gpus() -> None:
    """Simulated nodes on one machine: local process i sees GPUs [i·k, (i+1)·k) of the ones
    the launcher saw, renumbered from 0, so the spec's per-node 'cuda:0' is its own GPU. Must run
    before anything initialises CUDA."""
    k = settings.gpus_per_node()
    if k <= 0 or not is_worker():
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    seen = settings.launch_visible_devices()
    mine = seen[local * k:(local + 1) * k]
    if len(mine) < k:
        raise DFlashError(f"topology.nodes: local process {local} needs GPUs "
                          f"{local * k}..{(local + 1) * k - 1} of {seen}; not enough GPUs here")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


class Dist:
    """This process's place in the job and the collectives the train stage uses."""

    def __init__(self, lead_device: str):
        self.dist = dist
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.host = socket.gethostname()
        cuda = lead_device.startswith("cuda")
        self.backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(torch.device(lead_device))
        # a backstop only (the watchdog acts first): long enough for rank 0's checkpoint or τ
        timeout = timedelta(seconds=settings.collective_timeout_s())
        dist.init_process_group(self.backend, timeout=timeout)
        # small host-side records (sample ids, losses) go over gloo whatever the grads use
        self.meta = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
        self.watchdog = Watchdog(self)
        self.watchdog.start()
        signal.signal(signal.SIGTERM, self._terminated)
        self.allreduce_s = 0.0
        self.allreduce_steps = 0

    def _terminated(self, signum, frame) -> None:
        """torchrun ends the ranks of a node when one of them exits with an error."""
        why = self.watchdog.verdict or self.watchdog.probe() or \
            "the job was cancelled, or another rank of this node exited"
        print(f"error: {self.name()} stopped by torchrun (SIGTERM): {why}", file=sys.stderr,
              flush=True)
        os._exit(128 + signum)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def name(self, rank: int | None = None) -> str:
        r = self.rank if rank is None else rank
        return f"rank {r} on {self.watchdog.host_of(r)}"

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce_start(self, buf: torch.Tensor):
        """Start the sum of ``buf`` across ranks (async: the caller waits outside the gate)."""
        return self.dist.all_reduce(buf, op=self.dist.ReduceOp.SUM, async_op=True)

    def all_gather(self, obj) -> list:
        """Every rank's ``obj`` in rank order (pickled, over gloo)."""
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.meta)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.meta)
        return box[0]

    def barrier(self) -> None:
        self.dist.barrier(group=self.meta)

    def close(self) -> None:
        """After the run: every rank is done, then stop watching and leave the group."""
        self.barrier()
        self.watchdog.stop()
        self.dist.destroy_process_group()


class Watchdog:
    """Heartbeats and failure records in the rendezvous store (torch.distributed.TCPStore).

    Every ``DFLASH_HEARTBEAT_S`` each rank bumps ``hb/<rank>`` and reads the others'; a peer whose counter
    has not moved for ``DFLASH_HEARTBEAT_TIMEOUT_S``, a failure record ``failed``, or a store that cannot be reached (it
    lives with node 0's torchrun) is a dead job: :meth:`on_failure` callbacks run (the pipeline
    stops) and, if this process has not left by itself within a few seconds, it exits here.
    """

    def __init__(self, d: Dist):
        self.d = d
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.where = f"{addr}:{port}"
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/" \
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10))
        self.store = dist.PrefixStore(f"dflash/{run}/", store)
        self.host = d.host
        self.store.set(f"host/{d.rank}", f"{d.host} (pid {os.getpid()})")
        self.store.add(f"hb/{d.rank}", 1)
        self.hosts: dict[int, str] = {}
        self.verdict: str | None = None
        self.callbacks: list = []
        self._reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dist-watchdog", daemon=True)

    def host_of(self, rank: int) -> str:
        if rank not in self.hosts:
            try:
                if self.store.check([f"host/{rank}"]):
                    self.hosts[rank] = self.store.get(f"host/{rank}").decode()
            except Exception:  # noqa: BLE001 - a name only
                pass
        return self.hosts.get(rank, "an unknown host")

    def probe(self) -> str | None:
        """Why the job is broken, if the store says (None: nothing known)."""
        try:
            if self.store.check(["failed"]):
                return self.store.get("failed").decode() or None
        except Exception as e:  # noqa: BLE001
            return self._store_lost(e)
        return None

    def _store_lost(self, e: BaseException) -> str:
        return (f"lost the rendezvous store at {self.where} (it lives with the torchrun of "
                f"node 0: that node, its torchrun or its rank is gone; "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def on_failure(self, fn) -> None:
        self.callbacks.append(fn)

    def report_failure(self, message: str) -> None:
        """This rank failed: tell the others (first writer wins; best effort)."""
        self._reported = True  # the record is ours: not a reason to stop again
        try:
            self.store.compare_set("failed", "", f"rank {self.d.rank} on {self.host}: {message}")
        except Exception:  # noqa: BLE001 - the store may be gone with node 0
            pass

    def _loop(self) -> None:
        last: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(settings.heartbeat_s()):
            try:
                self.store.add(f"hb/{self.d.rank}", 1)
                if not self._reported and self.store.check(["failed"]):
                    msg = self.store.get("failed").decode()
                    if msg:
                        self._fire(f"{msg}; stopping {self.d.name()}")
                        return
                now = time.monotonic()
                for r in range(self.d.world):
                    self.host_of(r)  # known early: a lost store or peer can still be named
                    if r == self.d.rank:
                        continue
                    n = self.store.add(f"hb/{r}", 0)
                    if r not in last or last[r][0] != n:
                        last[r] = (n, now)
                    elif now - last[r][1] > settings.heartbeat_timeout_s():
                        self._fire(f"{self.d.name(r)} stopped responding (no heartbeat for "
                                   f"{now - last[r][1]:.0f} s: killed, crashed or its node is "
                                   f"gone); stopping {self.d.name()}")
                        return
            except Exception as e:  # noqa: BLE001 - the store is node 0's torchrun
                if self._stop.is_set():
                    return
                self._fire(f"{self._store_lost(e)}; stopping {self.d.name()}")
                return

    def _fire(self, message: str) -> None:
        if self._stop.is_set():
            return
        self.verdict = message
        for fn in self.callbacks:
            try:
                fn(message)
            except Exception:  # noqa: BLE001
                pass
        # the main thread reports and exits; if it is stuck (a collective waiting for the
        # dead peer), leave anyway
        if not self._stop.wait(5.0):
            print(f"error: {message}", file=sys.stderr, flush=True)
            print("what to do: rerun the same command; training resumes from the last "
                  "checkpoint", file=sys.stderr, flush=True)
            os._exit(PeerFailed.exit_code)


_CURRENT: Dist | None = None


def current() -> Dist | None:
    return _CURRENT


def init(lead_device: str) -> Dist | None:
    """Join the job when torchrun started this process; None for a one-node run."""
    global _CURRENT
    if _CURRENT is None and is_worker():
        _CURRENT = Dist(lead_device)
    return _CURRENT


# ---------------------------------------------------------------------------------------------
# supervising one rank of a multi-node run
# ---------------------------------------------------------------------------------------------
def supervise(comm: Dist, fn: Callable[[], dict]) -> dict:
    """Run one node's share of a multi-node job (``fn``). Whatever fails, every rank exits
    promptly with one message naming the rank (and host) at fault; a finished run leaves the
    group together."""
    try:
        result = fn()
        comm.close()
        return result
    except BaseException as e:  # noqa: BLE001 - reported below, then this process exits
        verdict = comm.watchdog.verdict
        if verdict is None and lost_peer(e):
            # a collective failed because a peer vanished: the watchdog names which one
            deadline = time.monotonic() + settings.heartbeat_timeout_s() + 3
            while comm.watchdog.verdict is None and time.monotonic() < deadline:
                time.sleep(0.2)
            verdict = comm.watchdog.verdict
        if verdict is not None:
            msg, code = verdict, PeerFailed.exit_code
        else:
            msg = f"{comm.name()} failed: {e}" if isinstance(e, DFlashError) else \
                f"{comm.name()} failed: {type(e).__name__}: {e}"
            code = getattr(e, "exit_code", 1)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            comm.watchdog.report_failure(first)
            if not isinstance(e, DFlashError) or e.__cause__ is not None:
                traceback.print_exception(e, file=sys.stderr)
            # let the other ranks read the record and stop with this rank's error named
            # before torchrun notices this exit and terminates them
            time.sleep(3 * settings.heartbeat_s())
        comm.watchdog.stop()
        print(f"error: {msg}", file=sys.stderr)
        print("what to do: fix the cause above if any, then rerun the same command; training "
              "resumes from the last checkpoint", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # no interpreter shutdown: a thread may still wait in a collective for the dead peer
        os._exit(code)


def lost_peer(e: BaseException) -> bool:
    """Whether an exception (or one in its chain) is a collective failing because a peer
    vanished: torch.distributed reports it only as text (gloo/NCCL errors, closed sockets)."""
    text = ""
    while e is not None:
        text += f" {type(e).__name__}: {e}"
        e = e.__cause__ or e.__context__
    return any(k in text for k in ("Connection closed", "Connection reset", "Broken pipe",
                                   "gloo", "NCCL", "DistBackendError", "timed out",
                                   "Socket", "ECONNRESET"))


def weights_sha256(state_dict: dict) -> str:
    h = hashlib.sha256()
    for k, v in sorted(state_dict.items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rank_report(comm: Dist | None, state_dict: dict, allreduce_s: float, steps: int,
                n_params: int) -> dict:
    """Across nodes: every rank's weights (hashed; equal: the replicas stayed identical across
    nodes), host and seconds in the cross-node all-reduce (from the local sum being ready to
    the global sum being there: transfer plus waiting for the slowest rank), gathered in rank
    order, and the gradient bytes each all-reduce moves. ``{"nodes": 1}`` for a one-node run."""
    if comm is None:
        return {"nodes": 1}
    local = {"rank": comm.rank, "host": comm.host, "weights_sha256": weights_sha256(state_dict),
             "allreduce_s": {"total": round(allreduce_s, 4),
                             "per_step_mean": allreduce_s / max(1, steps)}}
    ranks = comm.all_gather(local)
    per_step = [r["allreduce_s"]["per_step_mean"] for r in ranks]
    return {"nodes": len(ranks), "backend": comm.backend,
            "hosts": [r["host"] for r in ranks],
            "allreduce_bytes_per_step": (n_params + 1) * 4,
            "allreduce_s_per_step_mean": sum(per_step) / len(per_step),
            "allreduce_s_per_step_by_rank": per_step,
            "weights_sha256_by_rank": [r["weights_sha256"] for r in ranks],
            "replicas_identical_across_ranks": len({r["weights_sha256"] for r in ranks}) == 1}
