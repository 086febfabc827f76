"""``python -m dflash.runtime.stress``: drive real compiled drafter-like training steps from several threads,
with and without the compile gate, beside the adversarial mixes of docs/gate.md. Prints ONE JSON line.

Workers: each owns a small transformer block (attention + MLP; its own code object, so its own dynamo
cache), compiled with ``torch.compile(dynamic=False)``; an iteration is forward + backward +
``Adam(foreach=True).step()`` at a shape drawn from a closed bucket set. On CUDA the attention is a
compiled ``flex_attention`` with a block mask; on CPU it is SDPA inside the compiled block (FlexAttention
has no backward on CPU in torch 2.13). The compiled forward also returns
``torch.compiler.is_dynamo_compiling()``: True when the compiled graph ran, False on a silent eager run.

Adversaries (extra threads beside ``--threads`` workers), by ``--scenario``:
  peer          workers only (overhead baseline)
  adv_fx        one thread runs make_fx outside any compile session (reproduces the error on CPU
                in well under a second without the gate: ~99 % of warm calls raise)
  adv_eagerflex one thread runs uncompiled flex_attention (can leave the FX flag stuck True)
  adv_compile   one thread compiles brand-new functions (the is_compiling() leak into Adam)
  mixed         all three adversaries (default)
With ``--gate on`` every worker iteration goes through ``gate.run`` and every adversary operation
takes ``gate.exclusive``; with ``--gate off`` nothing is coordinated.
Exit code 0 whenever the harness itself worked (the JSON is the result), 2 if it broke.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import sys
import threading
import time
import traceback
import types
from typing import Any, Callable

import torch
import torch.fx._symbolic_trace as st
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dflash.errors import PoisonedProcess
from dflash.runtime.gate import Gate
from dflash.runtime.tracing import classify_error, worker_thread_setup

SCENARIOS = ("peer", "adv_fx", "adv_eagerflex", "adv_compile", "mixed")
_ADV = {"peer": (), "adv_fx": ("fx",), "adv_eagerflex": ("eagerflex",), "adv_compile": ("compile",),
        "mixed": ("fx", "eagerflex", "compile")}
BATCH = (2, 4)
SEQ = (32, 64)
D_MODEL, HEADS = 64, 4


def _fresh(fn: Callable, tag: str) -> Callable:
    """A copy of fn with its own code object (=> its own dynamo cache entry list)."""
    return types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{tag}"), fn.__globals__,
                              fn.__name__ + "_" + tag, fn.__defaults__, fn.__closure__)


def _block_forward(self, x, block_mask=None):  # noqa: ANN001 - becomes a Module.forward
    B, S, D = x.shape
    q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
    if block_mask is not None:
        a = flex_attention(q, k, v, block_mask=block_mask)
    else:
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.o(a.transpose(1, 2).reshape(B, S, D))
    x = x + self.mlp(self.ln2(x))
    return x.float().square().mean(), torch.compiler.is_dynamo_compiling()


def _causal(b, h, q, kv):  # noqa: ANN001
    return q >= kv


def _adv_fn(x):  # noqa: ANN001
    return (x.sin() + 1).relu() @ x.T


class _Worker:
    """One worker thread's model: a fresh DraftBlock class (its own dynamo cache entries), its
    compiled module and a foreach Adam, stepping the run's buckets."""

    def __init__(self, run: "_StressRun", i: int) -> None:
        cls = type(f"DraftBlock{i}", (nn.Module,), {"forward": _fresh(_block_forward, f"w{i}")})
        m = cls()
        m.h = HEADS
        m.ln1, m.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        m.qkv, m.o = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        m.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))
        self.run = run
        self.m = m.to(run.dev)
        self.cm = torch.compile(self.m, backend=run.backend, dynamic=False)
        self.opt = torch.optim.Adam(self.m.parameters(), lr=1e-3, foreach=True)
        self.i = i
        self.name = f"draft_step_w{i}"
        self.rnd = random.Random(run.seed * 1000 + i)
        self.buckets = list(run.buckets)

    def step(self, b: int, s: int) -> bool:
        r = self.run
        x = torch.randn(b, s, D_MODEL, device=r.dev)
        loss, mk = self.cm(x, r.flex_masks[s] if r.cuda else None)
        loss.backward()
        self.opt.step()  # mutation after every compiled call: a refused attempt changes nothing
        self.opt.zero_grad(set_to_none=True)
        return bool(mk)

    def iterate(self, b: int, s: int) -> None:
        r = self.run
        sig = (self.name, str(r.dev), (b, s, D_MODEL))
        t = time.perf_counter()
        try:
            mk = r.g.run(sig, lambda: self.step(b, s)) if r.g else self.step(b, s)
        except PoisonedProcess as e:
            r.err(r.errors, e)
            return
        except Exception as e:  # noqa: BLE001 - the result is the error census
            r.err(r.errors, e)
            return
        with r.lock:
            r.counts["ok"] += 1
            r.counts["fallback"] += (not mk)
            if r.warm_done.is_set():
                r.counts["steady_ok"] += 1
                r.step_time += time.perf_counter() - t


