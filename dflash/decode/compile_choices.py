"""The speculative decoder's compile choices (:class:`dflash.decode.speculative.Decoder`'s
``compile_scope`` and ``compile_shapes``; the bench stage's ``bench.decode_shapes``): what one
compiled region spans, how a region's graphs follow the shapes a sweep runs, the check that
names a wrong choice, and the count of graphs compiled (what a choice cost).

Owns those tables, :func:`choice` and :func:`graph_count`. Imports torch and dflash.errors only.
"""
from __future__ import annotations

import torch

from ..errors import DFlashError

# what is one compiled region on CUDA (``compile_scope``); the step is captured whole either way
COMPILE_SCOPES = {
    "regions": "qkv, attend_cache, the heads and the drafter's context K/V compiled apart; the "
               "K/V writes, prologues and acceptance eager ATen ops captured into the graph",
    "layer": "each whole layer one region (qkv + K/V cache write + attention + MLP; one graph "
             "per model and shape), and the step's glue as regions: verify and draft "
             "prologues, acceptance, drafter context with its cache writes",
    "fused": "layer, and each layer's q/k/v and gate/up projections one GEMM each "
             "(concatenated copies of those weights: 4 GEMMs per layer instead of 7), the "
             "drafter context's k/v projections of every layer one GEMM",
    "step": "fused, and the whole step one inductor graph (every layer unrolled: fewest "
            "kernels, longest compile, one per batch size)",
}
DEFAULT_COMPILE_SCOPE = "fused"
FUSED_GEMM_SCOPES = ("fused", "step")

# how a region's graphs follow the batch size, verify width and cache length (``compile_shapes``)
COMPILE_SHAPES = {
    "static": "a graph per shape: every batch size, verify width and cache length compiles "
              "its own (round 17's decoding sweep: 274 s, mostly compiling 16 decoders)",
    "dynamic": "torch's automatic dynamic shapes: a dimension seen at a second size "
               "recompiles symbolic once, and that graph serves every later size (batch sizes "
               "and widths after the first two decoders compile nothing)",
}
DEFAULT_COMPILE_SHAPES = "static"


def choice(name: str, value: str | None, table: dict, default: str) -> str:
    """``value`` (None: ``default``) if ``table`` has it, else one error naming ``name``."""
    value = value or default
    if value not in table:
        raise DFlashError(f"decoder: {name} {value!r} (one of {', '.join(table)})")
    return value


def graph_count() -> int:
    """Graphs dynamo compiled in this process (the decoder compiles under the exclusive gate)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


__all__ = ["COMPILE_SCOPES", "DEFAULT_COMPILE_SCOPE", "FUSED_GEMM_SCOPES", "COMPILE_SHAPES",
           "DEFAULT_COMPILE_SHAPES", "choice", "graph_count"]
