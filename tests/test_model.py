"""The drafter: config, attention backends, no-cheating, loss, training, export round trip."""
import json
import math
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, Qwen3Config

from dflash import settings
from dflash.cli import main
from dflash.decode.generate import eos_ids_of
from dflash.errors import DFlashError
from dflash.eval.evalsets import heldout_prompts
from dflash.eval.tau import greedy_continuations, target_features
from dflash.artifacts.manifest import atomic_write_json
from dflash.models.drafter import (
    DFlashConfig,
    DFlashDrafter,
    RMSNorm,
    export_checksums,
    export_drafter,
    extract_features,
    hidden_state_indices,
    load_drafter,
    verify_export,
)
from dflash.models.masks import IGNORE_INDEX, PackedRow, dense_mask, flex_block_mask
from dflash.train.anchors import sample_anchors
from dflash.models.target import default_layer_ids, load_target, target_embeddings
from dflash.spec.load import load_spec
from dflash.train.objective import Objective

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

H, V, MASK = 64, 128, 127


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny tensors: one intra-op thread is faster and robust to a busy machine."""


def tiny_target_config(layers=6):
    return LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=layers, intermediate_size=128, vocab_size=V)


def tiny_cfg(block_size=4, n_layers=2):
    return DFlashConfig.from_target_config(tiny_target_config(), n_layers, block_size, MASK,
                                           layer_ids=[1, 3])


def objective(block_size, gamma=7.0):
    return Objective(block_size, MASK, max_anchors=1, token_budget=1, gamma=gamma)


def packed_row(seed=0):
    g = torch.Generator().manual_seed(seed)
    doc = [0] * 20 + [1] * 15 + [-1] * 5
    pos = list(range(20)) + list(range(15)) + [0] * 5
    lm = [0] * 5 + [1] * 15 + [0] * 3 + [1] * 12 + [0] * 5
    return PackedRow(torch.randint(0, MASK, (40,), generator=g), torch.tensor(doc),
                     torch.tensor(pos), torch.tensor(lm).bool(), [0, 1])


def inputs(cfg, row, blocks, seed=0):
    """Random stand-ins for the frozen target: features [1, L, n*H] and an embedding table."""
    g = torch.Generator().manual_seed(seed)
    L = row.input_ids.numel()
    feats = torch.randn(1, L, len(cfg.target_layer_ids) * H, generator=g)
    table = torch.randn(V, H, generator=g)
    emb = table[blocks.block_input_ids][None]
    return emb, feats, blocks.block_position_ids[None], row.position_ids[None], table


# ---------------------------------------------------------------------------------------------
def test_layer_ids_and_hidden_state_indices():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]      # Qwen3-8B reference drafter
    assert default_layer_ids(30, 3) == [1, 14, 27]
    assert default_layer_ids(12, 1) == [6]
    assert hidden_state_indices([1, 9]) == [2, 10]             # hidden_states[0] = embeddings
    hs = [torch.full((1, 2, 3), float(i)) for i in range(5)]
    f = extract_features(hs, [0, 2])
    assert f.shape == (1, 2, 6) and f[0, 0, 0] == 1 and f[0, 0, 3] == 3


def test_config_from_llama_and_qwen3():
    smol = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       num_hidden_layers=30, intermediate_size=1536, vocab_size=49152,
                       rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
                       max_position_embeddings=8192, rms_norm_eps=1e-5)
    c = DFlashConfig.from_target_config(smol, 3, 16, 49151, default_layer_ids(30, 3))
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (576, 9, 3, 64)
    assert c.rope_theta == 100000.0 and c.target_layer_ids == [1, 14, 27]
    assert c.num_target_layers == 30 and c.intermediate_size == 1536

    q = Qwen3Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                    num_hidden_layers=8, intermediate_size=512, vocab_size=1000)
    c = DFlashConfig.from_target_config(q, 1, 8, 999, layer_ids=[2, 5])
    assert c.head_dim == 128 and c.target_layer_ids == [2, 5] and c.num_hidden_layers == 1
    with pytest.raises(ValueError):
        DFlashConfig.from_target_config(q, 1, 8, 999, layer_ids=[8])


@pytest.mark.parametrize("compiled", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        not settings.slow_tests(),
        reason="compiling flex_attention on CPU takes ~45 s cold; DFLASH_SLOW_TESTS=1")),
])
def test_flex_equals_sdpa_forward(compiled):
    cfg = tiny_cfg()
    model = DFlashDrafter(cfg, compile_flex=compiled).eval()
    row = packed_row()
    bl = sample_anchors(row, 6, cfg.block_size, torch.Generator().manual_seed(0), MASK)
    emb, feats, bpos, cpos, _ = inputs(cfg, row, bl)
    with torch.no_grad():
        a = model(emb, feats, bpos, cpos, mask=dense_mask(row.doc_ids, bl)[None],
                  attention="sdpa")
        b = model(emb, feats, bpos, cpos, mask=flex_block_mask(row.doc_ids, bl),
                  attention="flex")
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cannot_cheat_context_strictly_before_anchor():
    """A block's output ignores the context at/after its anchor (its own labels), not before."""
    cfg = tiny_cfg()
    model = DFlashDrafter(cfg).eval()
    row = packed_row()
    bl = sample_anchors(row, 6, cfg.block_size, torch.Generator().manual_seed(3), MASK)
    emb, feats, bpos, cpos, _ = inputs(cfg, row, bl)
    mask = dense_mask(row.doc_ids, bl)[None]
    B = cfg.block_size
    a = 2
    p = int(bl.anchor_pos[a])
    rows_a = slice(a * B, (a + 1) * B)
    with torch.no_grad():
        base = model(emb, feats, bpos, cpos, mask=mask)
        after = feats.clone()
        after[:, p:p + B] += 5.0                  # the anchor's and its labels' features
        out_after = model(emb, after, bpos, cpos, mask=mask)
        before = feats.clone()
        before[:, p - 1] += 5.0
        out_before = model(emb, before, bpos, cpos, mask=mask)
    torch.testing.assert_close(out_after[:, rows_a], base[:, rows_a], atol=0, rtol=0)
    assert not torch.allclose(out_before[:, rows_a], base[:, rows_a])
    # the other blocks are isolated from block a's tokens as well
    emb2 = emb.clone()
    emb2[:, a * B] += 1.0
    with torch.no_grad():
        out = model(emb2, feats, bpos, cpos, mask=mask)
    others = torch.ones(base.shape[1], dtype=torch.bool)
    others[rows_a] = False
    torch.testing.assert_close(out[:, others], base[:, others], atol=0, rtol=0)


