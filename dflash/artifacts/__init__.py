"""artifacts: what the stages leave on disk and how it is trusted. Manifests, atomic writes and
content fingerprints (manifest.py), the code fingerprint of each stage (code_fingerprint.py),
upstream stages shared by content and linked into each spec (sharing.py, ``dflash link``), and
where the caches live (cache.py).

May import: the top-level modules (errors, settings) only: every room stands on it, the env
tools in a bare interpreter too (standard library at import time).
"""
