"""The suite runner: grid validation, resume, and the `ci` profile end to end."""
import json
import subprocess
import sys

import pytest

from benchmarks.suite.grid import EVAL_SEED_BASE, GridError, job_key, make_grid
from benchmarks.suite.run import load_records, pending_jobs


@pytest.mark.parametrize("overrides, message", [
    ({"tasks": ["needel"]}, "tasks: Value error, unknown task(s) ['needel']; allowed: ["),
    ({"budgets": [0.0, 0.5]}, "budgets: Value error, budgets [0.0] are outside (0, 1]"),
    ({"lengths": [50]}, "lengths: Value error, lengths [50] are outside [128, 32768]"),
    ({"samples": 0}, "samples: Input should be greater than or equal to 1"),
    ({"backends": ["sglang"]}, "backends.0: Input should be 'vllm' or 'sekv'"),
])
def test_bad_grid_is_refused_naming_the_field(overrides, message):
    with pytest.raises(GridError) as err:
        make_grid("ci", **overrides)
    assert message in str(err.value)


def test_unknown_profile_is_refused():
    with pytest.raises(GridError, match=r"profile: 'fast' is not one of \['ci', 'full', 'quick'\]"):
        make_grid("fast")


def test_jobs_cover_the_grid_with_evaluation_seeds():
    grid = make_grid(tasks=["needle", "vt"], lengths=[1000, 2000], samples=3, budgets=[0.5, 0.25])
    jobs = grid.jobs()
    assert len(jobs) == 2 * 2 * 3 * (1 + 2)  # tasks x lengths x samples x (full KV + 2 budgets)
    assert len({job_key(j) for j in jobs}) == len(jobs)
    assert min(j["seed"] for j in jobs) >= EVAL_SEED_BASE


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
    assert all(r["fast_tier_fraction"] is not None and r["fast_tier_fraction"] <= 0.55 for r in sekv)

    # Interrupted run: drop one finished sample; the rerun redoes exactly that one.
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    (tmp_path / "records.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert run().returncode == 0
    again = load_records(tmp_path / "records.jsonl")
    assert sorted(map(job_key, again)) == sorted(map(job_key, grid.jobs()))
