"""torch's process-global tracing hazards, as the compile gate (:mod:`dflash.runtime.gate`) and
every worker thread meet them: the watchdog on the two global flags (:func:`check_flags`), the
classes of the errors the race causes (:func:`classify_error`, :func:`is_recompile_refusal`), and
the per-thread dynamo config every worker applies first (:func:`worker_thread_setup`; dynamo
config is per thread in torch 2.13). docs/gate.md has the why.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from dflash.errors import PoisonedProcess

FX_NESTED = "FX_NESTED_TRACE"  # "Detected that you are using FX to symbolically trace a dynamo-optimized function"
RECOMPILE_REFUSED = "RECOMPILE_REFUSED"  # fail_on_recompile stance refused a compile
IS_COMPILING_LEAK = "IS_COMPILING_LEAK"  # eager code saw is_compiling() True (e.g. foreach optimizer)
RECOMPILE_LIMIT = "RECOMPILE_LIMIT"  # fail_on_recompile_limit_hit
_FX_MSG = "using FX to symbolically trace a dynamo-optimized function"
_FX_JIT_MSG = "using FX to torch.jit.trace a dynamo-optimized function"
_REFUSE_MSG = "torch.compile stance is 'fail_on_recompile'"

# Settings applied in every worker thread unless overridden (keys unknown to this torch are skipped).
DEFAULT_DYNAMO_CFG: dict[str, Any] = {
    "recompile_limit": 64,  # our bucketed shapes are a closed set; 8 is too low for a warmup sweep
    "accumulated_recompile_limit": 4096,
    "fail_on_recompile_limit_hit": True,  # hitting the limit must raise, not silently run eager
    "error_on_nested_fx_trace": True,  # never turn the race into silent eager runs
    "suppress_errors": False,  # a compile failure must raise, not fall back to eager
}


def _fx_flag() -> bool:
    return bool(torch.fx._symbolic_trace._is_fx_tracing_flag)


def check_flags(where: str = "gate.shared") -> None:
    """Raise PoisonedProcess if either process-global tracing flag is set (call only where none may be)."""
    fx, comp = _fx_flag(), bool(torch.compiler.is_compiling())
    if not (fx or comp):
        return
    which = " and ".join(
        n for n, v in (("torch.fx._symbolic_trace._is_fx_tracing_flag", fx),
                       ("torch.compiler.is_compiling()", comp)) if v)
    raise PoisonedProcess(
        f"process is poisoned: {which} is True on entry to {where} while no exclusive gate holder "
        "exists (some code traced or compiled outside the gate, or a lost update left the flag stuck). "
        "Every compiled call in this process may now fail; the process must be restarted.")


def classify_error(exc: BaseException) -> str:
    """Class of an exception raised around compiled calls: FX_NESTED_TRACE, RECOMPILE_REFUSED, ..."""
    msg = str(exc)
    if _FX_MSG in msg or _FX_JIT_MSG in msg:
        return FX_NESTED
    if _REFUSE_MSG in msg:
        return RECOMPILE_REFUSED
    if "recompile_limit" in msg or "cache_size_limit" in msg:
        return RECOMPILE_LIMIT
    if isinstance(exc, PoisonedProcess):
        return "POISONED"
    if isinstance(exc, TypeError) and ("foreach" in msg or "is_compiling" in msg
                                       or "expected Tensor as element" in msg):
        # eager foreach optimizer took its "compiling" branch because another thread was compiling
        return IS_COMPILING_LEAK
    first = msg.strip().splitlines()[0] if msg.strip() else ""
    return f"{type(exc).__name__}: {first[:90]}"


def is_recompile_refusal(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and _REFUSE_MSG in str(exc)


def worker_thread_setup(**dynamo_cfg: Any) -> dict[str, Any]:
    """Apply dynamo config inside the calling thread (it is per-thread in torch 2.13; harmless where
    it is global). Defaults: :data:`DEFAULT_DYNAMO_CFG`; explicit keys override and must exist.
    Returns the settings applied."""
    cfg = torch._dynamo.config
    applied: dict[str, Any] = {}
    for k, v in {**DEFAULT_DYNAMO_CFG, **dynamo_cfg}.items():
        if not hasattr(cfg, k):
            if k in dynamo_cfg:
                raise AttributeError(f"torch._dynamo.config.{k} does not exist in torch {torch.__version__}")
            continue
        setattr(cfg, k, v)
        applied[k] = v
    if applied.get("error_on_nested_fx_trace") is False:
        warnings.warn("error_on_nested_fx_trace=False turns the FX race into silent eager runs", stacklevel=2)
    return applied
