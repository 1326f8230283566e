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
    region: torch.Tensor, theta: float, l_min: int, max_span: int, first_anchor: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split positions [0, len(region)) at anchors (region > theta, plus position 0 if first_anchor).

    region: [n] float. Returns (fixed_pos, span_start, span_len) as int64 tensors on region's device.
    """
    n, dev = region.shape[0], region.device
    is_anchor = region > theta
    if first_anchor:
        is_anchor[0] = True
    anchors = torch.nonzero(is_anchor).squeeze(1)
    # Runs of non-anchors: from the region start or an anchor + 1 to the next anchor (or the end).
    run_start = torch.cat([anchors.new_zeros(1), anchors + 1])
    run_len = torch.cat([anchors, anchors.new_full((1,), n)]) - run_start
    short = (run_len > 0) & (run_len < l_min)
    # a non-anchor position's run is the number of anchors before it
    run_of = torch.cumsum(is_anchor, 0)
    fixed_pos = torch.nonzero(is_anchor | short[run_of]).squeeze(1)

    long_ = run_len >= l_min
    start, length = run_start[long_], run_len[long_]
    # Near-equal pieces: each is >= max_span // 2 >= l_min (config guarantees it).
    pieces = -(-length // max_span)
    run = torch.repeat_interleave(torch.arange(pieces.numel(), device=dev), pieces)
    j = torch.arange(run.numel(), device=dev) - torch.repeat_interleave(torch.cumsum(pieces, 0) - pieces, pieces)
    lo = start[run] + (j * length[run]) // pieces[run]
    hi = start[run] + ((j + 1) * length[run]) // pieces[run]
    return fixed_pos, lo, hi - lo


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

    region = surprisal[:window_start].double()
    if theta is None:
        theta = surprisal_threshold(surprisal, alpha)

    def layout_at(th: float) -> SpanLayout:
        return SpanLayout(*_split(region, th, l_min, max_span, first_anchor), window_start, T)

    layout = layout_at(theta)
    if budget is None or layout.fast_rows(span_rows) <= budget:
        return layout

    # The cost barely ever grows when theta rises (a demoted anchor merges its two neighbouring
    # runs), so a binary search over the candidate thresholds finds the lowest that fits.
    candidates = torch.unique(region[region > theta]).tolist()  # ascending
    if not candidates:
        return layout
    lo, hi = 0, len(candidates) - 1
    best = layout_at(candidates[hi])
    if best.fast_rows(span_rows) > budget:
        return best
    while lo < hi:
        mid = (lo + hi) // 2
        trial = layout_at(candidates[mid])
        if trial.fast_rows(span_rows) <= budget:
            hi, best = mid, trial
        else:
            lo = mid + 1
    return best
