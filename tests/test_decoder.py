"""The one decoder (dflash.decode.speculative): float32 output bit-identical to target greedy, for the
speculative path with a real (briefly trained) drafter and for the target-only path; batch > 1
with per-sequence acceptance, lengths and eos; the on-device lossless counters."""
import time

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.errors import DFlashError
from dflash.decode.adaptive import expected_tokens
from dflash.decode.speculative import Decoder
from dflash.decode.speculative_step import context_kv, context_kv_weights
from dflash.eval.report import ci, fmt, write_plots
from dflash.eval.serving import goal, sweep
from dflash.decode.eager import target_greedy
from dflash.decode.engine import Engine
from dflash.eval.tau import greedy_continuations
from dflash.models.layers import fused_weights, out_mlp
from dflash.models.drafter import DFlashConfig, DFlashDrafter, rope_cos_sin
from tests.test_bench_tau import REPO
from tests.test_evaluate import train_briefly

V, MASK, B, EOS = 96, 95, 5, 93


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny tensors: one intra-op thread is faster and robust to a busy machine."""


@pytest.fixture(scope="module")
def world():
    torch.manual_seed(0)
    tc = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=4, intermediate_size=128, vocab_size=V,
                     eos_token_id=EOS, pad_token_id=EOS)
    target = LlamaForCausalLM(tc).eval().float()
    cfg = DFlashConfig.from_target_config(tc, 1, B, MASK, layer_ids=[0, 2])
    ps = [torch.randint(0, MASK - 3, (5 + 3 * s,), generator=torch.Generator().manual_seed(s))
          .tolist() for s in range(4)]
    conts = greedy_continuations(target, ps, 24, [EOS])
    drafter = train_briefly(DFlashDrafter(cfg), target, cfg, ps, conts, steps=80)
    greedy = [target_greedy(target, torch.tensor(p), 24) for p in ps]
    return target, drafter, cfg, ps, greedy


def make(target, drafter, batch, **kw):
    return Decoder(target, drafter, batch=batch, max_len=40, max_new_tokens=24,
                   eos_ids=kw.pop("eos", [V + 1]), **kw)


def test_fp32_bit_identical_to_target_greedy(world):
    target, drafter, cfg, ps, greedy = world
    base = make(target, None, 2).decode(ps)
    dec = make(target, drafter, 2)
    spec = dec.decode(ps)
    assert [r.tokens for r in base] == greedy            # the engine's one-token path
    assert [r.tokens for r in spec] == greedy            # speculative, batch 2 (3 waves)
    taus = [r.tau for r in spec]
    assert max(taus) > 1.5 and all(t >= 1.0 for t in taus)      # the drafter is accepted
    assert all(r.target_forwards == len(r.block_lengths) == len(r.accepted) for r in spec)
    assert all(sum(r.block_lengths) == 23 for r in spec)        # first token from the prefill
    assert [r.accept_counts for r in spec] == [
        [sum(a > k for a in r.accepted) for k in range(B - 1)] for r in spec]
    # every emitted token was checked against the verify argmax on the device; none differed
    assert dec.stats["mismatches"] == 0
    assert dec.stats["checked"] >= sum(sum(r.block_lengths) for r in spec)
    assert all(len(r.margins) == len(r.tokens) and min(r.margins) >= 0 for r in spec)


def test_target_only_decoder_equals_the_engines_greedy_output(world):
    """decode/'s two engines on one target (CPU float32): the Decoder's target-only path (one
    token a step, no drafter) and the generation Engine's greedy continuous batch agree token for
    token, eos included (EOS stops both)."""
    target, drafter, cfg, ps, greedy = world
    dec = make(target, None, 2, eos=[EOS]).decode(ps)
    eng = Engine(target, slots=2, max_len=40, max_new_tokens=24, eos_ids=[EOS]).generate(ps)
    assert [r.tokens for r in dec] == eng
    assert any(len(t) == 24 for t in eng)


def test_each_wave_is_timed_prefill_steps_and_harvest_apart(world):
    """Where a decode's time goes, per wave (the H200's wall-vs-replay gap is per wave): 4
    prompts at batch 3 are 2 waves, each with its prefill, steps and harvest timed; a second
    decode adds to the same sums; the three parts never exceed the decode's wall time."""
    target, drafter, cfg, ps, greedy = world
    dec = make(target, drafter, 3)
    t = time.perf_counter()
    dec.decode(ps)
    wall_ms = 1e3 * (time.perf_counter() - t)
    first = {k: dec.stats[k] for k in ("prefill_ms", "steps_ms", "harvest_ms")}
    assert dec.stats["waves"] == 2 and all(v > 0 for v in first.values())
    assert sum(first.values()) <= wall_ms
    dec.decode(ps[:1])
    assert dec.stats["waves"] == 3
    assert all(dec.stats[k] > v for k, v in first.items())


