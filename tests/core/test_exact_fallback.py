"""The rows a step reads: their share of each query head's estimated attention, against a softmax."""
import torch

from sekv_vllm.policies.exact_fallback import segment_read_coverage


def test_read_coverage_is_the_softmax_mass_on_rows_read_least_over_a_groups_heads():
    g = torch.Generator().manual_seed(3)
    S, H, Hkv, C = 7, 6, 2, 5
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    key_logits = torch.randn(S, H, C, generator=g) * 3
    key_logits[2, :, 3:] = float("-inf")  # a short span: no keys there
    read = torch.rand(S, Hkv, C, generator=g) < 0.3
    full = [torch.randn(H, 4, generator=g) * 3, torch.randn(H, 9, generator=g) * 3]  # each request's full rows
    full_lse = torch.stack([f.logsumexp(dim=1) for f in full])
    got = segment_read_coverage(key_logits, seg, read, full_lse, Hkv)
    for b in range(2):
        mine = seg == b
        for kh in range(Hkv):
            shares = []
            for h in range(kh * 3, kh * 3 + 3):
                logits = torch.cat([full[b][h], key_logits[mine, h].flatten()])
                is_read = torch.cat([torch.ones(full[b].shape[1], dtype=torch.bool), read[mine, kh].flatten()])
                shares.append(torch.softmax(logits, dim=0)[is_read].sum())
            assert torch.allclose(got[b, kh], min(shares), atol=1e-5)
    # everything read: coverage 1; nothing but full rows read and keys far above them: near 0
    assert torch.allclose(segment_read_coverage(key_logits, seg, torch.ones_like(read), full_lse, Hkv), torch.ones(2, Hkv))
    low = segment_read_coverage(key_logits + 50, seg, torch.zeros_like(read), full_lse, Hkv)
    assert bool((low < 1e-6).all())