class _StressRun:
    """One stress run's fixtures, threads and census (:func:`run_stress` is its front door)."""

    def __init__(self, gate: bool, threads: int, iterations: int, device: str, scenario: str,
                 seed: int, backend: str | None, max_seconds: float, adversary_pause_s: float,
                 adv_from_start: bool, shapes: list[tuple[int, int]] | None) -> None:
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; one of {SCENARIOS}")
        if threads < 1 or iterations < 1:
            raise ValueError("threads and iterations must be >= 1")
        self.gate, self.threads, self.iterations, self.device = gate, threads, iterations, device
        self.scenario, self.seed = scenario, seed
        self.adversary_pause_s, self.adv_from_start = adversary_pause_s, adv_from_start
        self.backend = backend or ("inductor" if device.startswith("cuda") else "aot_eager")
        self.dev = torch.device(device)
        self.cuda = self.dev.type == "cuda"
        torch.manual_seed(seed)
        if not self.cuda:
            torch.set_num_threads(1)  # several Python threads on few cores: avoid intra-op oversubscription
        # a private gate per run (same class as the singleton) so repeated in-process runs don't share sigs
        self.g = Gate() if gate else None
        self.t_start = time.perf_counter()
        self.deadline = time.time() + max_seconds
        self.lock = threading.Lock()
        self.errors: collections.Counter = collections.Counter()
        self.adv_errors: collections.Counter = collections.Counter()
        self.counts: collections.Counter = collections.Counter()
        self.first_tb: dict[str, str] = {}
        self.step_time = 0.0
        # ---- shared fixtures (built before any thread starts) ----------------------------------
        self.buckets = list(shapes) if shapes else [(b, s) for b in BATCH for s in SEQ]
        self.flex_masks: dict[int, Any] = {}
        with self.excl("setup: create_block_mask"):
            for s in sorted({s for _, s in self.buckets} | {128}):
                self.flex_masks[s] = create_block_mask(_causal, None, None, s, s, device=device)
        self.workers = [_Worker(self, i) for i in range(threads)]
        self.stop = threading.Event()
        self.warm_done = threading.Event()
        self.steady_t0 = 0.0
        self.warm_snap: dict[str, Any] = {}
        self.barrier = threading.Barrier(threads, action=self._on_all_warm)

    def err(self, counter: collections.Counter, e: BaseException, prefix: str = "") -> None:
        c = classify_error(e)
        with self.lock:
            counter[prefix + c] += 1
            self.first_tb.setdefault(prefix + c, "".join(traceback.format_exception(e))[-1200:])

    def excl(self, reason: str):
        return self.g.exclusive(reason) if self.g else contextlib.nullcontext()

    def _on_all_warm(self) -> None:  # runs in one thread, after all workers reached the barrier (none holds the gate)
        if self.g:
            self.g.mark_warm()
            self.warm_snap.update(self.g.stats().summary())
        self.steady_t0 = time.perf_counter()
        self.warm_done.set()

    def _tick(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def worker_main(self, w: _Worker) -> None:
        worker_thread_setup()
        for b, s in w.buckets:  # warmup: every bucket once (gate: each is a first-seen sig -> exclusive)
            if time.time() > self.deadline:
                break
            self._tick("warmup_iterations")
            w.iterate(b, s)
        try:
            self.barrier.wait(timeout=max(1.0, self.deadline - time.time()))  # never while holding the gate
        except threading.BrokenBarrierError:
            self._tick("barrier_broken")
            self.warm_done.set()
        for _ in range(self.iterations):
            if time.time() > self.deadline:
                with self.lock:
                    self.counts["timed_out"] = 1
                break
            b, s = w.rnd.choice(w.buckets)
            self._tick("iterations")
            w.iterate(b, s)

    def adversary(self, kind: str) -> None:
        worker_thread_setup()
        if not self.adv_from_start:  # start beside the warm steady state (where the error hits warm calls)
            self.warm_done.wait(timeout=max(0.0, self.deadline - time.time()))
        q = torch.randn(1, 2, 128, 16, device=self.dev)
        k = 0
        while not self.stop.is_set() and time.time() < self.deadline:
            k += 1
            try:
                if kind == "fx":  # FX tracing outside any dynamo compile session
                    with self.excl("make_fx"):
                        make_fx(_adv_fn)(torch.randn(8, 8))
                elif kind == "eagerflex":  # uncompiled flex_attention flips the FX flag (save/clear/restore)
                    with self.excl("eager flex_attention"):
                        flex_attention(q, q, q, block_mask=self.flex_masks[128])
                else:  # a brand-new compiled function each time (dynamo + AOT make_fx)
                    f = torch.compile(_fresh(_adv_fn, f"adv{k}"), backend="aot_eager")
                    with self.excl("adversary compile"):
                        f(torch.randn(8, 8))
                self._tick(f"adv_{kind}")
            except Exception as e:  # noqa: BLE001
                self.err(self.adv_errors, e, f"{kind}:")
            if self.g or kind == "compile":  # pacing: give waiting readers a turn (outside the gate)
                time.sleep(self.adversary_pause_s)

    def run_threads(self) -> float:
        """Run the workers and adversaries to the end; the steady state's wall seconds."""
        ths = [threading.Thread(target=self.worker_main, args=(w,), name=f"worker{w.i}")
               for w in self.workers]
        ths += [threading.Thread(target=self.adversary, args=(k,), name=f"adv_{k}")
                for k in _ADV[self.scenario]]
        for t in ths:
            t.start()
        for t in ths[:self.threads]:
            t.join()
        steady_wall = time.perf_counter() - (self.steady_t0 or self.t_start)
        self.stop.set()
        for t in ths[self.threads:]:
            t.join()
        return steady_wall

    def probe(self) -> dict[str, Any]:
        """Afterwards, single-threaded: are the global flags stuck, does a warm compiled call
        still work in this process?"""
        flag_stuck = bool(st._is_fx_tracing_flag)
        comp_stuck = bool(torch.compiler.is_compiling())
        try:
            with (self.g.shared() if self.g else contextlib.nullcontext()):
                w = self.workers[-1]
                pb, ps = self.buckets[0]
                _, mk = w.cm(torch.randn(pb, ps, D_MODEL, device=self.dev),
                             self.flex_masks[ps] if self.cuda else None)
            post = "compiled" if mk else "FALLBACK"
        except Exception as e:  # noqa: BLE001
            post = classify_error(e)
        return {"flag_stuck_after": flag_stuck, "is_compiling_stuck_after": comp_stuck,
                "poisoned": flag_stuck or comp_stuck, "post_probe": post}

    def _gate_figures(self) -> dict[str, Any]:
        g = self.g
        gs = g.stats() if g else None
        if g and g.warm:
            g.mark_cold()  # put the process-global stance back
        ws = self.warm_snap
        return {
            "compiles": len(gs.compiles) if gs else None,
            "recompiles": gs.recompiles_after_warmup if gs else None,
            "gate_wait_s": round(gs.shared_wait_s + gs.exclusive_wait_s, 4) if gs else 0.0,
            "gate_shared_wait_s": gs.shared_wait_s if gs else 0.0,
            "gate_steady_wait_s": round(gs.shared_wait_s + gs.exclusive_wait_s - ws.get("shared_wait_s", 0)
                                        - ws.get("exclusive_wait_s", 0), 4) if gs else 0.0,
            "gate_exclusive_hold_s": gs.exclusive_hold_s if gs else 0.0,
            "gate_max_shared_wait_s": gs.max_shared_wait_s if gs else 0.0,
            "gate_max_exclusive_wait_s": gs.max_exclusive_wait_s if gs else 0.0,
            "race_errors": {"count": gs.race_errors, "by_class": dict(gs.race_by_class)} if gs else None,
        }

    def result(self, steady_wall: float, probe: dict[str, Any]) -> dict[str, Any]:
        """The result dict (what ``main`` prints as one JSON line)."""
        counts, steady_ok = self.counts, self.counts["steady_ok"]
        res: dict[str, Any] = {
            "gate": "on" if self.gate else "off",
            "scenario": self.scenario,
            "threads": self.threads,
            "adversaries": list(_ADV[self.scenario]),
            "iterations_per_thread": self.iterations,
            "shapes": [list(b) for b in self.buckets],
            "device": self.device,
            "backend": self.backend,
            "seed": self.seed,
            "torch": torch.__version__,
            "errors_total": sum(self.errors.values()),
            "errors": dict(self.errors),
            "adversary_errors": dict(self.adv_errors),
            "fallbacks": counts["fallback"],
            "iterations_done": counts["iterations"] + counts["warmup_iterations"],
            "steady_iterations": counts["iterations"],
            "warmup_iterations": counts["warmup_iterations"],
            "ok_iterations": counts["ok"],
            **self._gate_figures(),
            "calls_per_s": round(steady_ok / steady_wall, 2) if steady_wall > 0 else 0.0,
            "steady_ok_iterations": steady_ok,
            "ms_per_call": round(1000 * self.step_time / steady_ok, 3) if steady_ok else None,
            "steady_wall_s": round(steady_wall, 3),
            "wall_s": round(time.perf_counter() - self.t_start, 3),
            "adversary_ops": {k: counts[f"adv_{k}"] for k in _ADV[self.scenario]},
            **probe,
            "timed_out": bool(counts["timed_out"]),
            "barrier_broken": counts["barrier_broken"],
            "first_errors": {k: v.strip().splitlines()[-1][:300] for k, v in self.first_tb.items()},
        }
        return res


def run_stress(gate: bool, threads: int, iterations: int, device: str = "cpu", scenario: str = "mixed",
               seed: int = 0, backend: str | None = None, max_seconds: float = 120.0,
               adversary_pause_s: float = 0.002, adv_from_start: bool = False,
               shapes: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Run the stress and return the result dict (what ``main`` prints as one JSON line)."""
    run = _StressRun(gate, threads, iterations, device, scenario, seed, backend, max_seconds,
                     adversary_pause_s, adv_from_start, shapes)
    steady_wall = run.run_threads()
    return run.result(steady_wall, run.probe())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--gate", choices=("on", "off"), default="on")
    p.add_argument("--threads", type=int, default=3, help="worker threads (adversaries are extra)")
    p.add_argument("--iterations", type=int, default=200, help="steady-state iterations per worker")
    p.add_argument("--device", default="cpu", help="cpu | cuda:0 ...")
    p.add_argument("--scenario", choices=SCENARIOS, default="mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="aot_eager (CPU default) | inductor (CUDA default)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="safety cap on the whole run")
    p.add_argument("--shapes", default=None,
                   help="comma-separated BxS buckets, e.g. 2x32,4x64 (default: 2x32,2x64,4x32,4x64)")
    p.add_argument("--adv-from-start", action="store_true",
                   help="start adversaries during warmup too (default: once every worker is warm)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    shapes = None
    if a.shapes:
        try:
            shapes = [tuple(int(v) for v in t.lower().split("x")) for t in a.shapes.split(",") if t.strip()]
            assert shapes and all(len(t) == 2 and min(t) > 0 for t in shapes)
        except (ValueError, AssertionError):
            print(json.dumps({"harness_error": f"bad --shapes {a.shapes!r}; want e.g. 2x32,4x64"}), flush=True)
            return 2
    try:
        res = run_stress(a.gate == "on", a.threads, a.iterations, a.device, a.scenario, a.seed,
                         backend=a.backend, max_seconds=a.max_seconds, adv_from_start=a.adv_from_start,
                         shapes=shapes)
    except Exception as e:  # noqa: BLE001 - harness broke
        print(json.dumps({"harness_error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-2000:]}), flush=True)
        return 2
    print(json.dumps(res, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
