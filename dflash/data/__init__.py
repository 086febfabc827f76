"""data: what the drafter is trained on. Training prompt files and sources, self-written prompts,
the data stage's generation worker pool (generate.py; the engines are decode/'s), the data stage's
chunks and their shards (chunks.py: plan, resume, merge), the shards by content (shards.py), the
tokenized dataset.

May import: the top-level modules, artifacts/, spec/, models/, runtime/, decode/. Nothing from
train/, eval/ or stages/.
"""
