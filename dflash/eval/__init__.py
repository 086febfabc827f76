"""eval: how good the drafter is. Eval sets, simulated and real τ, speculative decoding.

May import: the top-level modules, models/, data/, train/, runtime/. Nothing from stages/.
"""
