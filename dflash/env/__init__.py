"""The environment tooling: lock files (:mod:`.lock`), live facts (:mod:`.facts`), drift and the
check every later stage runs first (:mod:`.drift`), build-mode venvs (:mod:`.venv`), adopt-mode
locks from a package listing (:mod:`.freeze`) and the audit (:mod:`.audit`). The env stage itself
is :mod:`dflash.stages.env`.

Standard library only at import time (plus ``dflash.artifacts.manifest``/``dflash.errors``; the
spec only inside a function), so ``dflash check-env`` works in any interpreter that has the
repository on its path.
"""
