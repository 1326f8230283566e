"""The suite runner: grid validation, resume, and the `ci` profile end to end."""
import json
import re
import subprocess
import sys

import pytest

from benchmarks.suite.grid import EVAL_SEED_BASE, GridError, job_key, make_grid
from benchmarks.suite.report import table
from benchmarks.suite.run import averages, headline, load_records, paired, pending_jobs, summarize


@pytest.mark.parametrize("overrides, message", [
    ({"tasks": ["needel"]}, "tasks: Value error, unknown task(s) ['needel']; allowed: ["),
    ({"budgets": [0.0, 0.5]}, "budgets: Value error, budgets [0.0] are outside (0, 1]"),
    ({"lengths": [50]}, "lengths: Value error, lengths [50] are outside [128, 32768]"),
    ({"samples": 0}, "samples: Input should be greater than or equal to 1"),
    ({"backends": ["sglang"]}, "backends: Value error, unknown backend(s) ['sglang']; allowed: ['vllm', 'sekv', 'sekv:span_score', 'sekv:router', 'kvpress:snapkv'"),
    ({"backends": ["sekv:span_score@c99"]}, "unknown backend(s) ['sekv:span_score@c99']"),
    ({"backends": ["vllm@c4"]}, "unknown backend(s) ['vllm@c4']"),
    ({"backends": ["sekv@c32b3"]}, "unknown backend(s) ['sekv@c32b3']"),
    ({"backends": ["sekv@c32x"]}, "unknown backend(s) ['sekv@c32x']"),
    ({"via": "grpc"}, "via: Input should be 'offline' or 'server'"),
    ({"concurrency": 0}, "concurrency: Input should be greater than or equal to 1"),
])
def test_bad_grid_is_refused_naming_the_field(overrides, message):
    with pytest.raises(GridError) as err:
        make_grid("ci", **overrides)
    assert message in str(err.value)


def test_sekv_backend_settings():
    grid = make_grid("centroids")
    assert grid.sekv_settings("vllm") is None
    assert grid.sekv_settings("sekv:span_score@c0") == {"zoom_policy": "span_score", "score_centroids": 0}
    assert grid.sekv_settings("sekv:router") == {"zoom_policy": "router"}
    assert grid.sekv_settings("sekv:router@c32b2") == {"zoom_policy": "router", "score_centroids": 32, "score_bits": 2}
    methods = make_grid(backends=["sekv", "sekv:snapkv", "sekv:streaming_llm"],
                        sekv_config={"window": 16, "min_prompt_tokens": 9, "observation_window": 16})
    # an in-engine method keeps its own settings and those every method reads, not SeKV's or another's
    assert methods.sekv_settings("sekv:snapkv") == {"min_prompt_tokens": 9, "observation_window": 16, "method": "snapkv"}
    assert methods.sekv_settings("sekv:streaming_llm") == {"min_prompt_tokens": 9, "method": "streaming_llm"}
    assert methods.sekv_settings("sekv") == {"window": 16, "min_prompt_tokens": 9}
    with pytest.raises(GridError, match=r"sekv_config: Value error, \['observation_windw'\] are settings of no method"):
        make_grid(sekv_config={"observation_windw": 16})
    with pytest.raises(GridError, match=r"unknown backend\(s\) \['sekv:snapkv@c4'\]"):
        make_grid(backends=["sekv:snapkv@c4"])
    # a row-keeping method with its kept rows quantized
    assert make_grid(backends=["sekv:snapkv@kv4"]).sekv_settings("sekv:snapkv@kv4") == {"method": "snapkv", "kv_bits": 4}
    for bad in ("sekv:snapkv@kv3", "sekv@kv8", "vllm@kv8"):
        with pytest.raises(GridError, match=re.escape(f"unknown backend(s) ['{bad}']")):
            make_grid(backends=[bad])


def test_unknown_profile_is_refused():
    with pytest.raises(GridError, match=r"profile: 'fast' is not one of \['centroids', 'ci', 'full', 'kv-quant', 'oracle', 'quick', 'router', 'zoom'\]"):
        make_grid("fast")


