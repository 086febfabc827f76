"""train: how the drafter learns. The objective's numbers, the replica (drafter + optimizer), the
race-free threaded scheduler, row packing, checkpoints, the worker factory, warm-up, the
FLOP/balance model.

May import: the top-level modules, models/, data/, runtime/. Nothing from eval/ or stages/.
"""