def test_training_drives_loss_down():
    torch.manual_seed(0)
    cfg = tiny_cfg()
    model = DFlashDrafter(cfg)
    row = packed_row()
    bl = sample_anchors(row, 8, cfg.block_size, torch.Generator().manual_seed(0), MASK)
    emb, feats, bpos, cpos, table = inputs(cfg, row, bl)
    mask = dense_mask(row.doc_ids, bl)[None]
    lm_head = torch.randn(V, H) / H ** 0.5
    obj = objective(cfg.block_size)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        loss, _ = obj.loss(model(emb, feats, bpos, cpos, mask=mask)[0], lm_head, bl)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses


def test_export_load_round_trip(tmp_path):
    cfg = tiny_cfg(block_size=8, n_layers=2)
    model = DFlashDrafter(cfg).eval()
    export_drafter(model, cfg, tmp_path / "drafter")
    d = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert d["model_type"] == "qwen3" and d["architectures"] == ["DFlashDraftModel"]
    assert d["block_size"] == 8 and d["num_target_layers"] == 6
    assert d["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": cfg.target_layer_ids}
    assert d["hidden_size"] == H and d["num_hidden_layers"] == 2 and d["head_dim"] == 16
    # the reference Qwen3 config must parse it
    qc = Qwen3Config(**{k: v for k, v in d.items() if k not in ("architectures",)})
    assert qc.num_key_value_heads == 2

    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    expected = {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    expected |= {"norm.weight", "fc.weight", "hidden_norm.weight"}
    with safe_open(str(tmp_path / "drafter" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == expected
        assert tuple(f.get_tensor("fc.weight").shape) == (H, 2 * H)
    assert not list((tmp_path / "drafter").glob("*.tmp"))          # atomic writes left nothing

    loaded, cfg2 = load_drafter(tmp_path / "drafter", "cpu")
    assert cfg2 == cfg
    row = packed_row()
    bl = sample_anchors(row, 4, 8, torch.Generator().manual_seed(0), MASK)
    emb, feats, bpos, cpos, _ = inputs(cfg, row, bl)
    mask = dense_mask(row.doc_ids, bl)[None]
    with torch.no_grad(), warnings.catch_warnings():
        torch.testing.assert_close(loaded(emb, feats, bpos, cpos, mask=mask),
                                   model(emb, feats, bpos, cpos, mask=mask), atol=0, rtol=0)


def test_initial_loss_on_smollm2_is_the_mask_token_path_and_falls_fast():
    """Why the first loss is ~50-80 (H200: 48.7), not ~ln(vocab) = 10.8, on the real target.

    Our init is the reference drafter's (transformers' Qwen3 init: every Linear N(0, 0.02),
    RMSNorm weights 1). At init a mask position's last hidden state is mostly the mask token's
    embedding (cos ~0.67; the std-0.02 branches add the rest), RMS-normalised to norm sqrt(H)
    by the unit final norm: through SmolLM2's TIED lm_head its logits are ~ cos * sqrt(H) *
    |e_t| * cos(e_t, e_mask): up to ~80 for tokens near the mask token, ~0 for the label. So
    the initial loss is cos times the loss of the normalised mask embedding alone, and it is
    gone after a few steps. Measured alternatives were worse at 150 steps (docs/benchmarks.md):
    a final-norm weight of 0.1 / 0.3 starts at 14 / 26 but reaches 6.55 / 5.14 (the norm weight
    IS the logit scale and Adam grows it by ~lr per step); the target's final-norm weights
    start at 112 and reach 4.54; unit weights (ours, the reference's) reach 4.39.
    """
    spec = load_spec(os.path.join(os.path.dirname(__file__), "..", "specs", "tiny.yaml"))
    tgt = load_target(spec.target, "cpu")
    cfg = DFlashConfig.of_spec(spec)
    emb, head = target_embeddings(spec.target)
    ps, _ = heldout_prompts(spec, None, tgt.tokenizer, 2)
    conts = greedy_continuations(tgt.model, ps, 24, eos_ids_of(tgt))
    seqs = [p + c for p, c in zip(ps, conts)]
    feats = target_features(tgt.model, seqs, cfg.target_layer_ids)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    for m in model.modules():                     # the reference init
        if isinstance(m, torch.nn.Linear):
            w = m.weight.detach()
            assert abs(float(w.std()) - 0.02) < 2e-3 and abs(float(w.mean())) < 1e-3
        elif isinstance(m, RMSNorm):
            assert bool((m.weight == 1).all())
    batch = []
    for p, s, f in zip(ps, seqs, feats):
        L = len(s)
        row = PackedRow(torch.tensor(s), torch.zeros(L, dtype=torch.long), torch.arange(L),
                        torch.tensor([0] * len(p) + [1] * (L - len(p))).bool(), [0])
        bl = sample_anchors(row, 16, cfg.block_size, torch.Generator().manual_seed(0),
                            cfg.mask_token_id)
        batch.append((row, bl, f[None]))

    def hidden(m, row, bl, f):
        return m(emb[bl.block_input_ids][None], f, bl.block_position_ids[None],
                 row.position_ids[None], dense_mask(row.doc_ids, bl)[None])

    obj = Objective(cfg.block_size, cfg.mask_token_id, 16, 1, 7.0)

    def loss_of(m):
        total = 0.0
        for row, bl, f in batch:
            total = total + obj.loss(hidden(m, row, bl, f), head, bl)[0]
        return total / len(batch)

    with torch.no_grad():
        first = float(loss_of(model))
        cos = torch.cat([torch.nn.functional.cosine_similarity(
            hidden(model, row, bl, f)[0][bl.labels != IGNORE_INDEX],
            emb[cfg.mask_token_id][None], dim=-1) for row, bl, f in batch]).mean()
        # the mask token's embedding alone, normalised like the drafter's output
        e = emb[cfg.mask_token_id]
        h_mask = e * torch.rsqrt(e.pow(2).mean() + cfg.rms_norm_eps)
        alone = []
        for row, bl, f in batch:
            hm = h_mask.expand(bl.labels.numel(), -1)[None]
            alone.append(float(obj.loss(hm, head, bl)[0]))
    alone = sum(alone) / len(alone)
    assert first > 3 * math.log(cfg.vocab_size)
    assert 0.4 < cos < 0.9 and abs(first / alone - cos) < 0.1, (first, alone, cos)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
    for _ in range(3):
        loss = loss_of(model)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        assert float(loss_of(model)) < first / 3, first


def test_export_check_verifies_the_drafter_by_content(tmp_path, capsys):
    """`dflash export-check DIR`: ok on a fresh export; one line naming the file for a flipped
    byte in the weights or an edited config (a changed block_size), against the folder's own
    checksums or the train manifest's record."""
    cfg = tiny_cfg(block_size=8, n_layers=1)
    out = export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "drafter")
    recorded = export_checksums(out)
    assert main(["export-check", str(out)]) == 0 and "ok: " in capsys.readouterr().out
    assert verify_export(out, recorded) == cfg
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    assert main(["export-check", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith(f"error: {weights}: damaged (sha256 "), err
    export_drafter(DFlashDrafter(cfg), cfg, out)  # a fresh export; then edit the config only
    conf = out / "config.json"
    conf.write_text(conf.read_text().replace('"block_size": 8', '"block_size": 16'))
    with pytest.raises(DFlashError, match=rf"{conf}: damaged"):
        verify_export(out, export_checksums(out) | {"config.json": recorded["config.json"]})
    assert main(["export-check", str(out)]) == 2
    assert f"{conf}: damaged" in capsys.readouterr().err


def test_artifacts_respect_the_umask(tmp_path):
    """Atomic writes give the mode a plain open() would (0666 minus the umask), not mkstemp's
    0600: teammates on a shared filesystem can read reports, datasets and drafters."""
    cfg = tiny_cfg(block_size=8, n_layers=1)
    for umask in (0o022, 0o002, 0o077):
        old = os.umask(umask)
        try:
            d = tmp_path / f"u{umask:o}"
            export_drafter(DFlashDrafter(cfg), cfg, d / "drafter")
            atomic_write_json(d / "report.json", {"a": 1})
            with open(d / "plain", "w"):
                pass
        finally:
            os.umask(old)
        want = (d / "plain").stat().st_mode & 0o777
        assert want == 0o666 & ~umask
        for f in ("report.json", "drafter/config.json", "drafter/model.safetensors",
                  "drafter/checksums.json"):
            assert (d / f).stat().st_mode & 0o777 == want, (f, oct(umask))
