"""Every ``DFLASH_*`` environment switch: its name, default and meaning (:data:`SETTINGS`, the
table in docs/design.md) and one reader each, read at call time (never at import: a test or a
launcher that sets one before the call is obeyed).

Owns: the names and the parsing. Imports nothing from the package (the env tooling reads it
before any environment exists). Readers take an optional ``env`` mapping (default
``os.environ``) so code that builds another process's environment can ask about that one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    meaning: str


SETTINGS = (
    Setting("DFLASH_CACHE", ".cache/dflash",
            "converted targets and the per-environment compile caches (dflash.artifacts.cache)"),
    Setting("DFLASH_VENV_DIR", "", "where build-mode venvs live; unset: ./.venvs (dflash.env.venv)"),
    Setting("DFLASH_WHEEL_DIR", "", "adopt mode: the wheels of the image's overlay lock when "
            "env.wheel_dir is unset (dflash.env.overlay)"),
    Setting("DFLASH_ALLOW_DRIFT", "", "1/true/yes: run despite environment drift, loudly "
            "(dflash.env.drift)"),
    Setting("DFLASH_GATE", "on", "off: no compile gate (the gate-on-vs-off benchmark only; "
            "dflash.runtime.gate)"),
    Setting("DFLASH_FAIL_AT", "", "test hook: 'drafter-0:3,target-0:5[@rank]' makes that worker "
            "raise at that step (dflash.runtime.faults)"),
    Setting("DFLASH_RDZV_ENDPOINT", "", "host:port of the multi-node rendezvous; overrides "
            "topology.rendezvous (dflash.runtime.launch)"),
    Setting("DFLASH_NODE_RANK", "", "this machine's node rank, for multi-node runs started by "
            "hand (dflash.runtime.launch)"),
    Setting("DFLASH_DIST_WORKER", "", "set to 1 by the launcher for the processes torchrun "
            "starts (dflash.runtime.distributed)"),
    Setting("DFLASH_GPUS_PER_NODE", "0", "set by the launcher for simulated nodes on one "
            "machine: GPUs per local process"),
    Setting("DFLASH_LAUNCH_VISIBLE_DEVICES", "", "set by the launcher: the GPUs it saw, split "
            "among the local processes"),
    Setting("DFLASH_HEARTBEAT_S", "1", "seconds between multi-node watchdog heartbeats"),
    Setting("DFLASH_HEARTBEAT_TIMEOUT_S", "15", "seconds without a heartbeat before a peer "
            "counts as lost"),
    Setting("DFLASH_COLLECTIVE_TIMEOUT_S", "600", "backstop timeout of a cross-node "
            "collective (the watchdog acts first)"),
    Setting("DFLASH_SLOW_TESTS", "", "1: also run the slow tests (cold CPU flex_attention "
            "compiles; tests only)"),
    Setting("DFLASH_TARGET_STREAM", "shared", "own: a target worker on a GPU it shares with a "
            "drafter queues on its own CUDA stream, beside the drafter's steps (an A/B switch; "
            "dflash.train.streams)"),
    Setting("DFLASH_STEP_READOUT", "lagged", "sync: a training step's loss, hits and grad norm "
            "are read to the host right after the step, not one step later (an A/B switch; "
            "dflash.train.readout)"),
    Setting("DFLASH_FLEX_KERNEL_OPTIONS", "", "KEY=INT,...: fixed flex_attention kernel options "
            "for the target's layers, e.g. BLOCK_M=128,BLOCK_N=64,num_stages=3,num_warps=8; "
            "unset: inductor's own choice (dflash.models.features; bench/gpu/cold_compile.py)"),
)
_DEFAULTS = {s.name: s.default for s in SETTINGS}

DIST_WORKER = "DFLASH_DIST_WORKER"
GPUS_PER_NODE = "DFLASH_GPUS_PER_NODE"
LAUNCH_VISIBLE_DEVICES = "DFLASH_LAUNCH_VISIBLE_DEVICES"
FAIL_AT = "DFLASH_FAIL_AT"
ALLOW_DRIFT = "DFLASH_ALLOW_DRIFT"
VENV_DIR = "DFLASH_VENV_DIR"


def get(name: str, env: Mapping[str, str] | None = None) -> str:
    """The raw value of a ``DFLASH_*`` switch, or its default ('' for an unset flag)."""
    if name not in _DEFAULTS:
        raise KeyError(f"{name} is not a dflash setting (dflash.settings.SETTINGS)")
    return (os.environ if env is None else env).get(name, _DEFAULTS[name])


def cache_root() -> str:
    return get("DFLASH_CACHE")


def venv_dir() -> str | None:
    return get(VENV_DIR) or None


def wheel_dir() -> str | None:
    return get("DFLASH_WHEEL_DIR") or None


def allow_drift() -> bool:
    return get(ALLOW_DRIFT).strip().lower() in ("1", "true", "yes")


def gate_off() -> bool:
    return get("DFLASH_GATE") == "off"


def fail_at() -> str:
    return get(FAIL_AT)


def rdzv_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    return get("DFLASH_RDZV_ENDPOINT", env) or None


def node_rank(env: Mapping[str, str] | None = None) -> str | None:
    return get("DFLASH_NODE_RANK", env) or None


def dist_worker() -> bool:
    return get(DIST_WORKER) == "1"


def gpus_per_node() -> int:
    return int(get(GPUS_PER_NODE) or 0)


def launch_visible_devices() -> list[str]:
    return [d for d in get(LAUNCH_VISIBLE_DEVICES).split(",") if d]


def heartbeat_s() -> float:
    return float(get("DFLASH_HEARTBEAT_S"))


def heartbeat_timeout_s() -> float:
    return float(get("DFLASH_HEARTBEAT_TIMEOUT_S"))


def collective_timeout_s() -> float:
    return float(get("DFLASH_COLLECTIVE_TIMEOUT_S"))


def slow_tests() -> bool:
    return bool(get("DFLASH_SLOW_TESTS"))


def target_stream() -> str:
    """``DFLASH_TARGET_STREAM``: 'shared' (the device's default stream) or 'own'."""
    v = get("DFLASH_TARGET_STREAM").strip().lower() or "shared"
    if v not in ("shared", "own"):
        raise ValueError(f"DFLASH_TARGET_STREAM: {v!r} is not 'shared' or 'own'")
    return v


def step_readout() -> str:
    """``DFLASH_STEP_READOUT``: 'lagged' (a step's figures read after the next step is queued)
    or 'sync'."""
    v = get("DFLASH_STEP_READOUT").strip().lower() or "lagged"
    if v not in ("lagged", "sync"):
        raise ValueError(f"DFLASH_STEP_READOUT: {v!r} is not 'lagged' or 'sync'")
    return v


def flex_kernel_options() -> dict[str, int] | None:
    """``DFLASH_FLEX_KERNEL_OPTIONS`` as a dict of ints (true/false read as 1/0), or None."""
    raw = get("DFLASH_FLEX_KERNEL_OPTIONS").strip()
    if not raw:
        return None
    out: dict[str, int] = {}
    for item in raw.split(","):
        key, _, val = (p.strip() for p in item.partition("="))
        val = {"true": "1", "false": "0"}.get(val.lower(), val)
        if not key or not val.lstrip("-").isdigit():
            raise ValueError(f"DFLASH_FLEX_KERNEL_OPTIONS: {item.strip()!r} is not KEY=INT "
                             f"(e.g. BLOCK_M=128,BLOCK_N=64,num_stages=3,num_warps=8)")
        out[key] = int(val)
    return out
