"""train: how the drafter learns. The objective (its numbers, blocks and loss: objective.py; its
anchors and loss weights: anchors.py; the fused LM head + cross-entropy: head_loss.py), the
replica (drafter + optimizer; a row's small tensors in one copy: host_pack.py), the race-free
threaded scheduler (a target worker's own CUDA stream beside a drafter on one GPU: streams.py; a
step's figures read one step late: readout.py), row packing (and the step map), checkpoints,
the feature cache (feature_cache.py; what it stores of a row: feature_planes.py; its reused
host staging buffers: staging.py) and its budget (cache_budget.py), the worker factory,
warm-up, the FLOP/balance model, the step profile (profile.py: monitor.profile_steps,
monitor.profile_start; its summary: profile_summary.py) and the stall watchdog (stall.py:
monitor.stall_s).

May import: the top-level modules, artifacts/, spec/, models/, data/, runtime/. Nothing from eval/
or stages/.
"""
