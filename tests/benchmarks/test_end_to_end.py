"""The end-to-end benchmark's figures from its records: percentiles, ratios, its variants' settings, and the chart
of a result file."""
import argparse

import pytest

from benchmarks.perf.end_to_end import main, percentile, ratios, variant
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
              "whole_run": {"128": {"vllm": run(30.0), "sekv": run(20.0), "sampled": run(18.0)}},
              "variants": {"sampled": {"sekv_config": {"budget_ratio": 0.125, "surprisal_exact_tokens": 8192}}}}
    path = plot_end_to_end(result, tmp_path)
    assert path == tmp_path / "end_to_end.png" and path.stat().st_size > 10_000


def test_ratios_are_each_backends_over_stocks_where_both_ran():
    alone = {"1000": {"ttft_s": 2.0, "t2_s": 2.5, "tpot_s": 0.1}, "4000": {"ttft_s": 8.0, "t2_s": 9.0, "tpot_s": 0.1}}
    result = {"alone": {"vllm": {"single": alone},
                        "fast": {"single": {n: {k: v / 2 for k, v in r.items()} for n, r in alone.items()}}},
              "whole_run": {"128": {"vllm": {"output_tok_per_s": 10.0, "wall_s": 400.0},
                                    "fast": {"output_tok_per_s": 12.5, "wall_s": 320.0}},
                            "512": {"vllm": {"output_tok_per_s": 20.0, "wall_s": 800.0}}}}
    got = ratios(result, 4000, "fast")
    assert got == {"ttft_ratio_single": {"1000": 0.5, "4000": 0.5}, "tpot_ratio_single": {"1000": 0.5, "4000": 0.5},
                   "prefill_time_ratio_4k": 0.5, "output_throughput_ratio": {"128": 1.25}, "wall_time_ratio": {"128": 0.8}}
    del result["alone"]["fast"]  # --no-alone: the whole runs' ratios only
    assert ratios(result, 4000, "fast") == {"output_throughput_ratio": {"128": 1.25}, "wall_time_ratio": {"128": 0.8}}


def test_a_variant_is_a_name_and_json_settings():
    assert variant('sampled={"surprisal_exact_tokens": 8192}') == ("sampled", {"surprisal_exact_tokens": 8192})
    for bad, message in (("sampled", "NAME=JSON"), ("sekv={}", "other than vllm and sekv"),
                         ("x={surprisal}", "not JSON")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            variant(bad)


def test_a_step_of_no_tokens_is_refused_naming_the_argument(capsys):
    with pytest.raises(SystemExit):
        main(["--max-num-batched-tokens", "0"])
    assert "--max-num-batched-tokens: must be at least 1, got 0" in capsys.readouterr().err
