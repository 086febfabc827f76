"""The data checks that need no model: source names, source files, counts against max_prompts.

They are facts of the spec (and the files it names), so they run before any heavy work:
``dflash validate`` runs them all; Snakemake runs the ones that read no file content when it loads
the specs (rules/common.smk: a mistake refuses that spec's targets before any job, so no warm-up
compile starts for it); the data stage runs them all again first. Every error names the spec file
and the field path (``data.sources[1].source``). Light imports only (no torch, no tokenizer).
"""
from __future__ import annotations

import difflib
import math
from pathlib import Path

from ..errors import DFlashError, SpecError
from ..spec.types import SourceSpec
from .prompts import CHATTERBOT, load_prompts

SELF_WRITTEN = "self-written"
SYNTHETIC = "synthetic"
SUFFIXES = (".jsonl", ".parquet")
NAMES = (CHATTERBOT, SELF_WRITTEN, SYNTHETIC)


def source_quotas(d) -> list[tuple[str, int]]:
    """(source, prompts wanted) per entry of ``data.sources`` (or the one ``data.source``).

    ``count`` entries get their count; the others share ``max_prompts`` minus the counts by
    ``weight`` (default 1; largest remainder, ties to the earlier entry).
    """
    entries = d.sources or (SourceSpec(source=d.source, count=d.max_prompts),)
    fixed = 0
    for i, e in enumerate(entries):
        if e.count is not None and e.weight is not None:
            raise SpecError(f"data.sources[{i}]: give 'count' or 'weight', not both")
        if e.source == SYNTHETIC:
            raise SpecError(f"data.sources[{i}]: 'synthetic' cannot be mixed (use data.source)")
        fixed += e.count or 0
    if sum(e.source == SELF_WRITTEN for e in entries) > 1:
        raise SpecError("data.sources: list 'self-written' once (give it the whole count)")
    first: dict[str, int] = {}
    for i, e in enumerate(entries):
        j = first.setdefault(str(Path(e.source).expanduser()), i)
        if j != i:  # the second entry would take only duplicates of the first's prompts
            raise SpecError(f"data.sources[{i}]: field 'source' {e.source!r} is listed twice "
                            f"(also data.sources[{j}]); give it once, with the sum of the "
                            f"counts or weights")
    rest = d.max_prompts - fixed
    weighted = [(i, float(e.weight or 1.0)) for i, e in enumerate(entries)
                if e.count is None]
    if rest < 0 or (weighted and rest == 0):
        raise SpecError(f"data.sources: the counts add up to {fixed}, "
                        f"{'more than' if rest < 0 else 'all of'} data.max_prompts "
                        f"{d.max_prompts}" + (", leaving none for the weighted entries"
                                                 if rest == 0 else ""))
    share = {i: 0 for i, _ in weighted}
    if weighted:
        for i, w in weighted:
            if not math.isfinite(w):
                raise SpecError(f"data.sources[{i}]: field 'weight' must be a finite number, "
                                f"got {w}")
        # relative to the largest: weights near the float limit (1e308) cannot overflow the sum
        top = max(w for _, w in weighted)
        total = sum(w / top for _, w in weighted)
        exact = {i: rest * (w / top) / total for i, w in weighted}
        share = {i: int(x) for i, x in exact.items()}
        left = rest - sum(share.values())
        for i in sorted(exact, key=lambda i: (-(exact[i] - share[i]), i))[:left]:
            share[i] += 1
    for i, n in share.items():
        if n == 0:
            raise SpecError(f"data.sources[{i}]: field 'weight' {entries[i].weight} gives "
                            f"{entries[i].source} 0 of the {rest} weighted prompts; raise its "
                            f"weight, give it a count, or drop the entry")
    return [(e.source, e.count if e.count is not None else share[i])
            for i, e in enumerate(entries)]


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
    if d.self_written.categories and SELF_WRITTEN not in (s for _, s in source_fields(d)):
        raise SpecError(f"{file}: field 'data.self_written.categories': steers self-written "
                        f"prompts, but no data source is '{SELF_WRITTEN}'")
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
