"""``monitor.tau_every_steps``: simulated τ of the drafter while it trains, on held-out prompts
(the τ-vs-training-tokens curve of the bench report). The train stage hands
:class:`TauMonitor` to :func:`dflash.train.trainer.train`.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..decode.generate import eos_ids_of
from ..errors import DFlashError
from ..models.target import layer_ids, load_target
from ..runtime.gate import get_gate
from .evalsets import heldout_prompts
from .tau import draft_every_position, greedy_continuations, summarize, target_features, walk_chain


class TauMonitor:
    """Periodic simulated τ of the drafter being trained, on held-out prompts
    (``monitor.tau_every_steps``; off by default).

    The target's part (greedy continuations and their features) is computed once, before
    training, by a full target copy that is freed afterwards; each check is then only the
    drafter's batched all-position drafts + the chain walk, run on the first replica under the
    shared side of the gate (eager SDPA: nothing is compiled or traced).
    """

    def __init__(self, spec, results_dir: Path, device: str, log=print):
        m = spec.monitor
        t0 = time.perf_counter()
        tgt = load_target(spec.target, spec.topology.targets[0], seed=spec.seed)
        prompts, note = heldout_prompts(spec, results_dir, tgt.tokenizer, m.tau_prompts)
        if not prompts:
            raise DFlashError(f"monitor.tau_every_steps: no held-out prompts ({note})")
        eos = eos_ids_of(tgt)
        t1 = time.perf_counter()

        ids = layer_ids(spec.target, tgt.config)
        conts = greedy_continuations(tgt.model, prompts, m.tau_max_new_tokens, eos)
        t2 = time.perf_counter()
        self.seqs = [list(p) + list(c) for p, c in zip(prompts, conts)]
        self.feats = [f.to(device) for f in target_features(tgt.model, self.seqs, ids)]
        self.starts = [len(p) for p in prompts]
        self.conts = conts
        del tgt
        self.seconds_setup = time.perf_counter() - t0
        # where the set-up's seconds go (it is on the train stage's path before the first step:
        # 21.5 s in round 19's candidate)
        log(f"[train] τ monitor: {len(prompts)} held-out prompts, continuations and features "
            f"ready in {self.seconds_setup:.1f}s (target and prompts {t1 - t0:.1f}s, greedy "
            f"continuations {t2 - t1:.1f}s, features {self.seconds_setup - (t2 - t0):.1f}s)")

    @torch.no_grad()
    def __call__(self, replica) -> dict:
        t = time.perf_counter()
        with get_gate().shared(), replica.autocast():
            drafts = draft_every_position(replica.model, replica.embed, replica.lm_head,
                                          self.seqs, self.feats, self.starts,
                                          query_tokens=8192 if replica.device.startswith(
                                              "cuda") else 2048)
        chains = [walk_chain(d, c) for d, c in zip(drafts, self.conts)]
        s = summarize(chains, replica.cfg.block_size)
        return {"tau": s["tau"], "seconds": round(time.perf_counter() - t, 3)}
