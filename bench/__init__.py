"""The lab notebook: measurement scripts, each runnable from the repository root as
``python -m bench.<name>`` (CPU) or ``python -m bench.gpu.<name>`` (the device), their committed
results under ``bench/results/`` and the index of both in ``bench/README.md``.

May import: ``dflash`` and ``bench`` itself; nothing in ``dflash`` imports ``bench``.
"""
