"""How SeKV spends a request's fast-tier budget (torch only).

A budget means the same for every method: a share of the request's full-KV bytes that it may hold in
the fast tier. The runtime passes it as rows' worth of those bytes (one row: K and V of every KV head
of one position in one layer, in the KV dtype). Per layer SeKV holds: the rows kept at full resolution
(anchors, short runs, the window); for every span its summary row (K and V), its scoring centroids
(`score_centroids` at `score_bits`) and the zoom policy's span features; and, at each decode step,
the rows of the spans it zooms. The layout (anchors and spans) gets (1 - zoom_share) of the budget,
with anchors demoted until it fits. When it still does not fit, the zoom gives up rows down to
`min_zoom_spans` spans' worth before the spans lose scoring centroids (halved down to none: the
summary key alone): spans ranked by their codes find what a query needs in a few zoomed spans, while
spans ranked by their summaries alone are missed however many are zoomed (suite, 12.5% budgets).
Zoomed spans get what is left. Where that is little (short prompts: at a 12.5% budget of a 1K prompt the
spans' summaries and codes take ~80 of ~130 rows), the window gives the zoom up to half its rows, so that
the zoom holds `min_zoom_spans` whole spans and as many single keys beyond them as the window holds rows:
one whole span and a key or two per KV head answered 62% of full KV's accuracy on the suite's dev split at
1K, one span and ~9 keys 92%.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.core import SpanLayout, scoring_nbytes, segment_prompt


@dataclass(frozen=True)
class SpanCosts:
    """What SeKV's parts cost in one layer of one request.

    row_bytes:     one full-KV row (K and V of every KV head, KV dtype)
    num_kv_heads, head_dim: the model's
    feature_bytes: the zoom policy's features of one span, averaged over layers (0: it keeps none)
    summary_bytes: one span's summary row (K and V of every KV head, in the summaries' dtype); None: row_bytes
    """

    row_bytes: int
    num_kv_heads: int
    head_dim: int
    feature_bytes: float = 0.0
    summary_bytes: int | None = None

    @classmethod
    def of_rows(cls, num_kv_heads: int, head_dim: int, element_size: int, feature_bytes: float,
                summary_element_size: int | None = None) -> "SpanCosts":
        """The costs for rows of `element_size` bytes per element (K and V of every KV head per row) and summary
        rows of `summary_element_size` (None: element_size)."""
        elements = 2 * num_kv_heads * head_dim
        return cls(elements * element_size, num_kv_heads, head_dim, feature_bytes,
                   elements * (summary_element_size or element_size))

    def span_rows(self, centroids: int, config: SeKVConfig, summary_as_row: bool = False) -> float:
        """What one span holds in the fast tier (summary row, centroids at the config's bits and ranges,
        features), in rows' worth of bytes; summary_as_row: its summary priced as a full row whatever its dtype."""
        codes = scoring_nbytes(centroids, config.score_bits, self.num_kv_heads, self.head_dim, config.max_span,
                               config.score_range_spans)
        summary = self.row_bytes if self.summary_bytes is None or summary_as_row else self.summary_bytes
        return (summary + codes + self.feature_bytes) / self.row_bytes

    def short_range_rows(self, centroids: int, config: SeKVConfig) -> float:
        """What a stretch's last group of spans may hold beyond its spans' shares of their quantization range
        (a group of one span holds a whole range), in rows' worth of bytes."""
        if centroids == 0 or config.score_bits == 16:
            return 0.0
        whole = 2 * self.num_kv_heads * self.head_dim * 2
        return whole * (1 - 1 / config.score_range_spans) / self.row_bytes


@dataclass(frozen=True)
class SpanPlan:
    """A request's layout and how its budget is spent.

    zoom_budget: rows of zoomed spans attended per step
    centroids:   scoring centroids kept per span (0: the summary key alone)
    zoom_all:    the budget holds every span at full resolution: all are rebuilt at every step, no
                 scoring codes or features are kept
    span_rows:   what one span holds in the fast tier, in rows' worth of bytes
    layout_span_rows: what a span is priced at where the layout is fitted to its share (its summary as a full row)
    """

    layout: SpanLayout
    zoom_budget: int
    centroids: int
    zoom_all: bool
    span_rows: float
    layout_span_rows: float

    @property
    def fast_rows(self) -> float:
        """Rows' worth of fast-tier bytes the plan holds per layer, zoom rows included."""
        return self.layout.fast_rows(self.span_rows) + self.zoom_budget


