"""DFlash drafter training pipeline: spec -> pinned env -> warmup -> data -> train -> bench."""

__version__ = "0.1.0"
