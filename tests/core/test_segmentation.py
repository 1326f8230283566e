"""Segmentation (torch, on the surprisal's device) against a position-by-position reference."""
import pytest
import torch

from sekv_vllm.core import segment_prompt, surprisal_threshold


def reference(s: list[float], theta: float, l_min: int, max_span: int, first_anchor: bool):
    """Walk the positions: anchors and runs shorter than l_min are fixed, longer runs are cut into
    ceil(len / max_span) near-equal spans."""
    fixed, spans, run = [], [], []

    def close():
        if 0 < len(run) < l_min:
            fixed.extend(run)
        elif run:
            pieces = -(-len(run) // max_span)
            for j in range(pieces):
                a, b = run[0] + j * len(run) // pieces, run[0] + (j + 1) * len(run) // pieces
                spans.append((a, b - a))
        run.clear()

    for p, x in enumerate(s):
        if x > theta or (p == 0 and first_anchor):
            close()
            fixed.append(p)
        else:
            run.append(p)
    close()
    return sorted(fixed), spans


@pytest.mark.parametrize("seed", range(12))
def test_segmentation_equals_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(20, 600, (1,), generator=g))
    window, l_min = int(torch.randint(0, 40, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    max_span = 2 * l_min + int(torch.randint(0, 40, (1,), generator=g))
    s = torch.rand(T, generator=g) ** 3 * 6
    first = seed % 2 == 0
    layout = segment_prompt(s, window=window, alpha=0.5, l_min=l_min, max_span=max_span, first_anchor=first)
    start = max(T - window, 0)
    if start == 0:
        assert layout.num_spans == 0 and layout.fixed_pos.numel() == 0
        return
    fixed, spans = reference(s[:start].double().tolist(), surprisal_threshold(s, 0.5), l_min, max_span, first)
    assert layout.fixed_pos.tolist() == fixed
    assert list(zip(layout.span_start.tolist(), layout.span_len.tolist())) == spans
    assert layout.window_start == start and layout.num_fixed + layout.span_tokens == T


@pytest.mark.parametrize("span_rows", [1.0, 2.7])
def test_a_budget_demotes_anchors_until_the_layout_fits(span_rows):
    g = torch.Generator().manual_seed(7)
    s = torch.rand(2000, generator=g) * 5
    free = segment_prompt(s, window=16, alpha=0.5, l_min=4, max_span=32)
    for budget in (600, 300, 200):
        layout = segment_prompt(s, window=16, alpha=0.5, l_min=4, max_span=32, budget=budget, span_rows=span_rows)
        assert layout.fast_rows(span_rows) <= budget < free.fast_rows(span_rows)
        assert set(layout.fixed_pos.tolist()) < set(free.fixed_pos.tolist())  # only demotions
