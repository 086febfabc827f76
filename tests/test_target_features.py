"""The target side of a packed row: the document mask and the features it produces.

Packing is only correct if every document's features equal those of the document run alone;
both attention paths (SDPA + dense mask on CPU, FlexAttention + BlockMask on CUDA) must give
them, so the flex path is checked here on CPU against the same reference.
"""
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, GPT2Config

import dflash.runtime.gate as gate_mod
from dflash.errors import SpecError
from dflash.models.drafter import extract_features
from dflash.models.masks import document_block_mask, document_dense_mask
from dflash.models.features import FeatureExtractor, compile_backend
from dflash.models.target import hf_config, layer_ids, load_target
from dflash.spec.load import load_spec, section_spec
from dflash.train.warm import synthetic_row, warm_target_features, warm_targets
from dflash.train.workers import buckets

TARGET = section_spec("target", {"model": "llama-micro", "init": "random", "dtype": "float32",
                                 "num_feature_layers": 3})
DOC_LENGTHS = [7, 140, 5, 129]  # spans several 128-blocks, a document straddling block edges
PAD = 31


def packed(doc_lengths=DOC_LENGTHS, pad=PAD, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, doc, pos = [], [], []
    for d, n in enumerate(doc_lengths):
        ids.append(torch.randint(5, 49152, (n,), generator=g))
        doc.append(torch.full((n,), d))
        pos.append(torch.arange(n))
    ids.append(torch.full((pad,), 2))
    doc.append(torch.full((pad,), -1))
    pos.append(torch.zeros(pad, dtype=torch.long))
    return torch.cat(ids), torch.cat(doc), torch.cat(pos)


def reference_mask(doc):
    L = doc.numel()
    m = torch.zeros(L, L, dtype=torch.bool)
    for q in range(L):
        for k in range(L):
            m[q, k] = (q == k) or (doc[q] >= 0 and doc[q] == doc[k] and k <= q)
    return m


def test_document_dense_mask_matches_loop_reference():
    _, doc, _ = packed([3, 4, 2], pad=3)
    m = document_dense_mask(doc)
    assert m.shape == (1, 1, 12, 12)
    assert torch.equal(m[0, 0], reference_mask(doc))
    assert m[0, 0].any(dim=-1).all()  # no fully masked row (SDPA would give NaN)


def test_document_block_mask_skips_other_documents():
    # two 256-token documents: the block mask keeps only the 2 diagonal 2×2 block triangles
    doc = torch.cat([torch.zeros(256, dtype=torch.long), torch.ones(256, dtype=torch.long)])
    bm = document_block_mask(doc)
    kept = int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum())
    assert kept == 6  # of 16 blocks (a full causal mask would keep 10)
    dense = bm.to_dense()[0, 0].bool()
    assert not dense[2:, :2].any() and not dense[:2, 2:].any()


@pytest.fixture(scope="module")
def target():
    return load_target(TARGET, "cpu", need_tokenizer=False)


def _alone(fx, ids, doc, pos):
    """Features of each document run on its own (no packing, no mask but causal)."""
    outs = []
    for d in range(int(doc.max()) + 1):
        sel = doc == d
        outs.append(fx(ids[sel], torch.zeros(int(sel.sum()), dtype=torch.long), pos[sel]))
    return torch.cat(outs, dim=1)


