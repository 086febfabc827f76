"""eval: how good the drafter is. Eval sets, simulated and real τ and its spread over prompts
(spread.py), speculative decoding (the decoder; its own step pieces: decoder_step.py; what it
returns and the lossless evidence: decoded.py), the bench report.

May import: the top-level modules, models/, data/, train/, runtime/. Nothing from stages/.
"""
