"""The ONE process-wide compile gate: a writer-preferring, phase-fair readers-writer gate.

Why (docs/design.md §4, docs/gate.md): torch keeps two *process-global* flags,
``torch.fx._symbolic_trace._is_fx_tracing_flag`` and ``torch.compiler.is_compiling()``. Any FX
tracing (make_fx, AOTAutograd, uncompiled flex_attention, ``create_block_mask(_compile=True)``)
flips them outside any lock, so a warm compiled call in another thread raises "Detected that you
are using FX to symbolically trace a dynamo-optimized function", the FX flag can be left stuck
True by a lost update, and eager code elsewhere sees ``is_compiling()`` True
(``Adam(foreach=True).step()`` then raises). The cure is to never let anything that may trace run
at the same time as anything else:

* ``gate.shared()``    -- warm work: compiled calls that will not compile, eager optimizer steps, eager
  tensor code. Any number of threads at once. On entry a watchdog asserts both global flags are clear
  and raises :class:`dflash.errors.PoisonedProcess` if not.
* ``gate.exclusive(reason)`` -- anything that may compile or trace: a new shape signature, the first
  backward, uncompiled flex_attention, ``create_block_mask(_compile=True)``, ``make_fx``.
* ``gate.run(sig, fn)`` -- a worker's whole iteration: exclusive the first time ``sig`` is seen and
  until :meth:`Gate.mark_warm` (before it nothing refuses a recompile), shared afterwards, when a
  recompile is refused by ``fail_on_recompile`` *before doing any work*, counted, and retried under
  exclusive with the default stance. Never a silent eager run.

Fairness: a waiting writer blocks newly arriving readers (writer preference, so a pending compile gets
the gate as soon as the readers already inside finish their current iteration), and when a writer
leaves, every reader that was waiting at that moment is admitted before the next writer (phase-fair,
so a stream of compiles cannot starve warm work either). Waits are bounded by one iteration + one
compile.

Stance (torch 2.13 and 2.11): ``torch.compiler.set_stance`` is PROCESS-GLOBAL (a module global in
``torch._dynamo.eval_frame``, read at every compiled-call entry). The gate therefore owns it: after
``mark_warm()`` the stance is ``fail_on_recompile`` whenever no exclusive holder exists, and the
exclusive holder switches it to ``default`` for its hold (no reader is inside then, so nobody else can
observe it). Do not call ``set_stance`` yourself while the gate is warm.

Dynamo config (torch 2.13): ``torch._dynamo.config.x = v`` is stored in a ContextVar, i.e. PER THREAD;
a new thread starts with the defaults. Call :func:`dflash.runtime.tracing.worker_thread_setup` at
the top of every worker.

DEADLOCK RULES
1. Never block on another thread (barrier, queue.get, join, event.wait, a lock another gate user
   holds) while holding the gate, shared or exclusive. Leave the ``with`` block first.
2. Don't ask for ``exclusive`` while holding ``shared`` in the same thread: it would wait for itself.
   The gate detects this and raises RuntimeError instead of hanging.
3. Nested ``shared`` inside ``shared`` / anything inside ``exclusive`` in the same thread is a
   pass-through (re-entrant), so helpers may take the gate without knowing their caller did.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch

from dflash import settings
from dflash.runtime.tracing import FX_NESTED, IS_COMPILING_LEAK, check_flags, classify_error, is_recompile_refusal

__all__ = ["Gate", "GateStats", "NoGate", "get_gate"]

def _set_stance(name: str) -> None:
    torch.compiler.set_stance(name)


@dataclass(frozen=True)
class GateStats:
    """What the gate saw so far (:meth:`Gate.stats`): compiles (first sight of a signature),
    recompiles after warm-up (refused, with dynamo's reasons), waits and holds, race symptoms by
    class. :meth:`summary` is the one record of it that manifests and status.json keep."""
    enabled: bool
    warm: bool
    compiles: tuple[dict, ...]
    recompile_sigs: tuple
    recompile_reasons: tuple
    shared_wait_s: float
    exclusive_wait_s: float
    exclusive_hold_s: float
    max_shared_wait_s: float
    max_exclusive_wait_s: float
    shared_entries: int
    exclusive_entries: int
    race_by_class: dict

    @property
    def recompiles_after_warmup(self) -> int:
        return len(self.recompile_sigs)

    @property
    def race_errors(self) -> int:
        return sum(self.race_by_class.values())

    def summary(self) -> dict:
        """JSON-ready: counts, waits, the refused signatures (repr) and dynamo's reasons."""
        return {"enabled": self.enabled, "compiles": len(self.compiles),
                "recompiles_after_warmup": self.recompiles_after_warmup,
                "recompile_sigs": [repr(s) for s in self.recompile_sigs],
                "recompile_reasons": list(self.recompile_reasons),
                "race_errors": self.race_errors, "race_by_class": dict(self.race_by_class),
                "shared_wait_s": self.shared_wait_s, "exclusive_wait_s": self.exclusive_wait_s,
                "exclusive_hold_s": self.exclusive_hold_s}


class Gate:
    """Writer-preferring, phase-fair readers-writer gate + compile bookkeeping. Use :func:`get_gate`."""

    enabled = True

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._readers = 0  # readers inside
        self._writer: int | None = None  # thread ident of the exclusive holder
        self._writer_depth = 0
        self._w_waiting = 0
        self._r_waiting = 0
        self._phase = 0  # bumped when a writer leaves with readers waiting: those readers are admitted
        self._admit = 0  # admitted readers not yet inside; writers wait for them
        self._tl = threading.local()
        self._warm = False
        self._seen: dict[Hashable, float] = {}
        self._stats_lock = threading.Lock()
        self._compiles: list[dict[str, Any]] = []
        self._recompiles: list[Hashable] = []
        self._recompile_reasons: list[str] = []
        self._race: dict[str, int] = {}
        self._shared_wait = 0.0
        self._excl_wait = 0.0
        self._excl_hold = 0.0
        self._n_shared = 0
        self._n_excl = 0
        self._max_shared_wait = 0.0
        self._max_excl_wait = 0.0
        self._excl_reasons: dict[str, int] = {}

    # ---- per-thread re-entrancy -------------------------------------------------------------
    def _depths(self) -> threading.local:
        tl = self._tl
        if not hasattr(tl, "shared"):
            tl.shared = 0
            tl.excl = 0
        return tl

    # ---- shared side ------------------------------------------------------------------------
    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Warm work. Many threads at once. Watchdog: both global flags must be clear on entry."""
        d = self._depths()
        if d.excl or d.shared:  # already inside the gate in this thread: pass through
            d.shared += 1
            try:
                yield
            finally:
                d.shared -= 1
            return
        t0 = time.perf_counter()
        with self._cv:
            if self._writer is not None or self._w_waiting:
                self._r_waiting += 1
                phase = self._phase
                while not (self._phase != phase or (self._writer is None and not self._w_waiting)):
                    self._cv.wait()
                self._r_waiting -= 1
                if self._phase != phase:
                    self._admit -= 1
                    if self._admit == 0:
                        self._cv.notify_all()
            self._readers += 1
            # no exclusive holder exists now: both flags must be clear
            try:
                check_flags("gate.shared")
            except BaseException:
                self._readers -= 1
                self._cv.notify_all()
                raise
        w = time.perf_counter() - t0
        with self._stats_lock:
            self._shared_wait += w
            self._n_shared += 1
            self._max_shared_wait = max(self._max_shared_wait, w)
        d.shared = 1
        try:
            yield
        finally:
            d.shared = 0
            with self._cv:
                self._readers -= 1
                if self._readers == 0:
                    self._cv.notify_all()

    # ---- exclusive side ---------------------------------------------------------------------
    @contextlib.contextmanager
    def exclusive(self, reason: str = "") -> Iterator[None]:
        """Anything that may compile or trace. Excludes every other gate user."""
        d = self._depths()
        if d.excl:
            d.excl += 1
            try:
                yield
            finally:
                d.excl -= 1
            return
        if d.shared:
            raise RuntimeError(
                f"gate.exclusive({reason!r}) requested while this thread holds gate.shared: that would "
                "deadlock. Leave the shared block first (or use gate.run, which retries outside it).")
        t0 = time.perf_counter()
        with self._cv:
            self._w_waiting += 1
            try:
                while self._writer is not None or self._readers or self._admit:
                    self._cv.wait()
            finally:
                self._w_waiting -= 1
            self._writer = threading.get_ident()
        t1 = time.perf_counter()
        d.excl = 1
        restore_stance = False
        try:
            if self._warm:
                _set_stance("default")  # process-global; no reader is inside to observe it
                restore_stance = True
            yield
        finally:
            try:
                if restore_stance and self._warm:
                    _set_stance("fail_on_recompile")
            finally:
                d.excl = 0
                t2 = time.perf_counter()
                with self._cv:
                    self._writer = None
                    if self._r_waiting:
                        self._phase += 1
                        self._admit += self._r_waiting
                    self._cv.notify_all()
                with self._stats_lock:
                    self._excl_wait += t1 - t0
                    self._excl_hold += t2 - t1
                    self._n_excl += 1
                    self._max_excl_wait = max(self._max_excl_wait, t1 - t0)
                    key = reason or "?"
                    self._excl_reasons[key] = self._excl_reasons.get(key, 0) + 1

    # ---- warm state -------------------------------------------------------------------------
    def mark_warm(self) -> None:
        """Warmup is over: from now on a recompile under shared is refused (fail_on_recompile),
        counted and retried under exclusive. Call from a thread that holds nothing."""
        with self.exclusive("mark_warm"):  # no reader inside: safe to flip the global stance
            self._warm = True
            _set_stance("fail_on_recompile")

    def mark_cold(self) -> None:
        """Back to warmup mode (stance default). Mainly for tests and teardown."""
        with self.exclusive("mark_cold"):
            self._warm = False
            _set_stance("default")

    @property
    def warm(self) -> bool:
        return self._warm

    # ---- the worker API ---------------------------------------------------------------------
    def run(self, sig: Hashable, fn: Callable[[], Any]) -> Any:
        """Run one iteration ``fn()`` identified by ``sig`` (hashable: callable name, device, shapes).

        Unseen sig -> exclusive, recorded as a compile (with seconds). Seen before mark_warm ->
        exclusive too (any call may still compile). Seen after it -> shared; if a
        compiled call needs to recompile, fail_on_recompile refuses it before any work is done; the
        refusal is counted (with its sig) and fn is retried under exclusive with the default stance.
        FX-nested-trace errors are counted in race_errors and re-raised. ``fn`` must do its state
        mutations (optimizer step) after its compiled calls, so a refused attempt has no effect.
        """
        with self._stats_lock:
            known = sig in self._seen
        if not known:
            return self._run_exclusive(sig, fn, "compile")
        if not self._warm:
            # before mark_warm nothing refuses a recompile: a seen sig whose guards fail (a new
            # document layout, say) would compile on the shared side, where the process-global
            # is_compiling() it sets poisons every reader's entry check. Exclusive until warm.
            return self._run_exclusive(sig, fn, "cold")
        try:
            with self.shared():
                return fn()
        except RuntimeError as e:
            if is_recompile_refusal(e) and self._depths().shared == 0:
                with self._stats_lock:
                    self._recompiles.append(sig)
                    # dynamo's guard-failure text says WHY (which input or global changed)
                    msg = str(e)
                    i = msg.find("triggered by")
                    self._recompile_reasons.append(msg[i if i >= 0 else 0:][:800])
                return self._run_exclusive(sig, fn, "recompile")
            self._note_error(e)
            raise
        except Exception as e:
            self._note_error(e)
            raise

    def _run_exclusive(self, sig: Hashable, fn: Callable[[], Any], why: str) -> Any:
        with self.exclusive(f"{why}:{sig!r}"[:200]):
            return self._call_recorded(sig, fn)

    def _call_recorded(self, sig: Hashable, fn: Callable[[], Any]) -> Any:
        """``fn()``; the first call of ``sig`` is recorded as a compile, errors are classified."""
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as e:
            self._note_error(e)
            raise
        dt = time.perf_counter() - t0
        with self._stats_lock:
            if sig not in self._seen:
                self._seen[sig] = dt
                self._compiles.append({"sig": sig, "seconds": round(dt, 4), "warm": self._warm})
        return r

    def _note_error(self, e: BaseException) -> None:
        c = classify_error(e)
        if c in (FX_NESTED, IS_COMPILING_LEAK, "POISONED"):
            with self._stats_lock:
                self._race[c] = self._race.get(c, 0) + 1

    def note_race_error(self, e: BaseException) -> str:
        """Count an error caught outside gate.run if it is a race symptom; returns its class."""
        self._note_error(e)
        return classify_error(e)

    # ---- stats ------------------------------------------------------------------------------
    def stats(self) -> GateStats:
        with self._stats_lock:
            return GateStats(
                enabled=self.enabled, warm=self._warm,
                compiles=tuple(dict(c) for c in self._compiles),
                recompile_sigs=tuple(self._recompiles),
                recompile_reasons=tuple(self._recompile_reasons),
                shared_wait_s=round(self._shared_wait, 4),
                exclusive_wait_s=round(self._excl_wait, 4),
                exclusive_hold_s=round(self._excl_hold, 4),
                max_shared_wait_s=round(self._max_shared_wait, 4),
                max_exclusive_wait_s=round(self._max_excl_wait, 4),
                shared_entries=self._n_shared, exclusive_entries=self._n_excl,
                race_by_class=dict(self._race))


class NoGate(Gate):
    """``DFLASH_GATE=off``: no coordination at all, for the gate-on-vs-off benchmark only.

    Every call runs directly in its thread; compiles are still recorded (first sight of a sig)
    and race symptoms still counted, so an ungated run reports what went wrong. The warm stance
    is never set: an ungated steady state that needs a recompile just compiles (and may race).
    """

    enabled = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def exclusive(self, reason: str = "") -> Iterator[None]:
        yield

    def mark_warm(self) -> None:
        self._warm = True

    def mark_cold(self) -> None:
        self._warm = False

    def run(self, sig: Hashable, fn: Callable[[], Any]) -> Any:
        return self._call_recorded(sig, fn)


_GATE: Gate | None = None
_GATE_LOCK = threading.Lock()


def get_gate() -> Gate:
    """The process-wide singleton. There must be exactly one gate per process.
    ``DFLASH_GATE=off`` in the environment gives a :class:`NoGate` (benchmarks only)."""
    global _GATE
    with _GATE_LOCK:
        if _GATE is None:
            _GATE = NoGate() if settings.gate_off() else Gate()
        return _GATE