def test_narrower_verify_stays_lossless(world):
    """The drafter drafts its whole block, the target verifies the first 3 tokens of it."""
    target, drafter, cfg, ps, greedy = world
    dec = make(target, drafter, 2, verify_tokens=3)
    res = dec.decode(ps)
    assert [r.tokens for r in res] == greedy and dec.K == 3 and dec.Kd == B
    lengths = [n for r in res for n in r.block_lengths]
    assert max(lengths) == 3 and all(len(r.accept_counts) == 2 for r in res)
    assert dec.stats["mismatches"] == 0


def test_padded_prefill_gives_the_unpadded_tokens(world):
    """The padded prefill (CUDA's captured one, forced eager on CPU): every wave's prompts
    padded to 32 tokens, rows past the wave lens 0. Target-only and speculative, batch 1 and a
    batch of mixed prompt lengths (5..14 tokens, 3 rows with 1 unused in the last wave): the
    tokens, the blocks and the caches' prompt K/V equal the unpadded prefill's."""
    target, drafter, cfg, ps, greedy = world
    for d, batch in ((None, 1), (drafter, 1), (None, 3), (drafter, 3)):
        plain, padded = make(target, d, batch), make(target, d, batch, padded_prefill=True)
        assert padded._prefill.length(ps) == 32 and plain._prefill.length(ps) == 14
        a, b = plain.decode(ps), padded.decode(ps)
        assert [r.tokens for r in a] == [r.tokens for r in b] == greedy
        assert [r.block_lengths for r in a] == [r.block_lengths for r in b]
        assert padded.stats["prefill_graphs"] == 0 and padded.stats["mismatches"] == 0
    with torch.inference_mode():                     # the last wave: prompt 3 in row 0
        plain._prefill.run(ps[3:]), padded._prefill.run(ps[3:])
    n = len(ps[3])
    for kp, kq in zip(plain.k_cache + plain.dk_cache, padded.k_cache + padded.dk_cache):
        assert torch.allclose(kp[0, :, :n], kq[0, :, :n], atol=1e-6)
    assert padded.pos.tolist() == [n, 0, 0] and padded.active.tolist() == [True, False, False]


