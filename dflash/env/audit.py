"""``dflash audit``: pinned vs live environment versions; exit 0 = no drift, 1 = drift, 2 = bad input.

    dflash audit results/<spec>/env/manifest.json   # against what the env stage recorded
    dflash audit --lock envs/cpu-py311.lock          # against a lock (+ its -nodeps lock)
    ... [--json] [--python PATH]

With a manifest, the interpreter audited is the one the env stage recorded (the build-mode venv, or
the adopted interpreter) unless ``--python`` names another; with ``--lock`` it is this one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from ..errors import DFlashError
from ..artifacts.manifest import read_manifest
from .drift import diff_manifest, diff_pins
from .facts import STACK_KEYS, key_stack, live_env
from .lock import locked_pins, normalize, version_matches

_LABELS = {"python": "python", "torch": "torch", "cuda": "CUDA (torch.version.cuda)",
           "cudnn": "cuDNN", "nccl": "NCCL", "triton": "triton", "transformers": "transformers",
           "driver": "NVIDIA driver", "gpus": "GPUs", "interpreter": "interpreter"}


def _s(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "none"
    return str(v)


def audit(manifest: str | None = None, lock: str | None = None,
          python: str | None = None) -> dict:
    """Return the audit as a dict: interpreter, stack rows, package drift, summary."""
    if manifest:
        m = read_manifest(manifest, "env")
        py = python or m.get("interpreter")
        if not python and (not py or not os.path.exists(py)):
            py = sys.executable
        facts = live_env(py, probe_torch=True)
        drift = diff_manifest(m, facts)
        pinned_stack = dict(m.get("stack", {}))
        pinned_names = set(m.get("pinned", {}))
        source = {"manifest": str(manifest), "lock": m.get("lock", {}).get("path"),
                  "lock_sha256": m.get("lock", {}).get("sha256"), "mode": m.get("mode")}
    else:
        py = python or sys.executable
        facts = live_env(py, probe_torch=True)
        pins = locked_pins(lock, facts)
        drift = diff_pins(pins, facts)
        # a lock pins packages, not the driver/GPUs: the stack's pinned column shows lock pins
        pinned_stack = {k: None for k in STACK_KEYS}
        for k in ("torch", "triton", "transformers"):
            if k in pins:
                pinned_stack[k] = pins[k]["version"]
        pinned_names = set(pins)
        source = {"lock": str(lock)}
    live_stack = key_stack(facts)
    probed = facts.get("torch", {}).get("probed", False)
    pkg_drift = [d for d in drift if d["kind"] == "package"]
    other = [d for d in drift if d["kind"] != "package"]
    rows = []
    for k in STACK_KEYS:
        pin, got = pinned_stack.get(k), live_stack.get(k)
        if manifest:
            ok = pin == got or (k in ("cudnn", "nccl") and not probed)
        else:
            ok = pin is None or version_matches(str(pin), got)
        rows.append({"item": k, "pinned": pin, "live": got, "ok": ok})
    for d in other:
        if d["name"] not in STACK_KEYS:
            rows.append({"item": d["name"], "pinned": d["pinned"], "live": d["found"], "ok": False})
    n_stack = sum(not r["ok"] for r in rows)
    return {"source": source, "interpreter": facts.get("interpreter"), "python": facts.get("python"),
            "platform": facts.get("platform"), "packages_checked": len(pinned_names),
            # installed but not pinned (the package itself, pip, ...): listed, never drift
            "extras": sorted(set(facts.get("packages", {})) - {normalize(n) for n in pinned_names}),
            "packages_installed": len(facts.get("packages", {})), "stack": rows,
            "packages": [{"name": d["name"], "pinned": d["pinned"], "live": d["found"]}
                         for d in pkg_drift],
            "drift": bool(pkg_drift) or n_stack > 0, "packages_differ": len(pkg_drift),
            "stack_differ": n_stack}


def summary_line(r: dict) -> str:
    if not r["drift"]:
        return "OK: no drift"
    line = f"DRIFT: {r['packages_differ']} packages differ"
    if r["stack_differ"]:
        items = ", ".join(x["item"] for x in r["stack"] if not x["ok"])
        line += f", {r['stack_differ']} stack items differ ({items})"
    return line


def render(r: dict, file=None) -> None:
    file = file or sys.stdout
    src = r["source"].get("manifest") or r["source"].get("lock")
    extras = r.get("extras", [])
    head = (f"audit of {r['interpreter']} (python {r['python']}, {r['platform']})\n"
            f"against {src}: each of its {r['packages_checked']} pinned packages must be "
            f"installed at exactly its version; {r['packages_installed']} are installed, "
            f"{len(extras)} of them not pinned (not checked"
            + (f": {', '.join(extras[:8])}{', ...' if len(extras) > 8 else ''})" if extras
               else ")"))
    stack = [(_LABELS.get(x["item"], x["item"]), _s(x["pinned"]), _s(x["live"]),
              "ok" if x["ok"] else "DIFF") for x in r["stack"]]
    pk = [(x["name"], _s(x["pinned"]), x["live"] or "not installed", "DIFF") for x in r["packages"]]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        con = Console(file=file, width=max(100, shutil_width()), highlight=False,
                      soft_wrap=False)
        con.print(head, soft_wrap=True)
        for title, data in (("key stack", stack), (f"packages that differ ({len(pk)})", pk)):
            if not data:
                continue
            t = Table(title=title, title_justify="left", show_lines=False)
            for col in ("item" if data is stack else "package", "pinned", "live", ""):
                t.add_column(col, overflow="fold")
            for row in data:
                style = None if row[3] == "ok" else "bold red"
                t.add_row(*row, style=style)
            con.print(t)
        con.print(summary_line(r), style="bold green" if not r["drift"] else "bold red")
        return
    print(head, file=file)
    for title, data in (("key stack", stack), (f"packages that differ ({len(pk)})", pk)):
        if not data:
            continue
        w = [max(len(str(row[i])) for row in data + [("item", "pinned", "live", "")])
             for i in range(4)]
        print(f"\n{title}", file=file)
        print("  ".join(h.ljust(w[i]) for i, h in enumerate(("item", "pinned", "live", ""))),
              file=file)
        for row in data:
            print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(row)).rstrip(), file=file)
    print(summary_line(r), file=file)


def shutil_width() -> int:
    return shutil.get_terminal_size((100, 24)).columns


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash audit",
                                 description="Pinned vs live environment versions; exit 0 OK, "
                                             "1 drift, 2 bad input.")
    ap.add_argument("manifest", nargs="?", help="results/<spec>/env/manifest.json")
    ap.add_argument("--lock", help="audit against a lock file instead (envs/<file>)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--python", help="interpreter to audit (default: the manifest's, or this one)")
    a = ap.parse_args(argv)
    if bool(a.manifest) == bool(a.lock):
        print("dflash audit: give exactly one of MANIFEST or --lock LOCKFILE", file=sys.stderr)
        return 2
    if a.manifest and not Path(a.manifest).is_file():
        print(f"{a.manifest}: no such manifest (run the env stage first)", file=sys.stderr)
        return 2
    try:
        r = audit(a.manifest, a.lock, a.python)
    except DFlashError as e:
        print(str(e).splitlines()[0] if str(e) else type(e).__name__, file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"dflash audit: {e}", file=sys.stderr)
        return 2
    try:
        if a.json:
            r["summary"] = summary_line(r)
            print(json.dumps(r, indent=None, sort_keys=True, default=str))
        else:
            render(r)
        sys.stdout.flush()
    except BrokenPipeError:                       # `| head`: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1 if r["drift"] else 0

