"""Prompt-token surprisal from a model's output projection (torch only)."""
import math

import pytest
import torch

from sekv_vllm.core.surprisal import TAIL_STRIDE, LogitHead, token_surprisal


def projection(V=5000, hidden=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, hidden, generator=g) / hidden**0.5 * 4
    hidden_states = torch.randn(200, hidden, generator=g) * 2
    targets = torch.randint(0, V, (200,), generator=g)
    # half the targets the likeliest token, as a language model's often are
    logits = hidden_states @ weight.T
    targets[::2] = logits[::2].argmax(dim=-1)
    return weight, hidden_states, targets, logits


def test_the_float32_head_is_the_models_surprisal():
    weight, hidden, targets, logits = projection()
    got = LogitHead(weight).surprisal(hidden, targets)
    assert torch.allclose(got, token_surprisal(logits, targets), atol=1e-4)


def test_the_bfloat16_head_is_within_a_tenth_of_a_nat():
    weight, hidden, targets, logits = projection()
    exact = token_surprisal(logits, targets)
    got = LogitHead(weight.bfloat16()).surprisal(hidden, targets)
    assert got.dtype == torch.float32
    err = (got - exact).abs()
    assert err.max() < 0.15 and err.mean() < 0.05, (err.max(), err.mean())
    # the order of surprising tokens is kept where they differ by more than the rounding
    far = (exact[:, None] - exact[None, :]).abs() > 0.3
    assert ((got[:, None] > got[None, :]) == (exact[:, None] > exact[None, :]))[far].all()


@pytest.mark.parametrize("soft_cap, scale", [(30.0, 1.0), (None, 0.5), (10.0, 2.0)])
def test_a_soft_cap_and_a_scale_are_applied_as_vllms_logits_processor_does(soft_cap, scale):
    weight, hidden, targets, logits = projection(seed=1)
    capped = logits if soft_cap is None else torch.tanh(logits / soft_cap) * soft_cap
    got = LogitHead(weight, soft_cap, scale).surprisal(hidden, targets)
    assert torch.allclose(got, token_surprisal(capped * scale, targets), atol=1e-4)


@pytest.mark.parametrize("dtype, exact_tokens", [(torch.float32, 0), (torch.bfloat16, 0), (torch.bfloat16, 1000)])
def test_a_reused_logit_buffer_gives_the_same_surprisal_bit_for_bit(dtype, exact_tokens):
    weight, hidden, targets, _ = projection(seed=2)
    head = LogitHead(weight.to(dtype), exact_tokens=exact_tokens)
    buffer = head.logit_buffer(128)
    fresh = torch.cat([head.surprisal(hidden[a:a + 128], targets[a:a + 128]) for a in (0, 128)])
    reused = torch.cat([head.surprisal(hidden[a:a + 128], targets[a:a + 128], buffer) for a in (0, 128)])
    assert torch.equal(fresh, reused)  # 200 rows: a full chunk, then 72 rows of the same buffer


def word_projection(V=8000, hidden=64, seed=0):
    """A language model's head in miniature: a frequency prior falling with the token id (a BPE vocabulary's
    earliest merges are its commonest words) plus a context term; the targets drawn from the model's own
    distribution, so some lie past any head of exact ids."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, hidden, generator=g) / hidden**0.5
    weight[:, 0] = -1.2 * torch.log(torch.arange(1, V + 1, dtype=torch.float32))  # Zipf's law
    hidden_states = torch.randn(400, hidden, generator=g) * 1.5
    hidden_states[:, 0] = 1.0
    logits = hidden_states @ weight.T
    targets = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g).squeeze(1)
    return weight, hidden_states, targets, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sampled_tail_stays_near_the_exact_surprisal(dtype):
    weight, hidden, targets, logits = word_projection()
    exact = token_surprisal(logits, targets)
    head = LogitHead(weight.to(dtype), exact_tokens=1000)
    assert head.logit_buffer(7).shape == (7, 1000 + 7000 // TAIL_STRIDE)  # the exact ids, then the tail's sample
    got = head.surprisal(hidden, targets)
    assert got.dtype == torch.float32
    assert (targets >= 1000).sum() > 20  # targets past the exact ids are read exactly
    err = (got - exact).abs()
    assert err.mean() < 0.05 and err.max() < 0.3, (err.mean(), err.max())


def test_a_flat_tail_is_counted_exactly_by_its_sample():
    # every logit equal: each sampled token stands for TAIL_STRIDE of the same value, so the sum is exact
    weight, _, targets, _ = word_projection()
    hidden = torch.zeros(400, weight.shape[1])
    got = LogitHead(weight, exact_tokens=1000).surprisal(hidden, targets)
    assert torch.allclose(got, torch.full_like(got, math.log(weight.shape[0])), atol=1e-4)


def test_a_likely_target_past_the_exact_ids_is_not_left_to_the_sample():
    # the tail's only likely token is the target: its mass counted once, exactly, not TAIL_STRIDE times or never
    weight, hidden, _, logits = word_projection(seed=3)
    sampled_id, unsampled_id = 1000 + 5 * TAIL_STRIDE, 1000 + 5 * TAIL_STRIDE + 3
    for target in (sampled_id, unsampled_id):
        w = weight.clone()
        w[target] = hidden.mean(0) / hidden.mean(0).norm() * 4
        targets = torch.full((400,), target)
        exact = token_surprisal(hidden @ w.T, targets)
        got = LogitHead(w, exact_tokens=1000).surprisal(hidden, targets)
        likely = exact < 0.5  # the target holds over 60% of the mass: counted twice or never, off by > 0.4 nats
        assert likely.sum() > 50
        assert (got - exact)[likely].abs().max() < 0.1 and (got - exact).abs().max() < 0.2, target


def test_a_sampled_head_applies_the_soft_cap_and_scale():
    weight, hidden, targets, logits = word_projection(seed=4)
    exact = token_surprisal(torch.tanh(logits / 5.0) * 5.0 * 2.0, targets)
    got = LogitHead(weight, 5.0, 2.0, exact_tokens=1000).surprisal(hidden, targets)
    err = (got - exact).abs()
    assert err.mean() < 0.05 and err.max() < 0.3, (err.mean(), err.max())


def test_exact_ids_covering_the_vocabulary_give_the_exact_head():
    weight, hidden, targets, _ = word_projection()
    exact = LogitHead(weight).surprisal(hidden, targets)
    assert torch.equal(LogitHead(weight, exact_tokens=weight.shape[0]).surprisal(hidden, targets), exact)
