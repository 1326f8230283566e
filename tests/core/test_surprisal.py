"""Prompt-token surprisal from a model's output projection (torch only)."""
import pytest
import torch

from sekv_vllm.core.surprisal import LogitHead, token_surprisal


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_reused_logit_buffer_gives_the_same_surprisal_bit_for_bit(dtype):
    weight, hidden, targets, _ = projection(seed=2)
    head = LogitHead(weight.to(dtype))
    buffer = head.logit_buffer(128)
    fresh = torch.cat([head.surprisal(hidden[a:a + 128], targets[a:a + 128]) for a in (0, 128)])
    reused = torch.cat([head.surprisal(hidden[a:a + 128], targets[a:a + 128], buffer) for a in (0, 128)])
    assert torch.equal(fresh, reused)  # 200 rows: a full chunk, then 72 rows of the same buffer
