"""What every bench script ends with: its ``__main__`` (:func:`run`: a :class:`DFlashError`, bad
input such as a missing file or a malformed JSON, is one line naming the file, never a traceback,
as the CLI does), its result file (:func:`write_result`: the JSON, written atomically), the
command that made it (:func:`command_line`, the result's ``command``) and the machine it ran on
(:func:`host_facts`, the result's ``host``).
"""
from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from dflash.errors import DFlashError
from dflash.artifacts.manifest import atomic_write_text


def run(main: Callable[[], int | None]) -> None:
    """``sys.exit(main())``; a DFlashError prints ``error: ...`` and exits with its code."""
    try:
        sys.exit(main())
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def command_line(module: str, argv: list[str] | None) -> str:
    """``python -m <module> <arguments>`` as the script was called: ``argv`` when ``main`` was
    handed one (tests, one script calling another), else the process's own."""
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)


def write_result(path: str | Path, doc: dict) -> None:
    """``doc`` as indented JSON at ``path`` (its folder made), atomically: a run cut by its
    device call's limit leaves the previous file or the whole new one, never half."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")


def host_facts(load_avg_1min: float | None = None) -> dict:
    """The machine a timing ran on: cores, architecture, torch, and the 1-minute load average
    (``load_avg_1min``, measured now unless the caller took it at its start): the boxes are
    shared, and other processes' load inflates the many-thread rows. torch's version from its
    installed metadata, so the scripts that time no torch do not import it."""
    load = round(os.getloadavg()[0], 2) if load_avg_1min is None else load_avg_1min
    return {"cores": os.cpu_count(), "machine": platform.machine(), "torch": version("torch"),
            "load_avg_1min": load}
