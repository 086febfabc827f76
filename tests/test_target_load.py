"""transformers' load report for a layer-truncated target: the dropped layers' keys are expected
and not reported; any other unexpected, missing or mismatched weight still is."""
from __future__ import annotations

import dataclasses
import logging
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from dflash.models.target import _gguf_config, dropped_layer_keys, hf_config, load_target
from dflash.spec.load import section_spec

MICRO = section_spec("target", {"model": "llama-micro", "init": "random", "dtype": "float32",
                                "num_feature_layers": 3})


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    """llama-micro (6 layers, random weights) saved as a user checkpoint folder."""
    d = tmp_path_factory.mktemp("micro") / "ok"
    AutoModelForCausalLM.from_config(hf_config(MICRO)).save_pretrained(d)
    return d


def target_of(path):
    return dataclasses.replace(MICRO, model=str(path), init="pretrained")


class Reports(logging.Handler):
    """Collects what transformers logs (its load report is a logger warning)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def take(self) -> str:
        text, self.lines = "\n".join(self.lines), []
        return text


@pytest.fixture
def reports():  # what transformers reported since the last take()
    h = Reports()
    lg = logging.getLogger("transformers")
    lg.addHandler(h)
    yield h
    lg.removeHandler(h)


def report(h) -> str:
    return h.take()


def test_truncated_load_is_quiet(micro_dir, reports):
    report(reports)
    t = load_target(target_of(micro_dir), "cpu", num_layers=4, need_tokenizer=False)
    assert len(t.model.model.layers) == 4
    assert "LOAD REPORT" not in report(reports)
    load_target(target_of(micro_dir), "cpu", need_tokenizer=False)  # whole model: quiet too
    assert "LOAD REPORT" not in report(reports)
    assert "_keys_to_ignore_on_load_unexpected" not in LlamaForCausalLM.__dict__  # restored


def test_genuine_problems_are_still_reported(micro_dir, tmp_path, reports):
    bad = tmp_path / "bad"
    shutil.copytree(micro_dir, bad)
    sd = load_file(bad / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]                               # missing, kept layer
    sd["model.layers.2.self_attn.bogus"] = sd["model.norm.weight"].clone()    # unexpected, kept
    sd["model.layers.5.self_attn.bogus"] = sd["model.norm.weight"].clone()    # unexpected, dropped
    sd["model.extra"] = sd["model.norm.weight"].clone()                       # unexpected
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    report(reports)
    load_target(target_of(bad), "cpu", num_layers=4, need_tokenizer=False)
    text = report(reports)
    assert "LOAD REPORT" in text
    lines = [ln for ln in text.splitlines() if "|" in ln]
    assert any("model.layers.1.mlp.up_proj.weight" in ln and "MISSING" in ln for ln in lines)
    assert any("model.layers.2.self_attn.bogus" in ln and "UNEXPECTED" in ln for ln in lines)
    assert any("model.extra" in ln and "UNEXPECTED" in ln for ln in lines)
    # ... but not the layers the truncation dropped, however odd their keys
    assert not any("layers.4" in ln or "layers.5" in ln or "{4" in ln for ln in lines), text

    # a shape mismatch in a kept layer is still refused
    sd = load_file(micro_dir / "model.safetensors")
    sd["model.layers.0.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"][:, :8].contiguous()
    mism = tmp_path / "mismatch"
    shutil.copytree(micro_dir, mism)
    save_file(sd, mism / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="mismatch|size"):
        load_target(target_of(mism), "cpu", num_layers=4, need_tokenizer=False)
    assert "MISMATCH" in report(reports)


def test_dropped_layer_patterns_are_exact():
    cfg = hf_config(MICRO)  # 6 layers
    assert dropped_layer_keys(cfg, None) == [] and dropped_layer_keys(cfg, 6) == []
    (pat,) = dropped_layer_keys(cfg, 4)
    rx = re.compile(pat)
    assert rx.search("model.layers.4.mlp.up_proj.weight")
    assert rx.search("model.layers.5.input_layernorm.weight")
    for key in ("model.layers.3.mlp.up_proj.weight", "model.layers.45.mlp.x",
                "model.layers.40.mlp.x", "lm_head.weight", "model.norm.weight"):
        assert not rx.search(key), key
    # a plain string (transformers joins the patterns into one regex), matching exactly the
    # layers past the kept 4 of 6
    assert isinstance(pat, str)
    assert [i for i in range(6) if rx.search(f"model.layers.{i}.self_attn.q_proj.weight")] == [4, 5]


def test_smollm2_config_is_read_without_converting_the_weights(tmp_path, monkeypatch):
    """On a machine whose cache holds no converted SmolLM2 (`dflash validate` on a fresh box),
    the config comes from the GGUF's metadata: SmolLM2-135M's shapes, and no weights converted
    (the converted folder is not made)."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    spec = dataclasses.replace(MICRO, model="smollm2-135m-instruct", init="pretrained")
    c = hf_config(spec)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert c.tie_word_embeddings and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)    # the GGUF keeps it as a float32
    assert not list((tmp_path / "cache").glob("smollm2-*"))     # nothing converted
    # read once a process (a memory estimate asks for it twice a spec), each caller a copy
    hits = _gguf_config.cache_info().hits
    c.num_hidden_layers = 1
    assert hf_config(spec).num_hidden_layers == 30 and _gguf_config.cache_info().hits == hits + 1
