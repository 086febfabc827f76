"""Live status: a line every few seconds, an atomically updated status.json, `dflash status`.

Users used to wait minutes blind to learn whether a run died. The first step of every worker is
a health check announced as soon as it passes; after that a line every ``tick`` seconds shows
step, tokens/s, loss, queue depths, each worker's busy fraction (a drafter that idles, waiting
for features, shows here first), gate waits and device memory.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from ..artifacts.manifest import atomic_write_json

STEADY_SKIP = 0.2  # the first 20 % of steps are not steady state (allocator, caches)


def worker_name(role: str, index: int) -> str:
    """A worker's name (its thread's, and its key in busy_s/wait_s/first_step_s of the status,
    the train manifest and the report): ``role`` is "target" or "drafter"."""
    return f"{role}-{index}"


def by_role(times: dict, role: str) -> dict:
    """The entries of a per-worker dict (keyed by :func:`worker_name`) of one role."""
    return {k: v for k, v in times.items() if k.rpartition("-")[0] == role}


def _memory() -> dict:
    import torch  # here only: `dflash status` reads a status file and starts without torch

    if not torch.cuda.is_available():
        try:
            return {"cpu_max_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                            / 2**20, 2)}
        except ImportError:  # pragma: no cover - non-POSIX
            return {}
    return {f"cuda:{i}_gb": round(torch.cuda.memory_allocated(i) / 2**30, 2)
            for i in range(torch.cuda.device_count())}


def duration(seconds: float | None) -> str:
    """``75`` -> ``1m15s``; None -> ``-``."""
    if seconds is None:
        return "-"
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def busy_fractions(busy_s: dict, wait_s: dict) -> dict:
    """busy / (busy + wait) per worker so far: 1.0 = never waited for inputs or peers."""
    out = {}
    for name, b in sorted(busy_s.items()):
        total = b + wait_s.get(name, 0.0)
        out[name] = round(b / total, 2) if total > 0 else None
    return out


class StatusReporter:
    def __init__(self, path: Path, spec, total_steps: int):
        self.path, self.spec, self.total = path, spec, total_steps
        self.t0 = time.perf_counter()
        self.records: list[tuple[float, int, int, float]] = []  # (t, step, tokens, loss)
        self.healthy_announced: set[str] = set()
        self.state = {"spec": spec.name, "phase": "training", "step": 0,
                      "total_steps": total_steps, "started_unix": time.time()}
        self._write()

    def _write(self) -> None:
        self.state["updated_unix"] = time.time()
        if self.path is None:  # a rank other than 0: rank 0 reports the job
            return
        atomic_write_json(self.path, self.state)

    def step(self, rec) -> None:
        self.records.append((time.perf_counter(), rec.step, rec.tokens, rec.loss))
        self.state.update(step=rec.step + 1, loss=rec.loss, lr=rec.lr)

    def tokens_per_s(self, window: int = 20) -> float | None:
        r = self.records[-window:]
        if len(r) < 2:
            return None
        return sum(x[2] for x in r[1:]) / max(1e-9, r[-1][0] - r[0][0])

    def eta_s(self, window: int = 20) -> float | None:
        """Seconds left at the recent step rate (None before two steps)."""
        r = self.records[-window:]
        if len(r) < 2 or not self.total:
            return None
        per_step = (r[-1][0] - r[0][0]) / (r[-1][1] - r[0][1] or 1)
        return max(0.0, (self.total - self.state["step"]) * per_step)

    def tick(self, pipe) -> None:
        for name in sorted(pipe.first_step_s):
            if name not in self.healthy_announced:
                self.healthy_announced.add(name)
                print(f"[train] health: {name} passed its first step "
                      f"({pipe.first_step_s[name]:.1f}s)", flush=True)
        g = pipe.gate.stats()
        tps = self.tokens_per_s()
        self.state.update(
            tokens_per_s=tps, queues=pipe.queue_depths(), memory=_memory(),
            busy=busy_fractions(pipe.busy_s, pipe.wait_s),
            busy_s={k: round(v, 3) for k, v in pipe.busy_s.items()},
            wait_s={k: round(v, 3) for k, v in pipe.wait_s.items()},
            gate=g.summary(),
            healthy_workers=sorted(pipe.first_step_s), elapsed_s=round(time.perf_counter()
                                                                        - self.t0, 1),
            eta_s=None if (eta := self.eta_s()) is None else round(eta, 1))
        self._write()
        # print when something moved, or every 30 s as a heartbeat; status.json is always fresh
        now = time.perf_counter()
        if self.state["step"] == getattr(self, "_printed_step", None) and \
                now - getattr(self, "_printed_at", 0.0) < 30:
            return
        self._printed_step, self._printed_at = self.state["step"], now
        loss = self.state.get("loss")
        print(f"[train] step {self.state['step']}/{self.total} · "
              f"{duration(self.state['elapsed_s'])} elapsed, ETA {duration(eta)} · "
              f"{'%.0f' % tps if tps else '-'} tok/s · loss "
              f"{'%.4f' % loss if loss is not None else '-'} · queues {self.state['queues']} · "
              f"busy {self.state['busy']} · "
              f"gate wait {g.shared_wait_s:.2f}s/{g.exclusive_wait_s:.2f}s · "
              f"recompiles {g.recompiles_after_warmup} · mem {self.state['memory']}",
              flush=True)

    def steady_state(self) -> dict:
        """Tokens/s and step time over the steps after the first STEADY_SKIP fraction."""
        r = self.records
        if len(r) < 3:
            return {"steps": len(r), "tokens_per_s": None, "step_time_s": None}
        s = r[int(len(r) * STEADY_SKIP):]
        if len(s) < 2:
            s = r[-2:]
        dt = s[-1][0] - s[0][0]
        toks = sum(x[2] for x in s[1:])
        return {"steps": len(s) - 1, "tokens_per_s": toks / dt if dt > 0 else None,
                "step_time_s": dt / (len(s) - 1), "seconds": dt}

    def done(self, manifest: dict) -> None:
        # the whole run's busy fractions (a short run may end before its first tick)
        busy_s, wait_s = manifest.get("busy_s", {}), manifest.get("wait_s", {})
        self.state.update(phase="done", final_loss=manifest.get("final_loss"), eta_s=0.0,
                          elapsed_s=round(time.perf_counter() - self.t0, 1),
                          steady_state=manifest.get("steady_state"),
                          busy=busy_fractions(busy_s, wait_s), busy_s=busy_s, wait_s=wait_s)
        self._write()


STAGES = ("env", "warmup", "data", "decoders", "train", "bench")
OPTIONAL = ("decoders",)  # a CPU spec's DAG has none (dflash.spec.types.no_decoders_stage)
# what each stage's record calls its duration (the bench stage's record is its report.json)
SECONDS_KEYS = ("seconds", "seconds_total", "wall_s")


def _fmt(v) -> str:
    """A status value for people: floats rounded, dicts as k=v."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items()) or "-"
    if isinstance(v, list):
        return ", ".join(map(_fmt, v)) or "-"
    return "-" if v is None else str(v)


