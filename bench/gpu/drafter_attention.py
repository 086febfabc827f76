"""The drafter's attention alone at the quality bucket's shapes, per FlexAttention tiling (#34):
is its ~32 TFLOP/s (derived in docs/benchmarks.md from round 11's profile) the kernel at this
shape, or the cost of its sparse tile lists?

One layer's q/k/v (``--heads`` 9, ``--kv-heads`` 3, ``--head-dim`` 64: SmolLM2-135M's, which the
drafter copies), bf16, over the objective's mask as the captured step builds it
(:func:`dflash.models.masks.flex_block_mask`) on a synthetic row of the bucket (8,192 tokens,
32 documents, 1,536 block slots of 16: 24,576 queries over 32,768 keys). Each variant runs
forward, then forward + backward, compiled (``torch.compile(flex_attention)``, as training):

* ``tile128``: today's (BlockMask tile 128, inductor's kernel options);
* ``tile64`` / ``tile32``: smaller tiles, with the forward kernel's blocks set to the tile
  (``BLOCK_M``/``BLOCK_N``) and the backward offered a configuration of the tile's blocks
  through inductor's choices (:func:`small_tile_choices`, reaching the backward's compile by
  :func:`install_small_tile_choices`; round 15's probe, without them, found no backward
  configuration at all, and round 17's set them for the calling thread only while autograd
  compiled the backward lazily on its own thread);
* ``dense``: no mask at all, every query against every key: the kernel's own rate at this shape
  (the most it could do per computed pair).

Per variant: ms per call (best window), TFLOP/s over the pairs the mask allows and over the
pairs its tiles compute (forward 4·pairs·heads·head_dim FLOP; forward + backward 3.5× that:
two matmuls forward, five backward), and the forward's largest difference from ``tile128``
(the tilings must agree: the same rule). The JSON is rewritten after every variant, so a call
cut short keeps what ran; a variant this torch refuses records its error (a refused backward,
``backward_error``, keeps the forward's figures: round 15's tile-64 and tile-32 backward were).

    python3 -m bench.gpu.drafter_attention --out $OUT/drafter_attention.json
    python3 -m bench.gpu.drafter_attention --device cpu --eager --no-backward --seq 512 \\
        --docs 4 --anchors 64 --variants tile128 tile64 dense --out /tmp/att.json
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch
from torch.nn.attention.flex_attention import flex_attention

from bench.entry import run, write_result
from bench.mask_tiles import add_bucket_args, allowed_pairs, bucket, computed_pairs
from dflash.models.masks import flex_block_mask
from dflash.train.flops import best_seconds_per_call

VARIANTS = ("tile128", "tile64", "tile32", "dense")


def kernel_options(tile: int) -> dict[str, int] | None:
    """The forward kernel's blocks for a mask tile: inductor's own at 128, the tile's edge below
    it (a forward block larger than the mask's tile is refused)."""
    if tile >= 128:
        return None
    return {"BLOCK_M": tile, "BLOCK_N": tile}  # the keys round 15 ran with (torch 2.11)


# the mask tile of the variant being compiled: the installed choices read it at compile time,
# on whichever thread compiles (the forward's; autograd's device thread for the backward)
_TILE = [128]


def small_tile_choices(tile: int | None = None):
    """Inductor's choices with a flex backward configuration whose blocks are the tile (``tile``,
    else the variant's at compile time); inductor's own at tile 128.

    On sm90 at head dim 64, inductor offers one backward configuration outside max-autotune,
    (64, 128, 128, 64), and drops it when its blocks do not divide the mask's tile: round 15's
    tile-64 backward had no choice at all. ``kernel_options`` do not enter that filter; the
    choices (inductor's extension point) do."""
    from torch._inductor.choices import InductorChoices  # noqa: PLC0415 - inductor internals, GPU arms only
    from torch._inductor.template_heuristics.triton import FlexBwDConfig  # noqa: PLC0415

    class SmallTileChoices(InductorChoices):
        def get_flex_attention_bwd_configs(self, head_dim, dtype, device_type="cuda"):
            t = tile or _TILE[0]
            if t >= 128:
                return super().get_flex_attention_bwd_configs(head_dim, dtype, device_type)
            # (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps)
            return [FlexBwDConfig(t, t, t, t, 3 if t >= 64 else 2, 4)]

        def uuid(self) -> str:  # the FX graph cache's key: one per tile
            return f"drafter_attention.small_tile_choices/{tile or _TILE[0]}"

    return SmallTileChoices()


def install_small_tile_choices() -> list[str]:
    """Make the small-tile choices reach the backward's compile, before anything compiles; what
    the JSON records. Autograd compiles a backward lazily, at its first call, on its device
    thread, and inductor's choices (``V.set_choices_handler``) and, in newer torch, its config
    are per thread: round 17's probe set them on the calling thread and its tile-64 backward
    still had no configuration. So the backward is compiled with the forward, on the calling
    thread (functorch's ``force_non_lazy_backward_lowering``), and the choices are also the
    factory every thread's are made from (``config.inductor_choices_class``, where it exists)."""
    from torch._functorch import config as functorch_config  # noqa: PLC0415 - compiler internals
    from torch._inductor import config  # noqa: PLC0415
    done = []
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        functorch_config.force_non_lazy_backward_lowering = True
        done.append("functorch.config.force_non_lazy_backward_lowering")
    if hasattr(config, "inductor_choices_class"):
        config.inductor_choices_class = small_tile_choices
        done.append("inductor.config.inductor_choices_class")
    return done


@contextlib.contextmanager
def choices_for(variant: str):
    """The variant's tile for the choices, and the choices this thread compiles with, while the
    variant compiles and runs."""
    from torch._inductor.virtualized import V  # noqa: PLC0415 - inductor internals
    _TILE[0] = int(variant[4:]) if variant.startswith("tile") else 128
    try:
        with V.set_choices_handler(small_tile_choices()):
            yield
    finally:
        _TILE[0] = 128


def time_variant(res: dict, fn, q, k, v, grad, device: str, iters: int, backward: bool) -> None:
    """ms per forward, then per forward + backward, into ``res`` (each the best window of
    ``iters`` calls); a backward this torch refuses keeps the forward's figure."""
    def ms(f) -> float:
        return round(best_seconds_per_call(f, device, iters, warmup=2) * 1e3, 4)

    res["forward_ms"] = ms(lambda: fn(q, k, v))
    if backward:
        def step():
            fn(q, k, v).backward(grad)
        try:
            res["forward_backward_ms"] = ms(step)
        except Exception as e:  # noqa: BLE001 - recorded beside the forward's figure
            res["backward_error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"


def rates(timing: dict, flop_per_pair: int, allowed: int, computed: int) -> dict:
    """TFLOP/s of the allowed and of the computed pairs, forward and forward + backward."""
    r = {}
    for key, mult in (("forward_ms", 1.0), ("forward_backward_ms", 3.5)):
        if key in timing:
            s = timing[key] / 1e3
            name = key[:-3]
            r[f"{name}_tflops_allowed"] = round(mult * flop_per_pair * allowed / s / 1e12, 2)
            r[f"{name}_tflops_computed"] = round(mult * flop_per_pair * computed / s / 1e12, 2)
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    add_bucket_args(p)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--eager", action="store_true", help="flex_attention uncompiled (CPU tests)")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    dev = a.device
    row, blocks = bucket(a)
    Q, KV = a.anchors * a.block, a.seq + a.anchors * a.block
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16
    q, k, v = (torch.randn(1, h, n, a.head_dim, device=dev, dtype=dt, generator=g)
               .requires_grad_(not a.no_backward)
               for h, n in ((a.heads, Q), (a.kv_heads, KV), (a.kv_heads, KV)))
    grad = torch.randn(1, a.heads, Q, a.head_dim, device=dev, dtype=dt, generator=g)
    flex = flex_attention if a.eager else torch.compile(flex_attention, dynamic=False)
    small = [v for v in a.variants if v.startswith("tile") and int(v[4:]) < 128]
    bwd_choices = (install_small_tile_choices() if small and not a.eager and not a.no_backward
                   else None)
    allowed = allowed_pairs(row.doc_ids, blocks)
    flop_per_pair = 4 * a.heads * a.head_dim
    doc = {"command": "python3 -m bench.gpu.drafter_attention "
                      + " ".join(sys.argv[1:] if argv is None else argv),
           "torch": torch.__version__, "device_name": (torch.cuda.get_device_name(dev)
                                                       if dev.startswith("cuda") else "cpu"),
           "queries": Q, "keys": KV, "heads": a.heads, "kv_heads": a.kv_heads,
           "head_dim": a.head_dim, "allowed_pairs": allowed, "compiled": not a.eager,
           "small_tile_backward_choices": bwd_choices,
           "variants": {}}
    reference = None
    for name in a.variants:
        res: dict = {}
        try:
            if name == "dense":
                mask, computed = None, Q * KV
            else:
                tile = int(name[4:])
                mask = flex_block_mask(row.doc_ids, blocks, device=dev, tile=tile)
                computed = computed_pairs(mask)
                res["kernel_options"] = kernel_options(tile)

            def fn(q, k, v, mask=mask, opts=res.get("kernel_options")):
                return flex(q, k, v, block_mask=mask, scale=a.head_dim ** -0.5, enable_gqa=True,
                            kernel_options=opts)
            useful = allowed if mask is not None else Q * KV  # dense: every pair counts
            res["computed_pairs"] = computed
            res["allowed_over_computed"] = round(useful / computed, 4)
            with choices_for(name):
                time_variant(res, fn, q, k, v, grad, dev, a.iters, not a.no_backward)
            res.update(rates(res, flop_per_pair, useful, computed))
            if mask is not None:
                with torch.no_grad():
                    o = fn(q, k, v).float()
                if reference is None:
                    reference = o
                res["max_abs_diff_vs_first"] = float((o - reference).abs().max())
        except Exception as e:  # noqa: BLE001 - a tiling this torch/GPU refuses: recorded
            res["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        doc["variants"][name] = res
        print(name, res, flush=True)
        write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    run(main)