def test_batch_sequences_finish_independently(world):
    """Per-sequence acceptance (perfect / corrupted / useless drafts side by side) and lengths
    (an early eos for one prompt): batch 3 gives each prompt exactly its batch-1 decode."""
    target, _, cfg, ps, greedy = world
    eos = greedy[1][6]
    want = [g[:g.index(eos) + 1] if eos in g else g for g in greedy]
    plan = {0: None, 1: 2, 2: 0, 3: 1}                   # prompt -> corrupted draft slot

    def hook(i, anchor, pos, offset=0):
        i += offset
        cont = want[i] + [0] * B
        j = pos - len(ps[i])
        assert cont[j] == anchor                        # the anchor is the last emitted token
        d = cont[j + 1:j + B]
        if plan[i] is not None:
            d[plan[i]] = (d[plan[i]] + 1) % MASK
        return d

    kw = dict(block_size=B, eos=[eos])
    batched = make(target, None, 3, draft_hook=hook, **kw).decode(ps)
    alone = [make(target, None, 1, draft_hook=lambda i, a, p, o=o: hook(i, a, p, o), **kw)
             .decode([ps[o]])[0] for o in range(len(ps))]
    assert [r.tokens for r in batched] == want == [r.tokens for r in alone]
    assert [r.block_lengths for r in batched] == [r.block_lengths for r in alone]
    assert len(batched[1].tokens) < len(batched[0].tokens)      # eos ended prompt 1 early
    assert batched[0].block_lengths[:-1] == [B] * (len(batched[0].block_lengths) - 1)
    assert set(batched[2].block_lengths) == {1}                  # slot 1 always wrong
    assert set(batched[1].accepted[:-1]) <= {2}


def test_a_finished_sequence_stepped_on_stays_inside_its_caches(world):
    """A sequence that ends by max_new_tokens with a long accepted run, then stepped on while
    inactive (the captured step runs sync_every steps between checks, and other rows keep it
    running at batch > 1), must not index past the caches. Round 16 (H200): the quality
    drafter's decode sweep hit a device-side assert at batch 16 (``index out of bounds: 0 <=
    tmp4 < 416``, the cache length) when the row with the longest prompt accepted a whole block
    in its last step. Sized with no slack: cache 32 (max_len 27 + block 5), 8 new tokens, a
    19-token prompt (the longest that fits); perfect drafts emit 1, 5 (6) then the last 2."""
    target, *_ = world
    prompt = torch.randint(0, MASK - 3, (19,), generator=torch.Generator().manual_seed(7)).tolist()
    cont = target_greedy(target, torch.tensor(prompt), 8 + B)

    def perfect(i, anchor, pos):
        return cont[pos - len(prompt) + 1:pos - len(prompt) + B]

    dec = Decoder(target, None, batch=1, max_len=27, max_new_tokens=8, eos_ids=[V + 1],
                  draft_hook=perfect, block_size=B, sync_every=4)
    assert dec.S == 32
    (r,) = dec.decode([prompt])
    assert r.tokens == cont[:8] and r.block_lengths == [B, 2]
    assert dec.stats["steps"] == 4                      # two of them on the finished row
    assert int(dec.pos[0]) < dec.S - B + 1              # its verify still fits the cache


def test_prompt_that_does_not_fit_is_one_clear_error(world):
    target, drafter, *_ = world
    with pytest.raises(DFlashError, match="prompt 1 has"):
        make(target, drafter, 1).decode([[1, 2], list(range(60))])


# graphs per scope, (speculative, target-only): regions = qkv + attend_cache per model, the
# two heads, the drafter context; layer (and fused) = the whole layer per model, the two heads,
# the verify and draft prologues, acceptance, the context; step = one
SCOPE_GRAPHS = {"regions": (7, 3), "layer": (8, 4), "fused": (8, 4), "step": (1, 1)}


@pytest.mark.parametrize("scope", sorted(SCOPE_GRAPHS))
def test_every_compile_scope_gives_the_same_tokens_in_a_fixed_set_of_graphs(world, scope):
    """Each scope through dynamo + AOTAutograd (the cache writes as mutated inputs, as on CUDA)
    on CPU: the tokens of target greedy, batch 2 with sequences finishing apart (an early eos
    for one prompt), exactly the scope's graphs (one per piece and shape, every layer of a
    model sharing one), and none more on a second decode (no recompile across steps)."""
    target, drafter, cfg, ps, greedy = world
    eos = greedy[1][6]
    want = [g[:g.index(eos) + 1] if eos in g else g for g in greedy]
    for model, n_graphs in zip((drafter, None), SCOPE_GRAPHS[scope]):
        torch._dynamo.reset()
        cc = CompileCounterWithBackend("aot_eager")
        dec = make(target, model, 2, compile=cc, compile_scope=scope, eos=[eos])
        assert [r.tokens for r in dec.decode(ps)] == want
        assert cc.frame_count == n_graphs == dec.stats["graphs_compiled"]
        assert [r.tokens for r in dec.decode(ps[::-1])] == want[::-1]
        assert cc.frame_count == n_graphs                       # no recompile
        assert dec.stats["mismatches"] == 0 and "context_compile_error" not in dec.stats
        assert dec.stats["compile_scope"] == scope
        assert (dec.stats["fused_weight_bytes"] > 0) == (scope in ("fused", "step"))
    assert len(want[1]) == 7 < len(want[0])                      # prompt 1 ended early


