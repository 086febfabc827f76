"""decode: producing tokens fast. The static KV caches, compile and CUDA-graph capture/replay, the
prefill, the one-token and speculative steps, acceptance, and both front doors: batch
generation for the data stage (generate.py: the engine choice, the hf loop and the fast
:class:`~dflash.decode.engine.Engine` with its prefill.py and sampling.py) and speculative
decoding for the bench stage and users (speculative.py: the :class:`Decoder`; its own step
pieces: speculative_step.py; its compile scopes and shapes: compile_choices.py; what it returns
and the lossless evidence: decoded.py; one prompt at a time and the eager references: eager.py;
whether to speculate at a batch size, from measured step costs: adaptive.py). What both front
doors share is static.py: the target's static KV cache (``TargetCache``) and the one compile /
capture / replay cycle (``CapturedStep``); the drafter's side of the speculative pair
(``DraftPair``) is speculative_step.py's, so that the data stage's engine imports nothing of
the drafter.

May import: the top-level modules, artifacts/, spec/, models/, runtime/. Nothing from data/,
train/, eval/ or stages/.
"""