def test_jobs_cover_the_grid_with_evaluation_seeds():
    grid = make_grid(tasks=["needle", "vt"], lengths=[1000, 2000], samples=3, budgets=[0.5, 0.25])
    jobs = grid.jobs()
    assert len(jobs) == 2 * 2 * 3 * (1 + 2)  # tasks x lengths x samples x (full KV + 2 budgets)
    peers = make_grid(tasks=["needle"], lengths=[1000], samples=2, budgets=[0.25], backends=["vllm", "kvpress:snapkv"])
    assert [(j["backend"], j["budget"]) for j in peers.jobs()] == [("vllm", 1.0)] * 2 + [("kvpress:snapkv", 0.25)] * 2
    assert len({job_key(j) for j in jobs}) == len(jobs)
    assert min(j["seed"] for j in jobs) >= EVAL_SEED_BASE
    dev = make_grid(tasks=["needle", "vt"], lengths=[1000, 2000], samples=3, budgets=[0.5, 0.25], split="dev").jobs()
    assert len(dev) == len(jobs) and max(j["seed"] for j in dev) < EVAL_SEED_BASE
    with pytest.raises(GridError, match="split"):
        make_grid(split="test")


def test_resume_skips_finished_samples_and_drops_a_cut_line(tmp_path):
    grid = make_grid("ci")
    jobs = grid.jobs()
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({**jobs[0], "score": 1.0}) + "\n" + '{"backend": "sekv", "bud')
    records = load_records(path)
    assert len(records) == 1
    assert pending_jobs(grid, records) == jobs[1:]