def test_inductor_default_scope_writes_the_caches_in_place(world):
    """The default scope through inductor on CPU (its reinplacing of the cache writes: the
    whole-layer region mutates the cache inputs, never copies them): the tokens of target
    greedy, batch 2, in the scope's graphs; the caches hold exactly the verified positions'
    K/V of the eager decoder."""
    target, drafter, cfg, ps, greedy = world
    torch._dynamo.reset()
    dec = make(target, drafter, 2, compile="inductor", compile_scope="fused")
    eager = make(target, drafter, 2)
    assert [r.tokens for r in dec.decode(ps[:2])] == greedy[:2] == \
        [r.tokens for r in eager.decode(ps[:2])]
    assert dec.stats["graphs_compiled"] == SCOPE_GRAPHS["fused"][0]
    valid = int(min(dec.pos.min(), eager.pos.min()))
    for a, b in zip(dec.k_cache + dec.dv_cache, eager.k_cache + eager.dv_cache):
        torch.testing.assert_close(a[:, :, :valid], b[:, :, :valid], rtol=1e-4, atol=1e-5)


def test_a_scope_that_fails_to_compile_falls_back_to_regions(world, capsys):
    """A backend that refuses any graph with a cache write (setitem) fails the default scope;
    the decoder falls back to "regions" (whose writes are eager), loudly and recorded, and
    decodes the same tokens."""
    target, drafter, cfg, ps, greedy = world

    def no_cache_writes(gm, inputs):
        if any(t in str(n.target) for n in gm.graph.nodes for t in ("setitem", "index_put")):
            raise RuntimeError("refused: a cache write in the graph")
        return gm.forward

    torch._dynamo.reset()
    dec = make(target, drafter, 2, compile=no_cache_writes)
    assert [r.tokens for r in dec.decode(ps[:2])] == greedy[:2]
    assert dec.stats["compile_scope"] == dec.scope == "regions"
    assert "refused: a cache write" in dec.stats["scope_compile_error"]
    assert "falling back to 'regions'" in capsys.readouterr().err


def test_fused_gemm_pieces_equal_the_modules(world):
    """The fused scopes' GEMMs (q/k/v and gate/up concatenated; every drafter layer's context
    k/v as one GEMM) give what the modules give, for a 3-layer drafter (the layers' slices of
    the stacked context weights in order)."""
    target, _, cfg, *_ = world
    torch.manual_seed(1)
    d = DFlashDrafter(DFlashConfig.from_target_config(target.config, 3, B, MASK,
                                                      layer_ids=[0, 2])).eval()
    feats, pos = torch.randn(2, 4, 2 * 64), torch.arange(4)[None].expand(2, 4)
    cos, sin = rope_cos_sin(pos, d.cfg.head_dim, d.cfg.rope_theta, torch.float32)
    with torch.no_grad():
        want = context_kv(d, feats, cos, sin)
        got = context_kv(d, feats, cos, sin, context_kv_weights(d))
        for (k1, v1), (k2, v2) in zip(want, got):
            torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-6)
        lay, x = target.model.layers[1], torch.randn(2, 4, 64)
        o = torch.randn(2, 4, 64)
        torch.testing.assert_close(out_mlp(lay, x, o, fused_weights(lay)), out_mlp(lay, x, o),
                                   rtol=1e-5, atol=1e-6)