def _last_line(log: Path) -> str | None:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1][:160] if lines else None


def stage_lines(spec_dir: Path, logs: Path) -> list[str]:
    """One line per stage: done (from its manifest), running or failed (its log's last line,
    with its age), or not started (a stage a spec may not have, only once it has started)."""
    out = []
    for st in STAGES:
        m, log = (spec_dir / st / ("report.json" if st == "bench" else "manifest.json"),
                  logs / f"{st}.log")
        if m.is_file():
            try:
                rec = json.loads(m.read_text())
            except ValueError:
                rec = {}
            secs = next((rec[k] for k in SECONDS_KEYS if isinstance(rec.get(k), (int, float))),
                        None)
            out.append(f"  {st:8s} done" + (f" in {duration(secs)}" if secs else ""))
        elif log.is_file():
            age = time.time() - log.stat().st_mtime
            out.append(f"  {st:8s} {'running' if age < 120 else 'stopped'} (log {duration(age)} "
                       f"ago): {_last_line(log) or '(empty)'}")
        elif st not in OPTIONAL:
            out.append(f"  {st:8s} not started")
    return out


def main(argv: list[str]) -> int:
    """`dflash status results/<spec>`: every stage's state, then the train stage's live status."""
    ap = argparse.ArgumentParser(prog="dflash status")
    ap.add_argument("results", help="results/<spec> (or its train/ folder)")
    ap.add_argument("--logs", default=None, help="the logs/<spec> folder (default: beside the "
                                                 "results root, as config/config.yaml has it)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    spec_dir = Path(a.results)
    for name in ("status.json", "train"):  # results/<spec>/train[/status.json] -> results/<spec>
        spec_dir = spec_dir.parent if spec_dir.name == name else spec_dir
    status = spec_dir / "train" / "status.json"
    status = status if status.is_file() else None
    st = None
    if status:
        try:
            st = json.loads(status.read_text())
            if not isinstance(st, dict):
                raise ValueError(f"a JSON {type(st).__name__}, not an object")
            float(st.get("updated_unix", 0))
        except (OSError, ValueError, TypeError) as e:
            # written atomically by the train stage, so this is damage, not a half-written file
            print(f"error: {status}: not a readable status file ({e}); the train stage "
                  f"rewrites it at its next status tick", file=sys.stderr)
            return 2
    if a.json:
        print(json.dumps(st or {}, indent=2))
        return 0
    logs = Path(a.logs) if a.logs else spec_dir.parent.parent / "logs" / spec_dir.name
    if not spec_dir.is_dir() and not logs.is_dir():
        print(f"error: nothing under {spec_dir} or {logs} yet (has the run started?)",
              file=sys.stderr)
        return 2
    print(f"spec {spec_dir.name}:")
    print("\n".join(stage_lines(spec_dir, logs)))
    if st:
        age = time.time() - float(st.get("updated_unix", 0))
        print(f"train: {st.get('phase')} · step {st.get('step')}/{st.get('total_steps')} · "
              f"{duration(st.get('elapsed_s'))} elapsed, ETA {duration(st.get('eta_s'))} · "
              f"updated {duration(age)} ago")
        for k in ("tokens_per_s", "loss", "lr", "queues", "busy", "gate", "memory",
                  "healthy_workers"):
            if k in st:
                print(f"  {k:16s} {_fmt(st[k])}")
    return 0
