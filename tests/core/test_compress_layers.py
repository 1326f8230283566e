"""Layers compressed together (stacked along the KV-head axis) against each layer compressed alone."""
import dataclasses

import pytest
import torch

import sekv_vllm.core.span_memory as span_memory
from sekv_vllm.core import compress_layer, compress_layers, segment_prompt
from sekv_vllm.core.low_rank import SpanBases
from sekv_vllm.core.span_keys import CentroidCodes, SpanKeys

LAYERS, HKV, D = 5, 3, 64


def assert_same(a, b, path="memory"):
    """Field by field: tensors equal within float32 rounding (integer ones exactly), the rest equal."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        assert a.is_contiguous(), f"{path} is a view of the stack"
        if a.is_floating_point():
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5, msg=path)
        else:
            assert torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, path


def gates_of(layer: int, singular: torch.Tensor, summary_k: torch.Tensor) -> torch.Tensor:
    """A different function of the spectrum and summary per layer, as the router's per-layer MLPs."""
    rel = singular / singular[..., :1].clamp(min=1e-12)
    return torch.sigmoid((layer + 1) * rel - 0.3 + summary_k.mean(-1, keepdim=True))


@pytest.mark.parametrize("centroids,bits,store_rows,gated", [
    (32, 2, None, True),    # the defaults: every key a 2-bit code, rows kept, router gates
    (4, 16, None, False),   # k-means centroids in float16
    (8, 4, False, True),    # factors, gated
    (0, 16, True, False),   # summaries only
])
@pytest.mark.parametrize("stack_bytes", [1, 1 << 30])  # one layer at a time / every layer at once
def test_stacked_layers_equal_each_layer_alone(monkeypatch, centroids, bits, store_rows, gated, stack_bytes):
    monkeypatch.setattr(span_memory, "_STACK_BYTES", stack_bytes)
    g = torch.Generator().manual_seed(0)
    T = 600
    ks = [torch.randn(T, HKV, D, generator=g) + 2 * torch.randn(1, HKV, D, generator=g) for _ in range(LAYERS)]
    vs = [torch.randn(T, HKV, D, generator=g) for _ in range(LAYERS)]
    s = torch.rand(T, generator=g) * 4
    s[torch.rand(T, generator=g) < 0.1] += 6
    layout = segment_prompt(s, window=16, alpha=1.0, l_min=4, max_span=32)
    r_max = 16 if store_rows is False else 32
    args = dict(r_max=r_max, score_centroids=centroids, score_bits=bits, store_rows=store_rows)
    stacked = compress_layers(ks, vs, layout, s, key_gates=gates_of if gated else None, **args)
    assert len(stacked) == LAYERS
    for i in range(LAYERS):
        alone = compress_layer(ks[i], vs[i], layout, s, key_gates=(lambda sv, sk, i=i: gates_of(i, sv, sk))
                               if gated else None, **args)
        assert_same(stacked[i], alone, f"layer {i}")


def test_heads_split_every_part():
    S, C = 4, 8
    codes = CentroidCodes(torch.arange(S * 6 * 16 * C, dtype=torch.uint8).reshape(S, 6, 16, C),
                          torch.randn(2, 6, D).half(), torch.rand(2, 6, D).half(), torch.tensor([0, 0, 1, 1]), 2)
    keys = SpanKeys(torch.randn(S, 6, D), torch.tensor([3, 5, 2, 4]), None, None, codes)
    part = keys.heads(2, 4)
    assert torch.equal(part.codes.codes, codes.codes[:, 2:4]) and torch.equal(part.codes.lo, codes.lo[:, 2:4])
    assert torch.equal(part.summary_k, keys.summary_k[:, 2:4]) and part.codes.range_of is codes.range_of
    bases = SpanBases(torch.randn(14, 6, 5), torch.randn(S, 6, 5, D), torch.tensor([0, 3, 8, 10]), keys.span_len)
    half = bases.heads(3, 6)
    assert torch.equal(half.basis, bases.basis[:, 3:]) and torch.equal(half.coef, bases.coef[:, 3:])
