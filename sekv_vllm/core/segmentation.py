"""Surprisal-guided segmentation of a prompt into anchors, short runs, spans and a window.

A token whose surprisal s_t = -log p(x_t | x_<t) exceeds theta = mean(s) + alpha * std(s)
is an *anchor* and stays at full resolution. The runs between anchors are *spans*; a run
shorter than `l_min` stays at full resolution too, a run longer than `max_span` is split
into near-equal pieces. The last `window` prompt tokens are never segmented.

Token 0 of a prompt is always an anchor: it is the attention sink of decoder LLMs, and the method doc
makes it the anchor of last resort anyway.

When a budget is given and anchors + short runs + window + what each span holds in the fast tier
(`span_rows`: its summary row and scoring codes, in rows' worth of bytes) exceed it, theta is raised (the lowest-surprisal anchors are demoted first, merging their
neighbouring runs) until the layout fits or no anchor but token 0 is left.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SpanLayout:
    """Where every prompt token of one request lives.

    fixed_pos:    [N] int64  positions kept at full resolution before the window
                             (anchors and short runs), ascending
    span_start:   [S] int64  first position of each span, ascending
    span_len:     [S] int64  tokens in each span (>= l_min)
    window_start: int        first position of the recent window; [window_start, T) stays full
    prompt_len:   int        T
    """

    fixed_pos: torch.Tensor
    span_start: torch.Tensor
    span_len: torch.Tensor
    window_start: int
    prompt_len: int

    @property
    def num_spans(self) -> int:
        return int(self.span_start.numel())

    @property
    def num_fixed(self) -> int:
        """Full-resolution prompt rows: anchors, short runs and the window."""
        return int(self.fixed_pos.numel()) + self.prompt_len - self.window_start

    @property
    def base_rows(self) -> int:
        """Rows attended per decode step with no span zoomed (one summary row per span)."""
        return self.num_fixed + self.num_spans

    def fast_rows(self, span_rows: float) -> float:
        """Fast-tier rows' worth of bytes with no span zoomed, a span holding `span_rows`."""
        return self.num_fixed + span_rows * self.num_spans

    @property
    def span_tokens(self) -> int:
        return int(self.span_len.sum())


def surprisal_threshold(surprisal: torch.Tensor, alpha: float) -> float:
    """theta = mean(s) + alpha * std(s) over the whole prompt (population std)."""
    s = surprisal.double()
    return float(s.mean() + alpha * s.std(correction=0)) if s.numel() > 1 else float("inf")


def _split(
    region: np.ndarray, theta: float, l_min: int, max_span: int, first_anchor: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split positions [0, len(region)) at anchors (region > theta, plus position 0 if first_anchor).

    Returns (fixed_pos, span_start, span_len) as int64 arrays.
    """
    n = region.shape[0]
    is_anchor = region > theta
    is_anchor[0] |= first_anchor
    anchors = np.flatnonzero(is_anchor)
    # Runs of non-anchors: from the region start or an anchor + 1 to the next anchor (or the end).
    run_start = np.append(0, anchors + 1)
    run_end = np.append(anchors, n)
    run_len = run_end - run_start
    short = (run_len > 0) & (run_len < l_min)
    long_ = run_len >= l_min

    fixed = [anchors]
    for a, b in zip(run_start[short], run_end[short]):
        fixed.append(np.arange(a, b))
    fixed_pos = np.sort(np.concatenate(fixed)).astype(np.int64)

    starts, lens = [], []
    for a, ln in zip(run_start[long_], run_len[long_]):
        pieces = -(-ln // max_span)
        # Near-equal pieces: each is >= max_span // 2 >= l_min (config guarantees it).
        bounds = a + (np.arange(pieces + 1) * ln) // pieces
        starts.append(bounds[:-1])
        lens.append(np.diff(bounds))
    if starts:
        span_start = np.concatenate(starts).astype(np.int64)
        span_len = np.concatenate(lens).astype(np.int64)
    else:
        span_start = np.zeros(0, np.int64)
        span_len = np.zeros(0, np.int64)
    return fixed_pos, span_start, span_len


def segment_prompt(
    surprisal: torch.Tensor,
    *,
    window: int,
    alpha: float,
    l_min: int,
    max_span: int,
    budget: float | None = None,
    span_rows: float = 1.0,
    first_anchor: bool = True,
    theta: float | None = None,
) -> SpanLayout:
    """Segment one prompt (or a stretch of generated text: window 0, first_anchor False, since
    its first token is no attention sink, and the prompt's theta).

    surprisal: [T] float  per-token surprisal, s_0 = 0
    budget:    rows' worth of fast-tier bytes the layout may hold (None: no budget fitting)
    span_rows: what one span holds in the fast tier, in rows' worth of bytes (its summary row: 1)
    theta:     the anchor threshold (None: mean(s) + alpha * std(s) of this surprisal)
    """
    (T,) = surprisal.shape
    window_start = max(T - window, 0)
    if window_start == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=surprisal.device)
        return SpanLayout(empty, empty, empty.clone(), 0, T)

    region = surprisal[:window_start].double().cpu().numpy()
    if theta is None:
        theta = surprisal_threshold(surprisal, alpha)

    def layout_at(th: float) -> SpanLayout:
        fixed_pos, span_start, span_len = _split(region.copy(), th, l_min, max_span, first_anchor)
        return SpanLayout(
            torch.from_numpy(fixed_pos),
            torch.from_numpy(span_start),
            torch.from_numpy(span_len),
            window_start,
            T,
        )

    layout = layout_at(theta)
    if budget is None or layout.fast_rows(span_rows) <= budget:
        return layout

    # The cost barely ever grows when theta rises (a demoted anchor merges its two neighbouring
    # runs), so a binary search over the candidate thresholds finds the lowest that fits.
    candidates = np.unique(region[region > theta])
    if candidates.size == 0:
        return layout
    lo, hi = 0, candidates.shape[0] - 1
    best = layout_at(float(candidates[hi]))
    if best.fast_rows(span_rows) > budget:
        return best
    while lo < hi:
        mid = (lo + hi) // 2
        trial = layout_at(float(candidates[mid]))
        if trial.fast_rows(span_rows) <= budget:
            hi, best = mid, trial
        else:
            lo = mid + 1
    return best
