"""The ``__main__`` of a bench script: run ``main()``, and a :class:`DFlashError` (bad input: a
missing file, a malformed JSON) is one line naming the file, never a traceback, as the CLI does.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

from dflash.errors import DFlashError


def run(main: Callable[[], int | None]) -> None:
    """``sys.exit(main())``; a DFlashError prints ``error: ...`` and exits with its code."""
    try:
        sys.exit(main())
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
