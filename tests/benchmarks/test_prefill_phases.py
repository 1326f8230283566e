"""The prefill profile's phases from cProfile's raw stats: disjoint, bases derived, the rest what is left."""
import cProfile
import pstats

import pytest

from benchmarks.perf.prefill_phases import REST, cumulative, split_phases


def _entry(ct: float, calls: int = 1) -> tuple:
    return (calls, calls, 0.0, ct, {})


def test_phases_split_a_profiled_prefill():
    stats = {
        ("/x/sekv_vllm/integration/vllm/runner_bridge.py", 269, "_record_surprisal"): _entry(0.5, 3),
        ("/x/sekv_vllm/runtime/request_memory.py", 127, "capture"): _entry(0.25, 90),
        ("/x/sekv_vllm/runtime/span_compression.py", 69, "compress_prompt"): _entry(2.0),
        ("/x/sekv_vllm/runtime/span_budget.py", 92, "plan_layout"): _entry(0.125),
        ("/x/sekv_vllm/core/span_memory.py", 51, "compress_layer"): _entry(1.25, 30),
        ("/x/sekv_vllm/core/span_summary.py", 20, "summarize_spans"): _entry(0.25, 60),
        ("/x/sekv_vllm/core/span_keys.py", 229, "span_keys"): _entry(0.5, 30),
        ("/x/sekv_vllm/ops/small_eigh.py", 40, "small_eigh"): _entry(0.125, 30),
        ("/x/sekv_vllm/runtime/span_compression.py", 49, "_key_features"): _entry(0.125),
        ("/x/sekv_vllm/pool/host_pool.py", 23, "store"): _entry(0.0625, 30),
        ("/x/sekv_vllm/runtime/span_compression.py", 59, "_keep_rows"): _entry(0.0625),
        ("/x/other/capture.py", 1, "capture"): _entry(9.0),  # another module's function of that name
    }
    phases = split_phases(stats, total=10.0)
    assert phases["surprisal"] == 0.5 and phases["row capture"] == 0.25
    assert phases["eigendecompositions"] == 0.125
    assert phases["bases"] == 1.25 - 0.25 - 0.5 - 0.125
    # compress_prompt beyond its named parts (plan, layers, features, pool, rows kept)
    assert phases["compression, other"] == pytest.approx(2.0 - (0.125 + 1.25 + 0.125 + 0.0625 + 0.0625))
    assert phases["placement into pages"] == 0.0
    assert phases[REST] == pytest.approx(10.0 - 0.5 - 0.25 - 2.0)
    assert sum(phases.values()) == pytest.approx(10.0)
    assert cumulative(stats, ("request_memory.py", "capture")) == (0.25, 90)


def test_cumulative_reads_a_real_profile():
    def inner():
        return sum(range(1000))

    def outer():
        return [inner() for _ in range(5)]

    profiler = cProfile.Profile()
    profiler.enable()
    outer()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    seconds, calls = cumulative(stats, ("test_prefill_phases.py", "inner"))
    assert calls == 5 and 0 < seconds <= cumulative(stats, ("test_prefill_phases.py", "outer"))[0]


def test_a_negative_running_count_is_refused_by_name(capsys):
    from benchmarks.perf.prefill_phases import main

    with pytest.raises(SystemExit):
        main(["--running", "-1"])
    assert "--running: at least 0 (got -1)" in capsys.readouterr().err
