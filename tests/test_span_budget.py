"""SeKV's budget plan (runtime/span_budget.py): where a tight budget's bytes go."""
import pytest
import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.runtime import SpanCosts, plan_layout

COSTS = SpanCosts.of_rows(3, 64, 4, 18.0)  # the default model's float32 rows, the router's span scales
SERVED = SpanCosts.of_rows(3, 64, 4, 18.0, 2)  # ... with float16 summaries (`summary_dtype`)


def _surprisal(T: int) -> torch.Tensor:
    return torch.rand(T, generator=torch.Generator().manual_seed(T)) ** 3 * 10


@pytest.mark.parametrize("T", [1000, 2000, 4000, 8000])
@pytest.mark.parametrize("ratio", [0.25, 0.125, 0.0625])
@pytest.mark.parametrize("costs", [COSTS, SERVED], ids=["float32 summaries", "float16 summaries"])
def test_a_plan_stays_within_its_budget_and_spends_it(T, ratio, costs):
    config = SeKVConfig()
    budget = ratio * T
    plan = plan_layout(_surprisal(T), budget, config, costs)
    short = costs.short_range_rows(plan.centroids, config)
    assert plan.fast_rows + short <= budget
    assert plan.fast_rows > budget - plan.layout.span_tokens / max(plan.layout.num_spans, 1) - 1 - short


def test_a_tight_budget_takes_rows_from_the_zoom_before_the_scoring_codes():
    config = SeKVConfig()
    T = 4000
    ample = plan_layout(_surprisal(T), 0.25 * T, config, COSTS)
    tight = plan_layout(_surprisal(T), 0.125 * T, config, COSTS)
    # at 25% the layout fits (1 - zoom_share) of the budget with every key's codes
    assert ample.centroids == 32 and ample.zoom_budget >= 0.5 * 0.25 * T - 1
    # at 12.5% every key's codes still: the zoom keeps less than its share, at least min_zoom_spans spans
    assert tight.centroids == 32
    assert config.min_zoom_spans * config.max_span <= tight.zoom_budget < 0.5 * 0.125 * T
    # where every key's codes leave less than one span to zoom, the spans keep fewer centroids instead
    tighter = plan_layout(_surprisal(T), 0.0625 * T, config, COSTS)
    assert tighter.centroids < 32 and tighter.zoom_budget >= config.max_span
    # a floor of more spans than the codes leave: centroids are cut rather than the zoom
    greedy = plan_layout(_surprisal(T), 0.125 * T, SeKVConfig(min_zoom_spans=8), COSTS)
    assert greedy.centroids < 32 and greedy.zoom_budget >= 0.5 * 0.125 * T - 1


def test_a_short_prompt_window_gives_the_zoom_rows_for_single_keys():
    config = SeKVConfig()
    T = 1000
    plan = plan_layout(_surprisal(T), 0.125 * T, config, COSTS)
    whole = plan_layout(_surprisal(T), 0.125 * T, SeKVConfig(recall_keys=False), COSTS)  # the window never narrows
    window = T - plan.layout.window_start
    assert config.window // 2 <= window < config.window and T - whole.layout.window_start == config.window
    # with the whole window the codes of every key did not fit beside one zoomed span; narrower, they do, and
    # the zoom has rows beyond that span for single keys
    assert whole.centroids < config.max_span <= plan.centroids
    assert plan.zoom_budget - (config.max_span - 1) > 0
    # from 2K tokens the zoom has the rows: the window is whole
    assert T * 2 - plan_layout(_surprisal(2 * T), 0.125 * 2 * T, config, COSTS).layout.window_start == config.window


@pytest.mark.parametrize("T", [2000, 4000, 8000])
@pytest.mark.parametrize("ratio", [0.25, 0.125])
def test_float16_summaries_keep_the_layout_and_give_the_zoom_half_a_row_per_span(T, ratio):
    config = SeKVConfig()
    wide, half = (plan_layout(_surprisal(T), ratio * T, config, c) for c in (COSTS, SERVED))
    assert wide.span_rows - half.span_rows == pytest.approx(0.5)
    # the same anchors and spans (the layout's share prices summaries as full rows): the bytes saved are zoom rows
    assert torch.equal(half.layout.span_start, wide.layout.span_start)
    assert torch.equal(half.layout.fixed_pos, wide.layout.fixed_pos)
    assert half.centroids == wide.centroids == config.max_span
    assert half.zoom_budget - wide.zoom_budget >= 0.5 * wide.layout.num_spans - 1