def test_packed_features_equal_documents_alone(target):
    fx = FeatureExtractor(target)
    ids, doc, pos = packed()
    feats = fx(ids, doc, pos)
    n_feat = len(target.layer_ids) * target.config.hidden_size
    assert feats.shape == (1, ids.numel(), n_feat)
    real = doc >= 0
    torch.testing.assert_close(feats[:, real], _alone(fx, ids, doc, pos), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(feats).all()  # padding rows too


def test_flex_target_equals_sdpa_target():
    """The CUDA path (compiled FlexAttention + BlockMask) computes the same features."""
    ids, doc, pos = packed()
    sdpa = FeatureExtractor(load_target(TARGET, "cpu", need_tokenizer=False))
    flex = FeatureExtractor(load_target(TARGET, "cpu", need_tokenizer=False, attention="flex"))
    assert flex.target.model.config._attn_implementation == "packed_doc_flex"
    ref = sdpa(ids, doc, pos)
    got = flex(ids, doc, pos)
    real = doc >= 0
    torch.testing.assert_close(got[:, real], ref[:, real], atol=1e-4, rtol=1e-4)
    # a different document layout of the same length reuses the compiled graph (no recompile:
    # training refuses recompiles after its warm start)
    ids2, doc2, pos2 = packed([64, 64, 64, 64, 25], pad=PAD, seed=1)
    assert ids2.numel() == ids.numel()
    torch.compiler.set_stance("fail_on_recompile")
    try:
        got2 = flex(ids2, doc2, pos2)
    finally:
        torch.compiler.set_stance("default")
    torch.testing.assert_close(got2, sdpa(ids2, doc2, pos2), atol=1e-4, rtol=1e-4)


def test_training_features_equal_inference_features_and_last_layer_is_refused():
    """Training reads hooked layer outputs; inference (ours and the reference's) reads HF
    hidden_states[i+1]. They agree for every layer but the last (after the final norm there),
    which target.layer_ids refuses with one message naming the field."""
    n = hf_config(TARGET).num_hidden_layers
    allowed = list(range(n - 1))
    tgt = load_target(dataclasses.replace(TARGET, layer_ids=tuple(allowed)), "cpu",
                      need_tokenizer=False)
    ids = torch.randint(5, 49152, (23,), generator=torch.Generator().manual_seed(0))
    train_side = FeatureExtractor(tgt)(ids, torch.zeros(23, dtype=torch.long), torch.arange(23))
    with torch.no_grad():
        hs = tgt.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(train_side, extract_features(hs, allowed), atol=1e-5, rtol=1e-5)
    # the last layer's hidden state is post-norm: it differs from the raw layer output
    last = load_target(dataclasses.replace(TARGET, layer_ids=(0,)), "cpu", need_tokenizer=False)
    raw = {}
    last.model.model.layers[n - 1].register_forward_hook(
        lambda m, i, o: raw.setdefault("x", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        post = last.model(input_ids=ids[None], output_hidden_states=True).hidden_states[n]
    assert not torch.allclose(raw["x"], post, atol=1e-3)
    with pytest.raises(SpecError, match=r"target.layer_ids: 5 is the target's last layer"):
        layer_ids(dataclasses.replace(TARGET, layer_ids=(1, n - 1)), hf_config(TARGET))


# ---------------------------------------------------------------------------------------------
# target.compile: the decoder layers compiled (regional), on the real SmolLM2 target
# ---------------------------------------------------------------------------------------------
SMOL = section_spec("target", {"model": "smollm2-135m-instruct", "dtype": "float32",
                               "layer_ids": [1, 4], "compile": "on"})


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_compiled_target_features_equal_eager_and_never_recompile(attention, monkeypatch):
    """The compiled layers (inductor; flex = the CUDA path's BlockMask inside the layer graph)
    give HF's eager features; one graph serves every layer; after a warm start through the
    gate, another document layout of the same length is no recompile."""
    gate = gate_mod.Gate()
    monkeypatch.setattr(gate_mod, "_GATE", gate)
    # the reference: HF's eager forward, SDPA with the dense document mask
    eager = FeatureExtractor(load_target(SMOL, "cpu", need_tokenizer=False, num_layers=5))
    tgt = load_target(SMOL, "cpu", need_tokenizer=False, num_layers=5, attention=attention)
    backend = compile_backend(SMOL, "cpu", "inductor", tgt.model)
    assert backend == "inductor"
    fx = FeatureExtractor(tgt, compile=backend)
    vocab = tgt.model.config.vocab_size

    def run(row):
        return fx(row.input_ids, row.doc_ids, row.position_ids)

    graphs = counters["stats"]["unique_graphs"]
    warm_targets([("cpu", run)], [64], vocab)
    # one layer graph for all 5 layers, not one per layer; flex too: its BlockMask is built from
    # the documents' boundaries, no mask graph (torch's compiled create_block_mask was 236 s of
    # the 8B target's 240 s cold start)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    gate.mark_warm()
    try:
        for seed, docs in ((5, 2), (6, 4)):
            row = synthetic_row(64, vocab, seed=seed, docs=docs)
            got = gate.run(("target_forward", "cpu", 64), lambda: run(row))
            ref = eager(row.input_ids, row.doc_ids, row.position_ids)
            assert got.shape == ref.shape == (1, 64, 2 * tgt.config.hidden_size)
            # SmolLM2's hidden states reach ~3e4 in a few channels: relative tolerance
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
        st = gate.stats()
        assert st.recompiles_after_warmup == 0, st.recompile_reasons
        assert st.race_errors == 0
    finally:
        gate.mark_cold()


def test_target_compile_resolution():
    """auto: on for CUDA + inductor only; on: the spec's backend anywhere; an architecture the
    layer code cannot run turns auto off and makes on an error naming target.compile."""
    auto, on, off = (dataclasses.replace(SMOL, compile=m) for m in ("auto", "on", "off"))
    assert section_spec("target", {"model": "qwen3-8b"}).compile == "auto"  # the default
    assert compile_backend(auto, "cuda:0", "inductor") == "inductor"
    assert compile_backend(auto, "cpu", "inductor") is None
    assert compile_backend(auto, "cuda:0", "aot_eager") is None
    assert compile_backend(on, "cpu", "aot_eager") == "aot_eager"
    assert compile_backend(off, "cuda:0", "inductor") is None
    # YAML reads a bare `compile: off` / `on` as a boolean: the schema and resolution accept it
    assert section_spec("target", {"model": "qwen3-8b", "compile": False}).compile is False
    assert compile_backend(dataclasses.replace(SMOL, compile=False), "cuda:0", "inductor") is None
    assert compile_backend(dataclasses.replace(SMOL, compile=True), "cpu", "eager") == "eager"
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                       vocab_size=64, n_positions=32))
    assert compile_backend(auto, "cuda:0", "inductor", gpt2) is None
    with pytest.raises(SpecError, match=r"target.compile: 'on' .*model_type 'gpt2'"):
        compile_backend(on, "cpu", "inductor", gpt2)


def test_warmup_compiles_the_target_layers_when_on(micro_spec, monkeypatch):
    """The warmup stage's target part: with target.compile on, one gated compile per bucket on a
    one-layer copy of the target; with auto on CPU nothing (the CPU suite compiles no target)."""
    spec = load_spec(micro_spec)
    assert spec.target.compile == "auto"
    assert warm_target_features(spec, buckets(spec)) == []
    gate = gate_mod.Gate()
    monkeypatch.setattr(gate_mod, "_GATE", gate)
    on = spec.replace(target={"compile": "on"})
    records = warm_target_features(on, buckets(on))
    assert [(r["callable"], r["device"], r["bucket"]) for r in records] == [
        ("target_forward", "cpu", L) for L in buckets(on)]
    assert [c["sig"] for c in gate.stats().compiles] == [
        ("target_forward", "cpu", L) for L in buckets(on)]


def test_flex_option_switch_keeps_the_features_and_the_mask_needs_no_graph(monkeypatch):
    """The compiled layers' BlockMask is built from the documents' boundaries (the only new
    graph is the layer's: no mask graph); DFLASH_FLEX_KERNEL_OPTIONS reaches every layer call;
    the features stay the SDPA reference's."""
    ids, doc, pos = packed()
    ref = FeatureExtractor(load_target(TARGET, "cpu", need_tokenizer=False))(ids, doc, pos)
    tgt = load_target(TARGET, "cpu", need_tokenizer=False, attention="flex")
    assert FeatureExtractor(tgt, compile="aot_eager").flex_options is None
    monkeypatch.setenv("DFLASH_FLEX_KERNEL_OPTIONS", "BLOCK_M=64,BLOCK_N=64")
    fx = FeatureExtractor(tgt, compile="aot_eager")
    assert fx.flex_options == {"BLOCK_M": 64, "BLOCK_N": 64}
    graphs = counters["stats"]["unique_graphs"]
    got = fx(ids, doc, pos)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # the layer graph, no mask graph
    real = doc >= 0
    torch.testing.assert_close(got[:, real], ref[:, real], atol=1e-4, rtol=1e-4)
    seen, compiled = [], fx._layer
    fx._layer = lambda *args: seen.append(args[-1]) or compiled(*args)
    fx(ids, doc, pos)
    assert seen == [{"BLOCK_M": 64, "BLOCK_N": 64}] * len(tgt.model.model.layers)
