"""runtime: the process machinery every stage stands on. The compile gate (gate.py) and torch's
tracing hazards it guards (tracing.py), a device's busy time (busy.py) and peak memory
(device_memory.py), a piece of work's seconds by phase (clock.py), the GPU resources Snakemake's
jobs hold (resources.py), multi-node processes and launch, live status, fault injection; test and
benchmark tools (harness, stress) are marked as tools in their own docstrings.

May import: the top-level modules, artifacts/, spec/ only.
"""
