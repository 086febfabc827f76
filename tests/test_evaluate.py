"""τ evaluation: simulated acceptance == real speculative decoding == target greedy; dtypes.

A tiny random Llama target (fp32) and a tiny drafter. Acceptance is made non-trivial two ways:
a drafter trained briefly on the target's own continuations (so real drafts are accepted at
mixed lengths), and injected perfect / corrupted drafts through the same hooks both paths use.
"""
import itertools
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.decode.decoded import Decoded, divergence, lossless_evidence
from dflash.eval.evalsets import EvalSet
from dflash.decode.eager import DrafterCache, draft_block, speculative_generate, target_greedy
from dflash.eval.tau import (
    Chain,
    continuation_engine,
    draft_every_position,
    evaluate_sets,
    greedy_continuations,
    real_chain,
    simulate,
    summarize,
    target_features,
    walk_chain,
)
from dflash.models.drafter import DFlashConfig, DFlashDrafter
from dflash.models.masks import PackedRow, dense_mask
from dflash.train.anchors import sample_anchors
from dflash.train.objective import Objective

V, MASK, B, EOS = 96, 95, 5, [93]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny tensors: one intra-op thread is faster and robust to a busy machine."""


def tiny_target(dtype=torch.float32):
    torch.manual_seed(0)
    tc = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=4, intermediate_size=128, vocab_size=V,
                     eos_token_id=EOS[0], pad_token_id=EOS[0])
    return LlamaForCausalLM(tc).eval().to(dtype), tc


def prompts(n=4):
    return [torch.randint(0, MASK - 3, (7 + 2 * s,),
                          generator=torch.Generator().manual_seed(s)).tolist()
            for s in range(n)]


@pytest.fixture(scope="module")
def world():
    target, tc = tiny_target()
    cfg = DFlashConfig.from_target_config(tc, 1, B, MASK, layer_ids=[0, 2])
    ps = prompts()
    conts = greedy_continuations(target, ps, 24, EOS)
    trained = train_briefly(DFlashDrafter(cfg), target, cfg, ps, conts)
    return target, cfg, ps, conts, trained


def train_briefly(drafter, target, cfg, ps, conts, steps=120):
    """Overfit the drafter to the target's continuations of these prompts (the training
    layout: every response position an anchor), so its drafts are often, not always, right."""
    torch.manual_seed(1)
    seqs = [p + c for p, c in zip(ps, conts)]
    feats = target_features(target, seqs, cfg.target_layer_ids)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    emb, head = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    batches = []
    for p, s, f in zip(ps, seqs, feats):
        L = len(s)
        row = PackedRow(torch.tensor(s), torch.zeros(L, dtype=torch.long), torch.arange(L),
                        torch.tensor([0] * len(p) + [1] * (L - len(p))).bool(), [0])
        blocks = sample_anchors(row, L, cfg.block_size, None, cfg.mask_token_id)
        batches.append((row, blocks, f[None]))
    obj = Objective(cfg.block_size, cfg.mask_token_id, max_anchors=1, token_budget=1, gamma=4.0)
    drafter.train()
    for step in range(steps):
        row, blocks, f = batches[step % len(batches)]
        h = drafter(emb[blocks.block_input_ids][None], f, blocks.block_position_ids[None],
                    row.position_ids[None], dense_mask(row.doc_ids, blocks)[None])
        loss, _ = obj.loss(h, head, blocks)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def oracle_drafts(conts, corrupt_at=None):
    """Drafts at every anchor that know the continuation (optionally wrong at one slot)."""
    out = []
    for c in conts:
        padded = c + [0] * B
        d = torch.tensor([padded[j + 1:j + B] for j in range(len(c) - 1)], dtype=torch.long)
        if corrupt_at is not None and len(d):
            d[:, corrupt_at] = (d[:, corrupt_at] + 1) % MASK
        out.append(d.reshape(-1, B - 1))
    return out


def oracle_fn(prompt_len, cont, corrupt_at=None):
    padded = cont + [0] * B

    def draft(anchor, anchor_pos):
        i = anchor_pos - prompt_len
        d = padded[i + 1:i + B]
        if corrupt_at is not None:
            d[corrupt_at] = (d[corrupt_at] + 1) % MASK
        return torch.tensor(d)
    return draft


# ---------------------------------------------------------------------------------------------
def test_walk_chain_by_hand():
    cont = [10, 11, 12, 13, 14, 15, 16]          # 7 tokens: 6 after the first (prefill) one
    d = torch.zeros((6, 4), dtype=torch.long)
    d[0] = torch.tensor([11, 12, 0, 0])           # 2 accepted -> 3 produced, next anchor 3
    d[3] = torch.tensor([14, 15, 16, 99])         # 3 left after anchor 3: all accepted -> 3
    ch = walk_chain(d, cont)
    assert ch.starts == [0, 3] and ch.accepted == [2, 3] and ch.produced == [3, 3]
    assert ch.remaining == [6, 3]
    s = summarize([ch], 5)
    assert s["tau"] == 3.0 and s["tokens"] == 6 and s["forwards"] == 2
    # position 4 is only eligible where 4 tokens were left: the first block, which missed it
    assert s["accept_rate_by_position"] == [1.0, 1.0, 0.5, 0.0]
    assert walk_chain(torch.zeros((0, 4), dtype=torch.long), [7]).produced == []


@pytest.mark.parametrize("corrupt_at", [None, 1])
def test_injected_drafts_simulated_equals_real(world, corrupt_at):
    target, cfg, ps, conts, _ = world
    sim = [walk_chain(d, c) for d, c in zip(oracle_drafts(conts, corrupt_at), conts)]
    for p, c, ch in zip(ps, conts, sim):
        res = speculative_generate(target, None, cfg, None, None, torch.tensor(p), 24, EOS,
                                   draft_fn=oracle_fn(len(p), c, corrupt_at))
        assert res.tokens == c == target_greedy(target, torch.tensor(p), 24, EOS)
        rc = real_chain(res, len(res.tokens))
        assert (rc.starts, rc.accepted, rc.produced) == (ch.starts, ch.accepted, ch.produced)
    s = summarize(sim, B)
    if corrupt_at is None:
        assert s["tau"] > 3.0                      # whole blocks accepted
    else:
        assert max(p for ch in sim for p in ch.produced) == 2   # slot 2 is always wrong


def test_trained_drafter_simulated_equals_real_and_lossless(world):
    target, cfg, ps, conts, drafter = world
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    sim = simulate(target, drafter, emb, head, ps, 24, EOS, cfg.target_layer_ids, "cpu")
    assert sim["continuations"] == conts
    produced = []
    for p, c, ch in zip(ps, conts, sim["chains"]):
        res = speculative_generate(target, drafter, cfg, emb, head, torch.tensor(p), 24, EOS)
        assert res.tokens == c == target_greedy(target, torch.tensor(p), 24, EOS)
        rc = real_chain(res, len(res.tokens))
        assert (rc.starts, rc.accepted, rc.produced) == (ch.starts, ch.accepted, ch.produced)
        produced += ch.produced
    # acceptance is non-trivial: some blocks accept several drafts, some none
    assert max(produced) >= 3 and min(produced) == 1
    assert summarize(sim["chains"], B)["tau"] > 1.5


def test_every_position_drafts_equal_single_block_drafts(world):
    """The batched all-anchor call (training mask) drafts exactly what draft_block drafts."""
    target, cfg, ps, conts, drafter = world
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    seqs = [p + c for p, c in zip(ps, conts)]
    feats = target_features(target, seqs, cfg.target_layer_ids)
    # small query budget: several calls, several rows per prompt, padded rows and anchors
    drafts = draft_every_position(drafter, emb, head, seqs, feats, [len(p) for p in ps],
                                  query_tokens=3 * B)
    for p, s, f, d in zip(ps, seqs, feats, drafts):
        for j in range(0, len(s) - len(p) - 1, 5):
            a = len(p) + j
            ref = draft_block(drafter, cfg, emb, head, s[a], a, f[None, :a])
            cache = DrafterCache(drafter)
            cache.extend(f[None, :a])
            assert torch.equal(d[j], ref)
            assert torch.equal(draft_block(drafter, cfg, emb, head, s[a], a, cache=cache), ref)


DTYPE_TAU_BAND = (1.7, 2.7)


@pytest.mark.parametrize("tdt,ddt", list(itertools.product(DTYPES, DTYPES)),
                         ids=lambda d: str(d).removeprefix("torch."))
def test_dtype_matrix(world, tdt, ddt):
    """Every (target dtype, drafter dtype) the schema allows runs the eval path on CPU (torch
    2.13 has CPU kernels for fp16 matmul); fp32/fp32 must also be lossless and match."""
    _, cfg, ps, _, trained = world
    target, _ = tiny_target(tdt)
    drafter = DFlashDrafter(cfg).eval()
    drafter.load_state_dict(trained.state_dict())
    drafter.to(ddt)
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    sets = [EvalSet("s", ps[:2], ["a", "b"])]
    out = evaluate_sets(target, drafter, emb, head, sets, 12, EOS, 1, "cpu", log=lambda _: None)
    r = out["s"]
    # the trained drafter is accepted in every dtype pair, not just "τ >= 1" (any drafter): τ
    # measured 2.2 in all nine pairs (simulated and real) when this band was committed
    assert DTYPE_TAU_BAND[0] <= r["tau"] <= DTYPE_TAU_BAND[1], r["tau"]
    assert math.isfinite(r["tau"]) and set(r["tau_by_category"]) == {"a", "b"}
    assert DTYPE_TAU_BAND[0] <= r["real"]["tau"] <= DTYPE_TAU_BAND[1] and r["real"]["prompts"] == 1
    if tdt == ddt == torch.float32:
        assert r["real"]["lossless"] and r["real"]["blocks_equal_simulated"] == 1
        assert r["tau"] > 1.5


def test_one_engine_serves_every_set_with_the_hf_loop_s_tokens(world):
    """The eval sets' continuations come from ONE fast engine (sized for the largest set and
    the longest prompt of all sets, reused by each), and they are the HF loop's greedy tokens
    (float32: identical)."""
    target, _, ps, conts, _ = world
    sets = [ps[:1], ps]
    eng = continuation_engine(target, sets, 24, EOS, slots=3)
    assert eng is not None and eng.B == 3 and eng.S >= max(len(p) for p in ps) + 24
    for prompts_ in sets:
        got = greedy_continuations(target, prompts_, 24, EOS, engine=eng)
        assert got == conts[:len(prompts_)]
    assert continuation_engine(target, [[], []], 24, EOS, slots=3) is None


def test_summary_of_an_untrained_drafter(world):
    target, cfg, ps, conts, _ = world
    torch.manual_seed(3)
    drafter = DFlashDrafter(cfg).eval()
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    sim = simulate(target, drafter, emb, head, ps, 24, EOS, cfg.target_layer_ids, "cpu")
    s = summarize(sim["chains"], B)
    assert s["tokens"] == sum(len(c) - 1 for c in conts)   # every token after the first
    assert s["forwards"] == sum(len(ch.produced) for ch in sim["chains"])
    assert len(s["tokens_per_forward_histogram"]) == B + 1
    assert sum(s["tokens_per_forward_histogram"]) == s["forwards"]
    assert isinstance(sim["chains"][0], Chain)


def test_divergence_report_finds_the_first_difference():
    c = list(range(10))
    m = [1.0] * 10
    m[5] = 0.01                                           # a near-tie at the first difference
    plain = Decoded(c, 9, 1.0, [], margins=m)
    wrong = Decoded(c[:5] + [99] + c[6:], 3, 3.0, [], margins=m)
    d = divergence(wrong, plain)
    assert d["index"] == 5 and d["greedy_token"] == 5 and d["speculative_token"] == 99
    assert d["margin"] == 0.01 and d["near_tie"]
    assert divergence(plain, plain) is None
    ev = lossless_evidence([wrong, plain], [plain, plain], checked=20, mismatches=0)
    assert ev["lossless"] and ev["identical_to_greedy"] == 1
    m[5] = 3.0                                            # a real difference: not lossless
    assert not lossless_evidence([wrong], [plain], 20, 0)["lossless"]
    assert not lossless_evidence([plain], [plain], 20, 1)["lossless"]   # a non-argmax token


# ---------------------------------------------------------------------------------------------
# τ values a broken drafter, walk or summary cannot reach (not just τ >= 1, which any drafter
# gives: the bonus token)
def _whole_blocks(conts, n_blocks=3):
    """Each continuation cut to 1 + n·B tokens: the prefill token, then n whole blocks."""
    cut = [c[:1 + n_blocks * B] for c in conts]
    assert all(len(c) == 1 + n_blocks * B for c in cut), [len(c) for c in conts]
    return cut


def test_perfect_drafts_give_tau_block_size_exactly(world):
    """Drafts that know the continuation: every block accepts its B-1 drafts + the bonus token,
    simulated (the walk) and real (speculative decoding through the same draft hook)."""
    target, cfg, ps, conts, _ = world
    cut = _whole_blocks(conts)
    sim = [walk_chain(d, c) for d, c in zip(oracle_drafts(cut), cut)]
    s = summarize(sim, B)
    assert s["tau"] == B and s["forwards"] == 3 * len(cut)
    assert all(ch.produced == [B] * 3 and ch.accepted == [B - 1] * 3 for ch in sim)
    assert s["accept_rate_by_position"] == [1.0] * (B - 1)
    assert s["tokens_per_forward_histogram"] == [0] * B + [3 * len(cut)]
    real = []
    for p, c in zip(ps, cut):
        res = speculative_generate(target, None, cfg, None, None, torch.tensor(p), len(c), [],
                                   draft_fn=oracle_fn(len(p), c))
        assert res.tokens == c
        real.append(real_chain(res, len(res.tokens)))
    assert summarize(real, B)["tau"] == B


def test_drafts_wrong_at_the_first_slot_give_tau_one_exactly(world):
    """Every first draft wrong: no draft is ever accepted, each forward yields the bonus token
    only, so τ is exactly 1 (simulated and real) and the acceptance rate is 0 everywhere."""
    target, cfg, ps, conts, _ = world
    sim = [walk_chain(d, c) for d, c in zip(oracle_drafts(conts, corrupt_at=0), conts)]
    s = summarize(sim, B)
    assert s["tau"] == 1.0 and s["tokens"] == s["forwards"] == sum(len(c) - 1 for c in conts)
    assert all(a == 0.0 for a in s["accept_rate_by_position"] if a is not None)
    p, c = ps[0], conts[0]
    res = speculative_generate(target, None, cfg, None, None, torch.tensor(p), 24, EOS,
                               draft_fn=oracle_fn(len(p), c, corrupt_at=0))
    assert res.tokens == c and summarize([real_chain(res, len(c))], B)["tau"] == 1.0


# The briefly trained drafter of ``world`` (fp32, seeded): τ measured 2.71 on these four
# prompts when this band was committed; a drafter or walk that halves acceptance (τ - 1 halves)
# falls below it, one that accepts everything rises above it.
TRAINED_TAU_BAND = (2.3, 3.1)


def test_trained_drafter_tau_within_the_committed_band(world):
    target, cfg, ps, conts, drafter = world
    emb, head = target.get_input_embeddings().weight, target.lm_head.weight
    sim = simulate(target, drafter, emb, head, ps, 24, EOS, cfg.target_layer_ids, "cpu")
    tau = summarize(sim["chains"], B)["tau"]
    assert TRAINED_TAU_BAND[0] <= tau <= TRAINED_TAU_BAND[1], tau
