"""The whole-run bound's arithmetic: steps split from a timeline, the model's step time between measured batches,
the fewest steps a schedule needs, and the split of a run against the bound; the chart of a result."""
import pytest

from benchmarks.perf.plot import plot_whole_run_bound
from benchmarks.perf.whole_run_bound import bound, floor_at, main, min_steps, split_steps, step_times


def test_steps_are_differences_of_the_timeline_with_the_larger_running_count():
    steps = step_times([[0.5, 1], [0.7, 2], [1.0, 0]])
    assert [n for _, n in steps] == [1, 2, 2]
    assert [s for s, _ in steps] == pytest.approx([0.5, 0.2, 0.3])


def test_long_steps_are_prefill_steps():
    timeline = [[6.0, 1], [6.1, 1], [6.2, 1], [12.2, 2], [12.3, 2], [12.4, 1], [12.5, 0]]
    prefill, decode = split_steps(timeline)
    assert [s for s, _ in prefill] == pytest.approx([6.0, 6.0])
    assert len(decode) == 5


def test_the_model_step_is_linear_between_measured_batches_and_flat_beyond():
    floors = {1: 0.05, 5: 0.05, 16: 0.08, 32: 0.12}
    assert floor_at(floors, 1) == 0.05 and floor_at(floors, 3) == 0.05
    assert floor_at(floors, 24) == pytest.approx(0.10)
    assert floor_at(floors, 64) == 0.12


@pytest.mark.parametrize("requests, concurrency, tokens, expected", [
    (1, 1, 5, 5),      # one request: a step per token
    (4, 4, 5, 8),      # admitted one per step: the last starts at step 4
    (4, 2, 5, 11),     # two waves: the third starts once the first is done (step 6), the fourth at step 7
])
def test_fewest_steps_of_a_schedule(requests, concurrency, tokens, expected):
    assert min_steps(requests, concurrency, tokens) == expected


def timeline(steps: list[tuple[float, int]]) -> list[list[float]]:
    """[[seconds since start, running], ...] of steps (seconds, running after it)."""
    out, t = [], 0.0
    for seconds, running in steps:
        t += seconds
        out.append([t, running])
    return out


def test_a_run_splits_into_stock_prefill_sekv_extra_floor_and_attention():
    stock = {"wall_s": 40.0, "timeline": timeline([(10.0, 1), (10.0, 2)] + [(0.5, 2)] * 40)}
    # sekv: prefill steps 11 s each (1 s beyond stock's), decode-only steps 0.3 s with 2 running
    sekv = {"wall_s": 25.0, "timeline": timeline([(11.0, 1), (11.0, 2)] + [(0.3, 2)] * 10), "requests": 2,
            "max_concurrent": 2, "output_tokens": 24}
    got = bound(stock, sekv, {1: 0.1, 2: 0.1})
    assert got["stock_prefill_s"] == 20.0 and got["sekv_prefill_extra_s"] == 2.0
    assert got["sekv_decode_steps"] == 10 and got["decode_floor_s"] == 1.0 and got["decode_attention_s"] == 2.0
    assert got["bound_attention_free_s"] == 23.0 and got["bound_model_only_s"] == 21.0
    assert got["throughput_ceiling_attention_free"] == pytest.approx(40 / 23, abs=1e-3)
    assert got["target_2x_wall_s"] == 20.0 and got["min_steps"] == 13
    assert got["bound_all_at_once_attention_free_s"] == pytest.approx(22.0 + 11 * 0.1)  # 13 steps, 2 of them prefill


def test_the_chart_draws_every_output_length(tmp_path):
    one = {"stock_wall_s": 40.0, "sekv_wall_s": 25.0, "target_2x_wall_s": 20.0, "stock_prefill_s": 20.0,
           "sekv_prefill_extra_s": 2.0, "decode_floor_s": 1.0, "decode_attention_s": 2.0,
           "throughput_ceiling_attention_free": 1.74, "throughput_ceiling_model_only": 1.9}
    result = {"model": "m", "command": "python -m benchmarks.perf.whole_run_bound", "runs": "r.json",
              "outputs": {"128": one, "512": one}}
    path = plot_whole_run_bound(result, tmp_path / "whole_run_bound_cpu.json")
    assert path == tmp_path / "whole_run_bound.png" and path.stat().st_size > 10_000


def test_bad_arguments_name_themselves(capsys):
    with pytest.raises(SystemExit):
        main(["--batches", "0", "4"])
    assert "--batches" in capsys.readouterr().err
