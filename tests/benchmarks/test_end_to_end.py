"""The end-to-end benchmark's figures from its records: percentiles, and the chart of a result file."""
import pytest

from benchmarks.perf.end_to_end import percentile
from benchmarks.perf.plot import plot_end_to_end


def test_percentiles_interpolate_between_samples():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.9) == pytest.approx(4.6)
    assert percentile([7.0], 0.9) == 7.0


def test_the_chart_draws_every_whole_run(tmp_path):
    def run(wall: float) -> dict:
        return {"wall_s": wall, "output_tok_per_s": 128 * 4 / wall, "ttft_s": {"p50": 3.0, "p90": 5.0},
                "tpot_s": {"p50": 0.2, "p90": 0.3}, "timeline": [[1.0, 1], [2.0, 4], [wall, 0]]}

    result = {"model": "m", "command": "python -m benchmarks.perf.end_to_end", "kv_cache_space_gib": 1, "requests": 4,
              "length": 4000, "budget_ratio": 0.125, "output_throughput_ratio": {"128": 1.5},
              "whole_run": {"128": {"vllm": run(30.0), "sekv": run(20.0)}}}
    path = plot_end_to_end(result, tmp_path)
    assert path == tmp_path / "end_to_end.png" and path.stat().st_size > 10_000
