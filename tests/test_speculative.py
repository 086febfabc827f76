"""Speculative decoding is lossless w.r.t. target greedy; τ and acceptance bookkeeping add up."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.models.drafter import DFlashConfig, DFlashDrafter
from dflash.decode.eager import speculative_generate, target_greedy

V, MASK, P = 96, 95, 9


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny tensors: one intra-op thread is faster and robust to a busy machine."""


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    tc = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=4, intermediate_size=128, vocab_size=V)
    target = LlamaForCausalLM(tc).eval().float()
    cfg = DFlashConfig.from_target_config(tc, 2, 5, MASK, layer_ids=[0, 2])
    drafter = DFlashDrafter(cfg).eval()
    prompts = [torch.randint(0, MASK, (P,), generator=torch.Generator().manual_seed(s))
               for s in range(3)]
    return target, drafter, cfg, prompts


def check_bookkeeping(res, n_tokens, B):
    assert len(res.tokens) == n_tokens
    assert res.target_forwards == len(res.block_lengths) == len(res.accepted)
    assert sum(res.block_lengths) == n_tokens - 1       # first token comes from the prefill
    assert all(1 <= n <= a + 1 for n, a in zip(res.block_lengths, res.accepted))
    assert res.tau >= 1.0 and res.tau == sum(res.block_lengths) / res.target_forwards
    assert len(res.accept_counts) == B - 1
    assert res.accept_counts == [sum(a > k for a in res.accepted) for k in range(B - 1)]
    assert all(x >= y for x, y in zip(res.accept_counts, res.accept_counts[1:]))


def test_untrained_drafter_is_lossless(setup):
    target, drafter, cfg, prompts = setup
    emb, head = target.get_input_embeddings(), target.lm_head.weight
    for p in prompts[:2]:
        ref = target_greedy(target, p, 16)
        res = speculative_generate(target, drafter, cfg, emb, head, p, 16)
        assert res.tokens == ref
        check_bookkeeping(res, 16, cfg.block_size)


def oracle(greedy, corrupt_at=None):
    """A drafter that knows the target's greedy output (optionally wrong at one block slot)."""
    padded = greedy + [0] * 16

    def draft(anchor, anchor_pos):
        i = anchor_pos - P                       # index of the anchor among generated tokens
        assert padded[i] == anchor
        d = padded[i + 1:i + 5]
        if corrupt_at is not None:
            d[corrupt_at] = (d[corrupt_at] + 1) % MASK
        return torch.tensor(d)
    return draft


def test_perfect_drafts_accept_whole_blocks(setup):
    target, _, cfg, prompts = setup
    ref = target_greedy(target, prompts[0], 30)
    res = speculative_generate(target, None, cfg, None, None, prompts[0], 30,
                               draft_fn=oracle(ref))
    assert res.tokens == ref                     # the KV cache was cropped and reused correctly
    check_bookkeeping(res, 30, cfg.block_size)
    assert res.block_lengths[:-1] == [cfg.block_size] * (len(res.block_lengths) - 1)
    assert res.tau > 4.0


def test_partly_wrong_drafts_stay_lossless(setup):
    target, _, cfg, prompts = setup
    ref = target_greedy(target, prompts[1], 30)
    res = speculative_generate(target, None, cfg, None, None, prompts[1], 30,
                               draft_fn=oracle(ref, corrupt_at=2))
    assert res.tokens == ref
    check_bookkeeping(res, 30, cfg.block_size)
    # positions 1, 2 always accepted; slot 3 is always wrong, so nothing beyond it is
    assert res.accepted[:-1] == [2] * (len(res.accepted) - 1)
    assert res.accept_counts[2:] == [0, 0]
    assert res.block_lengths[:-1] == [3] * (len(res.block_lengths) - 1)


def test_eos_stops_both_decoders(setup):
    target, drafter, cfg, prompts = setup
    ref = target_greedy(target, prompts[2], 30)
    eos = ref[7]                                  # pretend an early token is EOS
    cut = ref[:ref.index(eos) + 1]
    assert target_greedy(target, prompts[2], 30, eos_id=eos) == cut
    for fn in (None, oracle(ref)):
        res = speculative_generate(target, drafter, cfg, target.get_input_embeddings(),
                                   target.lm_head.weight, prompts[2], 30, eos_id=eos,
                                   draft_fn=fn)
        assert res.tokens == cut