def summary_dtype(config: SeKVConfig, kv_dtype: torch.dtype) -> torch.dtype:
    """The spans' summary rows' dtype beside a KV cache of `kv_dtype` (`summary_dtype`: float16 where it is wider)."""
    if config.summary_dtype == "float16" and kv_dtype.itemsize > 2:
        return torch.float16
    return kv_dtype


def centroid_ladder(centroids: int) -> list[int]:
    """The centroid counts tried, most first: `centroids`, halved down to 1, then 0."""
    ladder = [centroids]
    while ladder[-1] > 0:
        ladder.append(ladder[-1] // 2)
    return ladder


def plan_layout(surprisal: torch.Tensor, budget: float, config: SeKVConfig, costs: SpanCosts) -> SpanPlan:
    """The prompt's plan under a budget of `budget` rows' worth of fast-tier bytes per layer.

    surprisal: [T] float. Where even the fewest anchors and no centroids exceed the layout's share,
    the plan is the smallest layout (its `fast_rows` then exceed the budget: the caller says so).
    The window is `config.window` rows unless a narrower one (down to half of it) lets the zoom recall
    single keys (`recall_keys`: every key a scoring centroid) with as many rows beyond `min_zoom_spans` whole
    spans as the window keeps: then the widest such window (by bisection: a narrower window leaves the zoom
    more rows), or the narrowest where none has as many.
    """
    plan = _plan(surprisal, budget, config, costs, config.window)
    if plan.zoom_all or not config.recall_keys or _keys_beyond(plan, config) >= config.window:
        return plan
    narrow = (config.window + 1) // 2
    plans = {narrow: _plan(surprisal, budget, config, costs, narrow)}
    if plans[narrow].zoom_all or _keys_beyond(plans[narrow], config) < 0:
        return plan  # a narrower window does not buy single keys
    lo, hi = narrow, config.window - 1  # the widest window w whose plan has w keys beyond its whole spans
    while lo < hi:
        mid = (lo + hi + 1) // 2
        plans[mid] = _plan(surprisal, budget, config, costs, mid)
        if not plans[mid].zoom_all and _keys_beyond(plans[mid], config) >= mid:
            lo = mid
        else:
            hi = mid - 1
    return plans[lo]


def _keys_beyond(plan: SpanPlan, config: SeKVConfig) -> int:
    """The zoom rows beyond `min_zoom_spans` whole spans that go to single keys; -1 where the plan recalls
    no key (fewer centroids than a span's keys)."""
    if plan.centroids < config.max_span:
        return -1
    return plan.zoom_budget - config.min_zoom_spans * (config.max_span - 1)


def _plan(surprisal: torch.Tensor, budget: float, config: SeKVConfig, costs: SpanCosts, window: int) -> SpanPlan:
    """`plan_layout` with a window of `window` rows."""
    segment = functools.partial(segment_prompt, surprisal, window=window, alpha=config.alpha,
                                l_min=config.l_min, max_span=config.max_span)
    share = budget * (1 - config.zoom_share)
    layout = segment(budget=share)
    left = budget - layout.fast_rows(1.0)
    if layout.num_spans and left >= layout.span_tokens - layout.num_spans:
        return SpanPlan(layout, int(left), 0, True, 1.0, 1.0)
    floor = budget - config.min_zoom_spans * config.max_span  # the most the layout may take from the zoom
    for centroids in centroid_ladder(config.score_centroids):
        span_rows = costs.span_rows(centroids, config)
        # The layout's share is fitted with summaries priced as full rows: what narrower summaries save goes to
        # zoomed rows, not to more anchors (dev split, 2K at 25%: more anchors, more and shorter spans, no gain).
        priced = costs.span_rows(centroids, config, summary_as_row=True)
        # spans are priced a share of their group's quantization range: the last group may be short
        short = costs.short_range_rows(centroids, config)
        layout = segment(budget=share - short, span_rows=priced)
        if layout.fast_rows(priced) <= share - short:
            return _spend(layout, budget - short, centroids, span_rows, priced)
        fewest = segment(budget=0.0, span_rows=span_rows)  # every anchor demoted
        if fewest.fast_rows(span_rows) <= floor - short:
            return _spend(fewest, budget - short, centroids, span_rows, priced)
    return _spend(layout, budget, centroids, span_rows, priced)


def _spend(layout: SpanLayout, budget: float, centroids: int, span_rows: float, priced: float) -> SpanPlan:
    """The plan of `layout`: what its spans and fixed rows leave of `budget` goes to zoomed spans."""
    return SpanPlan(layout, max(int(budget - layout.fast_rows(span_rows)), 0), centroids, False, span_rows, priced)