def test_unknown_compile_scope_is_one_clear_error(world):
    target, drafter, *_ = world
    with pytest.raises(DFlashError, match="compile_scope 'graph'"):
        make(target, drafter, 1, compile_scope="graph")


def test_dynamic_shapes_compile_a_sweep_about_once(world):
    """bench.decode_shapes: the sweep's decoders (target-only, the full block, a narrower verify)
    at batch 1, 2, then 3. With torch's automatic dynamic shapes batch 2 recompiles symbolic and
    batch 3 compiles nothing, every engine still giving the tokens of target greedy; with static
    shapes (the default) a new batch size compiles again."""
    target, drafter, cfg, ps, greedy = world
    eos = greedy[1][6]
    want = [g[:g.index(eos) + 1] if eos in g else g for g in greedy]

    def graphs(b, model, width=None, shapes="dynamic"):
        dec = make(target, model, b, compile=cc, compile_shapes=shapes, eos=[eos],
                   verify_tokens=width)
        assert [r.tokens for r in dec.decode(ps)] == want
        assert dec.stats["mismatches"] == 0 and dec.stats["compile_shapes"] == shapes
        return dec.stats["graphs_compiled"]

    torch._dynamo.reset()
    cc = CompileCounterWithBackend("aot_eager")
    engines = ((None, None), (drafter, None), (drafter, 3))
    assert min(graphs(1, *e) for e in engines) > 0          # each engine's first shapes
    assert sum(graphs(2, *e) for e in engines) > 0          # a second batch size: symbolic
    assert [graphs(3, *e) for e in engines] == [0, 0, 0]   # batch 2's symbolic graphs serve
    torch._dynamo.reset()
    assert graphs(2, None, shapes="static") > 0
    assert graphs(3, None, shapes="static") > 0             # static: each batch size compiles
    with pytest.raises(DFlashError, match="compile_shapes 'auto'"):
        make(target, drafter, 1, compile_shapes="auto")


