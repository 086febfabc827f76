"""The serving-grade decoder: greedy speculative decoding with a DFlash drafter, and the
target-only baseline, through ONE engine (static KV caches, captured steps, batch > 1).

    dec = Decoder(target_model, drafter, batch=4, max_len=1024, max_new_tokens=256, eos_ids=[2])
    results = dec.decode(prompt_token_lists)          # list[Decoded], prompt order
    base = Decoder(target_model, None, ...)           # target-only: one token per step

One step for every sequence of the batch at once, device tensors only:

1. **draft** (drafter given): the block ``[anchor, mask × (K-1)]`` at positions
   ``pos .. pos+K-1`` runs through the drafter's layers; each layer writes the block's K/V into
   the drafter's static cache at those positions and attends over the cache up to ``pos+K-1``
   (every verified position's context K/V, then the block: no mask inside the block);
   ``lm_head`` + argmax give K-1 drafts.
2. **verify**: ``[anchor, drafts]`` through the target's layers in one forward, K/V written
   into the target's static cache at ``pos .. pos+K-1``, causal over the cache; the target's
   greedy token at every position and, from the feature layers, the drafter's next context.
3. **accept, on the device**: the longest prefix of drafts equal to the target's greedy tokens
   (``n``) plus the bonus token; truncated at eos / ``max_new_tokens`` per sequence; each
   sequence advances by its own ``n + 1`` and finishes on its own. Every emitted token is
   checked against the argmax of the verify logits that produced it (counted in
   ``checked`` / ``mismatches``), and the top-2 logit margin of each emitted token is kept.
4. **drafter context**: the context K/V of all K verified positions are written at
   ``pos .. pos+K-1`` (overwriting the block's K/V); those past the accepted prefix lie beyond
   the next step's ``pos`` and are overwritten before anything reads them (the target's rejected
   K/V likewise), so nothing is ever cropped.

The target-only baseline is the same step with K = 1 and no drafter. The prefill is the same
target forward at position 0, right-padded (on CUDA to a multiple of 32, captured per length).

On CUDA the step's pieces are compiled regions (``compile_scope``,
:data:`~dflash.decode.compile_choices.COMPILE_SCOPES`: the
data engine's per-layer pieces apart, each whole layer with its cache write, the same with
concatenated GEMMs, or the whole step; a per-layer graph per shape serves every layer of a
model) and the whole step is captured once as a CUDA graph, compile and capture under the
compile gate's exclusive side, replays under its shared side, as in
:class:`dflash.decode.engine.Engine`. Inside one graph every kernel still costs a few µs on the
H200, so the scopes differ by how many kernels the step launches. The host syncs once every
``sync_every`` steps. On CPU the same code runs eagerly.

Lossless: every emitted token is the target's greedy token in the verify forward that produced
it. That equals plain one-token greedy decoding up to floating-point summation order (a verify
of K tokens rounds differently from K one-token forwards), which can only flip a near-tie; the
margins say how near (:func:`dflash.decode.decoded.divergence`). In float32 the outputs are identical
(tests/test_decoder.py).

Owns: :class:`Decoder` (its step, compile scopes, prefill math and harvest). Its own step pieces
(greedy head, drafter RoPE, drafter context K/V, the glue between the layers:
:class:`~dflash.decode.speculative_step.StepGlue`) are :mod:`dflash.decode.speculative_step`;
the prefill's padded lengths and graphs :mod:`dflash.decode.wave_prefill`; the static caches
and the compile / capture / replay cycle shared with the data engine :mod:`dflash.decode.static`.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Sequence

import torch

from ..errors import DFlashError
from ..models.layers import (attend_cache, cached_layer, compile_region, fused_weights, qkv,
                              rope_of, write_kv)
from ..models.layers import unsupported_reason as _layers_unsupported
from .compile_choices import (COMPILE_SCOPES, COMPILE_SHAPES, DEFAULT_COMPILE_SCOPE,
                              DEFAULT_COMPILE_SHAPES, FUSED_GEMM_SCOPES, choice, graph_count)
from .decoded import Decoded, decoded_of
from .speculative_step import (DraftPair, StepGlue, argmax_head, context_kv, drafter_rope,
                               greedy_head)
from .static import CapturedStep, TargetCache, round_up
from .wave_prefill import WavePrefill
from ..runtime.busy import DeviceBusy
from ..runtime.gate import get_gate
from ..runtime.tracing import worker_thread_setup


DraftHook = Callable[[int, int, int], Sequence[int]]  # (prompt index, anchor, anchor_pos)


class Decoder(StepGlue):
    """Greedy decoding of ``batch`` sequences at once; speculative with ``drafter``, target-only
    without. ``max_len``: longest prompt + ``max_new_tokens`` (the caches add one block).
    ``embed`` / ``lm_head``: the weights the drafter shares with the target (default: the
    target's own), cast to the drafter's dtype. ``compile`` / ``cuda_graph``: default on for
    CUDA, off for CPU. ``draft_hook(prompt_index, anchor, anchor_pos) -> K-1 tokens`` replaces the drafter
    (eager only: tests inject perfect or corrupted drafts through it); ``block_size`` is then
    required. ``verify_tokens``: tokens per verify (anchor + drafts; default the whole block).
    ``compile_scope``: what one compiled region spans (:data:`COMPILE_SCOPES`; default
    :data:`DEFAULT_COMPILE_SCOPE`, "fused": by count a quarter fewer kernels per step than
    "regions" for a compile of the same size; "step" has a few fewer still but compiles the
    unrolled step once per batch size; "fused" and "step" hold a copy of the q/k/v and gate/up
    weights, concatenated). ``compile_mode``: torch.compile's mode for every region (None:
    the default; "max-autotune-no-cudagraphs" autotunes the GEMMs: small-M Triton templates
    with fused epilogues vs cuBLAS). ``compile_shapes``: :data:`COMPILE_SHAPES` (default
    :data:`DEFAULT_COMPILE_SHAPES`); the captured graph is per decoder either way.
    ``padded_prefill``: :mod:`dflash.decode.wave_prefill` (default: with CUDA graphs; True on
    CPU: eager). ``gate``: the default is the process's."""

    def __init__(self, target, drafter=None, *, batch: int, max_len: int, max_new_tokens: int,
                 eos_ids: Sequence[int], embed: torch.Tensor | None = None,
                 lm_head: torch.Tensor | None = None, compile: bool | str | None = None,
                 cuda_graph: bool | None = None, sync_every: int | None = None,
                 draft_hook: DraftHook | None = None, block_size: int | None = None,
                 verify_tokens: int | None = None, compile_scope: str | None = None,
                 compile_mode: str | None = None, compile_shapes: str | None = None,
                 padded_prefill: bool | None = None, gate=None):
        why = _layers_unsupported(target) or (None if hasattr(target, "lm_head") else "no lm_head")
        if why:
            raise DFlashError(f"decoder: unsupported target: {why}")
        if batch < 1 or max_new_tokens < 1:
            raise DFlashError("decoder: batch and max_new_tokens must be >= 1")
        self.compile_mode = compile_mode
        self.scope = choice("compile_scope", compile_scope, COMPILE_SCOPES, DEFAULT_COMPILE_SCOPE)
        self.shapes = choice("compile_shapes", compile_shapes, COMPILE_SHAPES,
                             DEFAULT_COMPILE_SHAPES)

        self.target, self.drafter, self.hook = target, drafter, draft_hook
        self.layers = list(target.model.layers)
        p = next(target.parameters())
        self.device, self.dtype = p.device, p.dtype
        cuda = self.device.type == "cuda"
        if draft_hook is not None:
            self.K = int(block_size or 0)
            if self.K < 2:
                raise DFlashError("decoder: a draft_hook needs block_size >= 2")
            cuda_graph, compile = False, False
        else:
            self.K = drafter.cfg.block_size if drafter is not None else 1
        # the drafter drafts its whole trained block; the target verifies the first K of it
        # (anchor + K-1 drafts): with τ ≈ 2 drafts past the 8th are rarely accepted, and a
        # narrower verify costs less (vLLM's num_speculative_tokens); still lossless
        self.Kd = self.K
        if self.K > 1:
            self.K = verify_width(self.Kd, verify_tokens)
        self.N, self.max_new = int(batch), int(max_new_tokens)
        self.S = round_up(max(int(max_len), self.max_new + 1) + self.Kd, 16)
        self.eos = torch.tensor(sorted({int(e) for e in eos_ids}), device=self.device)
        self.compile = cuda if compile is None else compile
        self.cuda_graph = bool(cuda if cuda_graph is None else cuda_graph) and cuda
        self.sync_every = int(sync_every or (4 if self.cuda_graph else 1))
        self.gate = gate or get_gate()
        self.rope = rope_of(self.layers[0])
        self._eager_pieces()
        self._wave = 0
        self._busy = {k: DeviceBusy(str(self.device)) for k in ("prefill", "steps")}
        self.stats: dict[str, Any] = {"compile_seconds": 0.0, "capture_seconds": 0.0,
                                      "steps": 0, "syncs": 0, "graph": False,
                                      "compile_scope": self.scope,
                                      "compile_mode": compile_mode,
                                      "compile_shapes": self.shapes}
        self._captured = CapturedStep(self._step, device=self.device,
                                      enabled=bool(self.compile or self.cuda_graph),
                                      cuda_graph=self.cuda_graph, stats=self.stats,
                                      tag="decoder", gate=self.gate)
        self._prefill = WavePrefill(  # padded + captured by default with CUDA graphs
            self._prefill_body, rows=self.N, cache_len=self.S, longest=self.S - self.max_new -
            self.Kd, padded=bool(self.cuda_graph if padded_prefill is None else padded_prefill),
            cuda_graph=self.cuda_graph, device=self.device, gate=self.gate, stats=self.stats)
        with torch.inference_mode():
            self._alloc_target()
            if drafter is not None:
                self._alloc_drafter(embed, lm_head)
            self._alloc_state()
        # the concatenated GEMM weights' copy ("fused", "step"): memory the scope costs
        self.stats["fused_weight_bytes"] = sum(
            t.numel() * t.element_size() for fw in self.t_fused + getattr(self, "d_fused", [])
            if fw is not None for t in fw if t is not None) + (
            0 if getattr(self, "d_ctx_w", None) is None else
            self.d_ctx_w.numel() * self.d_ctx_w.element_size())

    # -------------------------------------------------------------------------------------
    # static buffers (the captured step reads and writes these addresses)
    # -------------------------------------------------------------------------------------
    def _alloc_target(self) -> None:
        cache = TargetCache(self.target, rows=self.N, S=self.S)
        self.k_cache, self.v_cache = cache.k, cache.v
        self.cos, self.sin, self.pos_ar = cache.cos, cache.sin, cache.pos_ar
        self.lm_w = self.target.lm_head.weight
        self.feature_ids = set()
        self.t_fused = self._fused_of(self.layers)

    def _fused_of(self, layers) -> list:
        """Per layer its concatenated GEMM weights (:func:`fused_weights`) in the scopes that
        use them, else None."""
        return [fused_weights(lay) if self.scope in FUSED_GEMM_SCOPES else None for lay in layers]

    def _alloc_drafter(self, embed, lm_head) -> None:
        d = DraftPair(self.drafter, self.target, rows=self.N, S=self.S, pos_ar=self.pos_ar,
                      fused=self.scope in FUSED_GEMM_SCOPES, embed=embed, lm_head=lm_head)
        self.d_dtype, self.feature_ids, self.d_layers = d.dtype, d.feature_ids, d.layers
        self.d_fused, self.d_ctx_w, self.dk_cache, self.dv_cache = d.fused, d.ctx_w, d.k, d.v
        self.d_cos, self.d_sin, self.d_embed, self.d_lm_w = d.cos, d.sin, d.embed, d.lm_w
        self.mask_id = d.mask_id

    def _alloc_state(self) -> None:
        dev, N, K = self.device, self.N, self.K
        long = dict(device=dev, dtype=torch.long)
        self.slot_ar = torch.arange(N, device=dev)
        self.k_ar = torch.arange(K, device=dev)
        self.d_ar = torch.arange(self.Kd, device=dev)
        self.tok = torch.zeros(N, **long)       # anchor: last emitted, not yet through the target
        self.pos = torch.zeros(N, **long)       # verified positions (the caches' valid length)
        self.gen = torch.zeros(N, **long)       # tokens emitted
        self.steps = torch.zeros(N, **long)     # verify steps run while active
        self.active = torch.zeros(N, dtype=torch.bool, device=dev)
        W = self.max_new + K                     # room for a whole block past max_new
        self.out = torch.zeros(N, W, **long)
        self.margin = torch.zeros(N, W, dtype=torch.float32, device=dev)
        self.acc_log = torch.zeros(N, self.max_new + 1, **long)
        self.len_log = torch.zeros(N, self.max_new + 1, **long)
        self.checked = torch.zeros((), **long)  # emitted tokens checked against the argmax
        self.mismatches = torch.zeros((), **long)
        self._buffers = [self.tok, self.pos, self.gen, self.steps, self.active, self.out,
                         self.margin, self.acc_log, self.len_log, self.checked, self.mismatches]

    # -------------------------------------------------------------------------------------
    # the math: the step is glue + layers; which pieces are compiled regions is the scope's
    # -------------------------------------------------------------------------------------
    def _eager_pieces(self) -> None:
        """Every piece uncompiled (CPU, the prefill, the "step" scope's inside)."""
        self._pre, self._attn, self._head, self._ctx = qkv, attend_cache, greedy_head, context_kv
        self._layer, self._dhead = cached_layer, argmax_head
        self._verify_in_fn, self._draft_in_fn = self._verify_in, self._draft_in
        self._accept_fn, self._context_fn = self._accept_all, self._context
        self._step_fn = self._step_body

    def _split_layer(self, layer, x, cos, sin, rope, kc, vc, rows, qpos, mask, fused=None):
        """The "regions" layer: compiled qkv, eager K/V writes, compiled attention + MLP."""
        q, k, v = self._pre(layer, x, cos, sin, rope, fused)
        write_kv(kc, vc, rows, qpos, k, v)
        return self._attn(layer, x, q, kc, vc, mask, fused)

    def _layers_over(self, layers, kcs, vcs, rope, x, cos, sin, qpos, mask, layer, feature_ids):
        """``layers`` over their caches; -> last hidden states, the feature layers' states."""
        rows = self.slot_ar[:, None]
        fused = self.t_fused if layers is self.layers else self.d_fused
        feats = []
        for i, (lay, kc, vc, fw) in enumerate(zip(layers, kcs, vcs, fused)):
            x = layer(lay, x, cos, sin, rope, kc, vc, rows, qpos, mask, fw)
            if i in feature_ids:
                feats.append(x)
        return x, feats

    def _target_forward(self, ids, qpos, layer):
        """The target over ``ids`` [N, L] at positions ``qpos`` [N, L]: K/V written into the
        cache, causal over it. -> final hidden states [N, L, H], feature-layer states."""
        x, cos, sin, mask = self._target_in(ids, qpos)
        return self._layers_over(self.layers, self.k_cache, self.v_cache, self.rope, x, cos,
                                 sin, qpos, mask, layer, self.feature_ids)

    def _draft(self):
        """The drafter's greedy drafts after each anchor [N, K-1]."""
        qpos, x, cos, sin, mask = self._draft_in_fn()
        x, _ = self._layers_over(self.d_layers, self.dk_cache, self.dv_cache, drafter_rope, x,
                                 cos, sin, qpos, mask, self._layer, ())
        return self._dhead(self.drafter.norm, self.d_lm_w, x[:, 1:self.K])

    def _step(self) -> None:
        """One verify step for every sequence; finished ones compute but change nothing."""
        self._step_fn()

    def _step_body(self) -> None:
        drafts = None
        if self.K > 1:
            drafts = self._hook_drafts() if self.hook else self._draft()
        qpos, x, cos, sin, mask = self._verify_in_fn(drafts)
        x, feats = self._layers_over(self.layers, self.k_cache, self.v_cache, self.rope, x, cos,
                                     sin, qpos, mask, self._layer, self.feature_ids)
        greedy, margin = self._head(self.target.model.norm, self.lm_w, x)     # [N, K]
        self._accept_fn(drafts, greedy, margin)
        if self.drafter is not None and self.hook is None:
            self._context_fn(feats, qpos)

    def _prefill_body(self, ids, lens) -> None:
        """The wave's right-padded prompts ``ids`` [N, P] (``lens`` [N]; 0: a row past the wave,
        left inactive) into the caches at positions 0..P-1, first tokens from each row's last
        prompt position. Device tensors only (captured per padded length: no host read); why
        padded positions change nothing: :mod:`dflash.decode.wave_prefill`."""
        qpos = self.pos_ar[:ids.shape[1]][None].expand(self.N, -1)
        x, feats = self._target_forward(ids, qpos, cached_layer)
        last = x[self.slot_ar, (lens - 1).clamp(min=0)]
        tok, margin = greedy_head(self.target.model.norm, self.lm_w, last)
        if self.drafter is not None and self.hook is None:
            self._context(feats, qpos, context_kv)
        for t in self._buffers:
            t.zero_()
        live = lens > 0
        self.tok.copy_(tok)
        self.pos.copy_(lens)
        self.gen.copy_(live.long())
        self.out[:, 0] = tok
        self.margin[:, 0] = margin
        self.active.copy_(live & ~(tok[:, None] == self.eos).any(-1) & (self.max_new > 1))

    # -------------------------------------------------------------------------------------
    # compile + capture once, replay
    # -------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Compile the per-layer pieces and capture the step (once, exclusive gate). The warm-up
        and capture steps run on inactive sequences: they write only cache positions that the
        next prefill overwrites or masks, and the prefill resets every state buffer."""
        self._captured.prepare(self._compile_and_warm_up,
                               "decoder: compile + capture the verify / draft step")
        self.stats["graph"] = self._captured.graph is not None

    @property
    def _graph(self):  # the captured step's graph (None: eager), for bench/gpu/step_profile.py
        return self._captured.graph

    def _compile_and_warm_up(self) -> None:
        """Compile the scope's pieces and run the warm-up steps. A scope other than "regions"
        whose compile fails falls back to "regions" (the pieces first run compiled on the
        H200), loudly and recorded (``scope_compile_error``): slower, never wrong."""
        worker_thread_setup()  # recompile limit: one graph per (model, batch, block) shape
        graphs0 = graph_count()
        try:
            self._compile_scope_and_warm_up()
        finally:
            self.stats["graphs_compiled"] = graph_count() - graphs0

    def _compile_scope_and_warm_up(self) -> None:
        backend = self.compile if not isinstance(self.compile, bool) else "inductor"
        try:
            if self.compile:
                self._compile_pieces(backend)
            for t in self._buffers:
                t.zero_()
            self._warm_up()
        except Exception as e:  # noqa: BLE001 - loud, recorded; "regions" is the fallback
            if self.scope == "regions" or not self.compile:
                raise
            self.stats["scope_compile_error"] = f"{self.scope}: {type(e).__name__}: {e}"[:500]
            print(f"[decoder] WARNING: compile scope {self.scope!r} failed, falling back to "
                  f"'regions': {self.stats['scope_compile_error']}", file=sys.stderr, flush=True)
            self.scope = self.stats["compile_scope"] = "regions"
            self.t_fused, self.stats["fused_weight_bytes"] = [None] * len(self.layers), 0
            if self.drafter is not None and self.hook is None:
                self.d_fused, self.d_ctx_w = [None] * len(self.d_layers), None
            self._eager_pieces()
            self._compile_pieces(backend)
            for t in self._buffers:
                t.zero_()
            self._warm_up()

    def _compile_pieces(self, backend) -> None:
        """Each piece of the scope one compiled region (``compile_shapes``: a graph per shape,
        or symbolic once a second size is seen; the per-layer ones shared by every layer of a
        model, the weights and caches inputs)."""
        def c(fn, **kw):
            return compile_region(fn, backend, mode=self.compile_mode,
                                  static=self.shapes == "static", **kw)

        if self.scope == "step":  # one graph or an error, never silently split
            self._step_fn = c(self._step_body, fullgraph=True)
            return
        self._head = c(greedy_head)
        if self.scope == "regions":
            self._pre, self._attn, self._layer = c(qkv), c(attend_cache), self._split_layer
            self._dhead = lambda norm, w, x: self._head(norm, w, x)[0]
            if self.drafter is not None:
                self._ctx = c(context_kv)
            return
        self._layer, self._dhead = c(cached_layer), c(argmax_head)  # "layer", "fused"
        self._verify_in_fn, self._draft_in_fn = c(self._verify_in), c(self._draft_in)
        self._accept_fn = c(self._accept_all)
        if self.drafter is not None:
            self._context_fn = c(self._context)

    def _warm_up(self) -> None:
        """Two steps: compile, then one warm run (autotune, lazy inits). If a drafter-context
        region fails to compile (torch 2.11's inductor failed on a sibling head once: decode
        step probe), the context runs eagerly inside the captured step, loudly and recorded."""
        try:
            self._step()
        except Exception as e:  # noqa: BLE001 - only the context region may fall back
            if self.scope == "step" or (self._ctx is context_kv and
                                        self._context_fn == self._context):
                raise
            self.stats["context_compile_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"[decoder] WARNING: the drafter-context region failed to compile, running it "
                  f"eagerly in the step: {self.stats['context_compile_error']}",
                  file=sys.stderr, flush=True)
            self._ctx, self._context_fn = context_kv, self._context
            self._step()
        self._step()

    def _run_steps(self, n: int) -> None:
        self._captured.replay(n)
        self.stats["steps"] += n

    # -------------------------------------------------------------------------------------
    def decode(self, prompts: Sequence[Sequence[int]]) -> list[Decoded]:
        """Greedy answers for ``prompts`` (token id lists), in order, ``batch`` at a time; an
        answer ends at its first eos (included) or after ``max_new_tokens``."""
        limit = self.S - self.max_new - self.Kd
        for i, p in enumerate(prompts):
            if not 0 < len(p) <= limit:
                raise DFlashError(f"decoder: prompt {i} has {len(p)} tokens; 1..{limit} fit "
                                  f"(max_len {self.S} - max_new_tokens - block)")
        self.prepare()
        out: list[Decoded] = []
        with torch.inference_mode():
            for s in range(0, len(prompts), self.N):
                wave, self._wave = prompts[s:s + self.N], s
                self._prefill.prepare(wave)  # a new padded length: its graph (exclusive)
                t = self._busy["prefill"].start()
                self._prefill.run(wave)  # under the gate's shared side
                self._busy["prefill"].stop(t)
                t = self._busy["steps"].start()
                # every active sequence emits >= 1 token per step: at most max_new steps
                for _ in range(0, self.max_new, self.sync_every):
                    self._run_steps(self.sync_every)
                    self.stats["syncs"] += 1
                    if not bool(self.active.any()):  # the one host sync per sync_every steps
                        break
                self._busy["steps"].stop(t)
                t = time.perf_counter()
                out += self._harvest(len(wave))
                self._time_wave(time.perf_counter() - t)
        return out

    def _time_wave(self, harvest_s: float) -> None:
        """Where the waves' time goes (the H200's wall-vs-replay gap is per wave): ``prefill_ms``
        and ``steps_ms`` on the device (CUDA timing events, complete once the harvest has
        synced: no sync of their own), ``harvest_ms`` on the host, summed over ``waves``."""
        for k in ("prefill", "steps"):
            self.stats[f"{k}_ms"] = round(1e3 * self._busy[k].collect(block=True), 3)
        self.stats["harvest_ms"] = round(self.stats.get("harvest_ms", 0.0) + 1e3 * harvest_s, 3)
        self.stats["waves"] = self.stats.get("waves", 0) + 1

    def _harvest(self, n: int) -> list[Decoded]:
        self.stats["checked"] = self.stats.get("checked", 0) + int(self.checked)
        self.stats["mismatches"] = self.stats.get("mismatches", 0) + int(self.mismatches)
        return decoded_of(self.K, *(t[:n].tolist() for t in (
            self.gen, self.steps, self.out, self.margin, self.acc_log, self.len_log)))


def verify_width(block: int, verify_tokens: int | None = None) -> int:
    """Tokens one verify checks (anchor + drafts): ``verify_tokens`` clipped to [2, block], or
    the drafter's whole block."""
    return block if verify_tokens is None else max(2, min(int(verify_tokens), block))


__all__ = ["Decoder", "verify_width"]
