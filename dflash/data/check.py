"""The data checks that need no model: source names, source files, counts against max_prompts.

They are facts of the spec (and the files it names), so they run before any heavy work:
``dflash validate`` runs them all; Snakemake runs the ones that read no file content when it loads
the specs (rules/common.smk: a mistake refuses that spec's targets before any job, so no warm-up
compile starts for it); the data stage runs them all again first. Every error names the spec file
and the field path (``data.sources[1].source``). Light imports only (no torch, no tokenizer).
"""
from __future__ import annotations

import difflib
from pathlib import Path

from ..errors import DFlashError, SpecError
from .prompts import CHATTERBOT, load_prompts
from .sources import SELF_WRITTEN, SYNTHETIC, source_quotas

SUFFIXES = (".jsonl", ".parquet")
NAMES = (CHATTERBOT, SELF_WRITTEN, SYNTHETIC)


def source_fields(d) -> list[tuple[str, str]]:
    """(field path, source) for ``data.source`` or each entry of ``data.sources``."""
    if d.sources:
        return [(f"data.sources[{i}].source", e.source) for i, e in enumerate(d.sources)]
    return [("data.source", d.source)]


def _file_problem(source: str) -> str | None:
    """Why ``source`` (not a built-in name) cannot be read as a prompt file, or None."""
    path = Path(source)
    if path.suffix.lower() not in SUFFIXES:
        if path.is_file():
            return f"unsupported file type '{path.suffix}' (use {CHATTERBOT}, a .jsonl or a .parquet)"
        hint = difflib.get_close_matches(source, NAMES, n=1, cutoff=0.5)
        return (f"{source!r} is neither a source name ({', '.join(NAMES)}) nor a .jsonl/.parquet "
                f"file" + (f" — did you mean '{hint[0]}'?" if hint else ""))
    if not path.is_file():
        near = []
        if path.parent.is_dir():
            near = difflib.get_close_matches(path.name, [p.name for p in path.parent.iterdir()],
                                             n=1, cutoff=0.6)
        return (f"file {source} not found (relative paths are from the directory Snakemake runs "
                f"in: {Path.cwd()})" + (f" — did you mean '{path.parent / near[0]}'?" if near
                                        else ""))
    return None


def check_data(spec, read_files: bool = True) -> None:
    """Raise :class:`SpecError` (spec file + field path) for the first data mistake found.

    ``read_files``: also read every prompt file and the chatterbot corpus the way the data stage
    will (records parse, bad fraction within ``data.max_bad_fraction``, something usable left);
    without it only names, file existence and counts are checked (no file is opened)."""
    d, file = spec.data, spec.path
    if d.source == SYNTHETIC:
        return
    try:
        source_quotas(d)
    except SpecError as e:  # "data.sources[i]: ..." -> with the spec file and the field quoted
        field, _, msg = str(e).partition(": ")
        raise SpecError(f"{file}: field '{field}': {msg}") from None
    for field, source in source_fields(d):
        if d.sources and source == SYNTHETIC:
            continue  # refused by source_quotas above
        if source not in NAMES and (why := _file_problem(source)):
            raise SpecError(f"{file}: field '{field}': {why}")
    if not read_files:
        return
    for field, source in source_fields(d):
        if source == SELF_WRITTEN:
            continue
        try:
            load_prompts(source, 1, spec.seed, d.max_bad_fraction)
        except DFlashError as e:  # its messages say "data.source <x>: ..."
            msg = str(e).removeprefix(f"data.source {source}: ").removeprefix("data.source: ")
            raise SpecError(f"{file}: field '{field}' ({source}): {msg}") from None