def test_sweep_rows_and_their_report_section(world, tmp_path):
    """The bench stage's batch sweep on CPU (the same code as on CUDA, eager): per batch size
    both engines and HF's static-cache generate, the lossless evidence, the report section and
    the plot."""
    target, drafter, cfg, ps, greedy = world
    lines = []
    r = sweep(target, drafter, ps[:3], 8, [V + 1], batches=(1, 2), min_prompts=3, pad_id=EOS,
              log=lines.append, widths=(2, 4))
    assert len(lines) == 2 and all("by verify width 2: " in x and ", 5: " in x for x in lines)
    rows = r.pop("batches")
    assert [x["batch"] for x in rows] == [1, 2] and all(x["prompts"] == 3 for x in rows)
    for x in rows:
        if x["batch"] == 1:                  # HF static, the outside reference: batch 1 only
            assert x["hf_static"]["tokens"] == 3 * 8             # no eos: every answer is full
        else:
            assert "hf_static" not in x
        assert x["target_only_tokens_per_s"] > 0 and x["speculative_tokens_per_s"] > 0
        ev = x["lossless_evidence"]
        assert ev["lossless"] and ev["identical_to_greedy"] == 3 and ev["emitted_not_argmax"] == 0
        a = x["adaptive"]                    # the choice, from this pair's measured step ms
        # every width its own decoder (2, 4 and the whole block B), the choice among them all
        assert a["batch"] == x["batch"] and [c["width"] for c in a["candidates"]] == [0, 2, 4, B]
        assert all(c["step_ms"] > 0 for c in a["candidates"])
        assert a["choice"] in (0, 2, 4, B) and x["choice_width"] == a["choice"]
        ws = {w["width"]: w for w in x["widths"]}
        assert sorted(ws) == [2, 4, B] and all(w["lossless"] and w["tokens_per_s"] > 0
                                               and w["identical_to_greedy"] == 3
                                               for w in ws.values())
        assert ws[B]["tokens_per_s"] == pytest.approx(x["speculative_tokens_per_s"])
        assert ws[B]["tau"] == pytest.approx(x["tau"]) and ws[2]["tau"] <= 2
        assert [c["step_ms"] for c in a["candidates"][1:]] == [ws[w]["step_ms"] for w in (2, 4, B)]
        assert set(x["wall_s"]) == {"target_only", "verify_2", "verify_4", f"verify_{B}"}
        # decided on each engine's warm wave (all-in ms a step, realized tokens a step), judged
        # by the timed decode after it
        assert [c["source"] for c in a["candidates"]] == ["decoded wave"] * 4
        warm = x["engine"]["target_only"]["warm"]
        assert warm["tokens"] == 3 * 8 and warm["steps"] > 0 and warm["seconds"] > 0
        assert a["candidates"][0]["expected_tokens_per_step"] == pytest.approx(
            warm["tokens"] / (warm["steps"] * x["batch"]), abs=1e-4)
        acc = a["accept_rate_by_position"]   # cumulative shares: never rising, 1 + Σ ≥ τ
        assert len(acc) == B - 1 and all(1 >= p >= q >= 0 for p, q in zip(acc, acc[1:]))
        assert acc[0] > 0 and expected_tokens(acc, B) >= x["tau"] - 1e-9
        assert x["choice"] == ("target-only" if a["choice"] == 0 else
                               f"speculative (verify {a['choice']})")
        sv = x["served"]                     # what the choice serves: its engine's timed decode
        assert sv["engine"] == ("target-only" if a["choice"] == 0 else "speculative")
        assert sv["seconds"] == (x["target_only_s"] if a["choice"] == 0 else
                                 ws[a["choice"]]["seconds"])
        assert sv["tokens"] == 3 * 8 and sv["identical_to_greedy"] == 3 and sv["seconds"] > 0
        assert x["choice_speedup"] == pytest.approx(
            sv["tokens_per_s"] / x["target_only_tokens_per_s"])
        assert "served_results" not in x
    g = goal(rows[0])
    assert g["speculative_over_tau_x_target_only"] == pytest.approx(
        rows[0]["speculative_tokens_per_s"] / (rows[0]["tau"] * rows[0]["target_only_tokens_per_s"]))
    tau = {"decode_speed": {"batches": rows, "set": "mtbench", "max_new_tokens": 8,
                            "goal_batch1": g}, "sets": {}}
    assert "decode_speed.png" in write_plots(tmp_path, [], tau)
    env = Environment(loader=FileSystemLoader(REPO / "dflash" / "templates"),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    src = env.loader.get_source(env, "report.md.j2")[0]
    part = src[src.index("## Decoding speed"):src.index("## Step time")]
    md = env.from_string(part).render(r={"acceptance": tau}, fmt=fmt, ci=ci)
    assert md.count("| 3 | ") == 2 and "(goal ≥ 0.85)" in md and "| True |" in md
    assert "| choice | speed-up of the choice | speed-up by verify width |" in md
    assert all(f"| {fmt(x['choice_speedup'])} | " + " · ".join(
        f"{w['width']}: {fmt(w['speedup'])}" for w in x["widths"]) + " | " in md for x in rows)
    assert all(f"- batch {x['batch']}: {x['adaptive']['why']} (target-only " in md for x in rows)
    assert all(f"| {fmt(x['speedup'])} | {x['choice']} | {fmt(x['choice_speedup'])} |" in md
               for x in rows)
    lo, hi = rows[0]["tau_ci95"]                  # 3 prompts: τ with its interval over them
    assert lo <= rows[0]["tau"] <= hi and f"{fmt(rows[0]['tau'])}{ci(rows[0])} |" in md