@pytest.mark.vllm
def test_ci_profile_end_to_end_and_resume(tmp_path):
    def run():
        return subprocess.run([sys.executable, "-m", "benchmarks.suite.run", "--profile", "ci", "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=900)

    proc = run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    grid = make_grid("ci")
    records = load_records(tmp_path / "records.jsonl")
    assert sorted(map(job_key, records)) == sorted(map(job_key, grid.jobs()))
    summary = json.loads((tmp_path / "summary.json").read_text())
    full = [r for r in summary["rows"] if r["backend"] == "vllm"]
    assert full and all(r["accuracy"] >= 0.5 for r in full)  # full KV finds 1K needles
    sekv = [r for r in records if r["backend"] == "sekv"]
    # budget 0.5 of the prompt's rows, plus the spans' float16 scoring centroids
    assert all(r["fast_tier_fraction"] is not None and r["fast_tier_fraction"] <= 0.7 for r in sekv)

    # Interrupted run: drop one finished sample; the rerun redoes exactly that one.
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    (tmp_path / "records.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert run().returncode == 0
    again = load_records(tmp_path / "records.jsonl")
    assert sorted(map(job_key, again)) == sorted(map(job_key, grid.jobs()))


@pytest.mark.vllm
def test_a_sample_kept_at_full_kv_beside_its_batch_runs_again_alone(tmp_path):
    # A host pool that holds one 1K request's spans (~45 MB) but not two: the second of a batch of two keeps full
    # KV, which measures nothing of the method; it runs again alone and is recorded compressed.
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suite.run", "--backends", "sekv", "--tasks", "needle",
                           "--lengths", "1000", "--samples", "2", "--budgets", "0.5", "--sekv-config",
                           json.dumps({"host_pool_bytes": 64 << 20}), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 of 2 samples kept full KV beside their batch" in proc.stderr
    records = load_records(tmp_path / "records.jsonl")
    assert len(records) == 2
    assert all(r["fast_tier_fraction"] is not None for r in records)
    assert sorted(r["batch_size"] for r in records) == [1, 2]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["kept_full_kv"] for r in summary["rows"]] == [0]


def test_summary_counts_sekv_samples_served_at_full_kv():
    rows = summarize([_record("vllm", 1.0, "needle", 1000, 1.0), _record("sekv", 0.25, "needle", 1000, 1.0, 0, 0.25),
                      _record("sekv", 0.25, "needle", 1000, 0.0, 1, None)])
    assert [(r["backend"], r["kept_full_kv"], r["fast_tier_fraction"]) for r in rows] == [
        ("vllm", 0, 1.0), ("sekv", 1, 0.25)]


def _record(backend, budget, task, length, score, seed=0, fraction=None):
    return {"backend": backend, "budget": budget, "task": task, "length": length, "seed": seed, "score": score,
            "fast_tier_fraction": fraction, "batch_seconds": 2.0, "batch_size": 2}


def test_averages_keep_tasks_beyond_the_model_out_and_compare_to_full_kv():
    records = [
        _record("vllm", 1.0, "needle", 1000, 1.0), _record("vllm", 1.0, "needle", 2000, 0.5),
        _record("vllm", 1.0, "vt", 1000, 0.0), _record("vllm", 1.0, "vt", 2000, 0.1),
        _record("sekv", 0.25, "needle", 1000, 0.5, fraction=0.25), _record("sekv", 0.25, "needle", 2000, 0.25, fraction=0.25),
        _record("sekv", 0.25, "vt", 1000, 1.0, fraction=0.25), _record("sekv", 0.25, "vt", 2000, 1.0, fraction=0.25),
        _record("kvpress:snapkv", 0.25, "needle", 1000, 0.0, fraction=0.27),
    ]
    rows = summarize(records)
    avg = averages(rows)
    assert avg["excluded_tasks"] == ["vt"]  # full KV never reaches the floor on vt
    by = {(a["backend"], a["budget"]): a for a in avg["rows"]}
    assert by[("sekv", 0.25)]["accuracy"] == pytest.approx(0.375)
    assert by[("sekv", 0.25)]["relative_to_full_kv"] == pytest.approx(0.375 / 0.75)
    assert by[("kvpress:snapkv", 0.25)]["relative_to_full_kv"] == 0.0
    text = table({"command": "x", "grid": {"samples": 1}, "model": "m", "seconds_this_run": 1,
                  "rows": rows, "averages": avg}, "s.json")
    assert "| task | tokens | full KV | sekv 0.25 | kvpress:snapkv 0.25 |" in text
    assert "| needle | ~1000 | 1.00 | 0.50 | 0.00 |" in text
    assert "Kept out of the averages" in text and "vt" in text.splitlines()[-1]
    # the targets' figures for the default method, readable from the summary
    head = headline(rows, avg, ["vllm", "sekv", "kvpress:snapkv"], records)
    one_lower = {"samples_lower": 1, "samples_higher": 0, "sign_test_p": 0.5}
    below = [{"task": "needle", "length": 1000, "accuracy": 0.5, "full_kv": 1.0, "ratio": 0.5} | one_lower,
             {"task": "needle", "length": 2000, "accuracy": 0.25, "full_kv": 0.5, "ratio": 0.5} | one_lower]
    assert head == {"method": "sekv", "families": ["needle"], "fast_tier_fraction": {"0.25": 0.25},
                    "ratio_to_full": {"0.25": pytest.approx(0.5)}, "lowest_cell_ratio_to_full": {"0.25": 0.5},
                    "cells_below_target": {"0.25": below},
                    "samples_against_full": {"0.25": {"samples": 2, "samples_lower": 2, "samples_higher": 0,
                                                      "sign_test_p": 0.25, "mean_abs_difference": 0.375}}}


def test_the_lowest_cell_counts_cells_the_model_can_do():
    """A cell where full KV is below the informative floor (the model cannot do it at that length) says nothing
    about compression: it is left out of the lowest cell and of the cells below target."""
    records = [_record("vllm", 1.0, "needle", 1000, 1.0), _record("vllm", 1.0, "needle", 4000, 0.1),
               _record("vllm", 1.0, "passkey", 1000, 0.5),
               _record("sekv", 0.25, "needle", 1000, 0.9, fraction=0.25),
               _record("sekv", 0.25, "needle", 4000, 0.0, fraction=0.25),
               _record("sekv", 0.25, "passkey", 1000, 0.5, fraction=0.25)]
    rows = summarize(records)
    head = headline(rows, averages(rows), ["vllm", "sekv"], records)
    assert head["lowest_cell_ratio_to_full"] == {"0.25": pytest.approx(0.9)}
    assert head["cells_below_target"] == {"0.25": []}
    records[3] = _record("sekv", 0.25, "needle", 1000, 0.8, fraction=0.25)
    rows = summarize(records)
    head = headline(rows, averages(rows), ["vllm", "sekv"], records)
    assert [(c["task"], c["length"]) for c in head["cells_below_target"]["0.25"]] == [("needle", 1000)]


def test_every_sample_is_counted_against_full_kvs_wins_and_losses_both():
    """Over the cells the model can do, a sample above full KV's counts as a difference as one below does."""
    full = [_record("vllm", 1.0, "needle", 1000, [1.0, 0.0, 1.0, 0.5][s], seed=s) for s in range(4)]
    full.append(_record("vllm", 1.0, "vt", 1000, 0.0, seed=0))  # below the floor: not counted
    mine = [_record("sekv", 0.25, "needle", 1000, [1.0, 1.0, 0.0, 0.5][s], seed=s, fraction=0.25) for s in range(4)]
    mine.append(_record("sekv", 0.25, "vt", 1000, 1.0, seed=0, fraction=0.25))
    rows = summarize(full + mine)
    head = headline(rows, averages(rows), ["vllm", "sekv"], full + mine)
    assert head["samples_against_full"] == {"0.25": {"samples": 4, "samples_lower": 1, "samples_higher": 1,
                                                     "sign_test_p": 0.75, "mean_abs_difference": 0.5}}


def test_a_cell_below_target_counts_its_samples_against_full_kvs():
    """Paired by sample: 5 of 6 samples lower and one higher is a sign test's p of 7/64; a cell whose
    samples all tie has p 1."""
    full = [_record("vllm", 1.0, "needle", 1000, 1.0 if s < 5 else 0.0, seed=s) for s in range(6)]
    mine = [_record("sekv", 0.25, "needle", 1000, 0.0 if s < 5 else 1.0, seed=s, fraction=0.25) for s in range(6)]
    assert paired(full + mine, "sekv", 0.25, "needle", 1000) == {"samples_lower": 5, "samples_higher": 1,
                                                               "sign_test_p": pytest.approx(7 / 64)}
    assert paired(full + full, "vllm", 1.0, "needle", 1000) == {"samples_lower": 0, "samples_higher": 0,
                                                              "sign_test_p": 1.0}


@pytest.mark.vllm
def test_ci_profile_through_the_openai_server_with_concurrency(tmp_path):
    # sekv's server alone (full KV's answers are checked offline, above): one server start less
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suite.run", "--profile", "ci", "--backends", "sekv",
                           "--via", "server", "--concurrency", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = load_records(tmp_path / "records.jsonl")
    assert sorted(map(job_key, records)) == sorted(map(job_key, make_grid("ci", backends=["sekv"]).jobs()))
    assert all(r["via"] == "server" and r["batch_size"] == 2 for r in records)
    sekv = [r for r in records if r["backend"] == "sekv"]
    assert len(sekv) == 2 and all(r["output"] for r in sekv)
    # budget 0.5 of the prompt's rows, plus the spans' float16 scoring centroids
    assert all(r["fast_tier_fraction"] is not None and r["fast_tier_fraction"] <= 0.7 for r in sekv)


@pytest.mark.kvpress
def test_kvpress_peer_on_the_same_samples(tmp_path):
    """kvpress in its own venv: nothing pressed finds the needles; a 0.5 press keeps half the KV."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suite.run", "--backends", "kvpress:snapkv",
                           "--tasks", "needle", "--lengths", "1000", "--samples", "2", "--budgets", "1.0", "0.5",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = load_records(tmp_path / "records.jsonl")
    assert len(records) == 4
    full = [r for r in records if r["budget"] == 1.0]
    assert all(r["score"] == 1.0 and r["fast_tier_fraction"] == 1.0 for r in full)
    half = [r for r in records if r["budget"] == 0.5]
    assert all(0.45 < r["fast_tier_fraction"] < 0.6 for r in half)
    ci = make_grid("ci").jobs()
    assert {(r["seed"], r["depth"]) for r in full} == {(j["seed"], j["depth"]) for j in ci if j["backend"] == "vllm"}


def test_compare_puts_runs_side_by_side_against_full_kv(tmp_path):
    from benchmarks.suite.compare import table as compare_table

    def run(name, backend, accs, sekv_config):
        rows = [{"backend": backend, "budget": 0.125 if backend != "vllm" else 1.0, "task": "needle", "length": n,
                 "samples": 2, "accuracy": a, "fast_tier_fraction": 0.2 if backend != "vllm" else 1.0}
                for n, a in zip((1000, 2000), accs)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(
            {"command": f"python -m benchmarks.suite.run --out {name}", "grid": {"sekv_config": sekv_config}, "rows": rows}))
        return tmp_path / name

    full = run("full", "vllm", [1.0, 0.5], {})
    a = run("a", "sekv:router", [0.5, 0.5], {"window": 16})
    b = run("b", "sekv:span_score", [1.0, 0.5], {})
    out = compare_table([a, b], full)
    assert '| needle | ~1000 | 1.00 | 0.50 | 1.00 |' in out
    assert 'a: sekv:router 0.125 {"window": 16}' in out and "b: sekv:span_score 0.125 |" in out
    assert "| **average** | | **0.75** | **0.50** | **0.75** |" in out
    assert "| average / full KV | | 1.00 | 0.67 | 1.00 |" in out
    with pytest.raises(SystemExit, match="no stock vLLM"):
        compare_table([a], b)
