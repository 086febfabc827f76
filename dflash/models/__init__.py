"""models: the networks. The frozen target (which model, GGUF conversion, loading, features on
packed rows), the DFlash drafter (config, layers, export/import and
its content check; `dflash export-check`: export_check.py), the decoder layer the target's
compiled path and the generation engine share, and the attention masks of packed rows.

May import: the top-level modules (errors, manifest, cache, spec, settings). Nothing from data/,
train/, eval/, runtime/ or stages/.
"""
