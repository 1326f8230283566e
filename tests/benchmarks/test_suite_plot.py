"""The suite's accuracy plot: any run's folder, one panel per task."""
import json
import subprocess
import sys


def _summary(backends_budgets):
    rows = []
    for task in ("needle", "cwe"):
        for backend, budget, frac, acc in backends_budgets:
            rows.append({"backend": backend, "budget": budget, "task": task, "length": 1000, "samples": 2,
                         "accuracy": acc, "fast_tier_fraction": frac, "mean_seconds": 1.0})
    return {"rows": rows, "model": "m", "command": "python -m benchmarks.suite.run --lengths 1000"}


def test_plot_writes_the_png_of_the_run_folder_given(tmp_path):
    run = tmp_path / "suite-some-run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(_summary([("vllm", 1.0, 1.0, 0.9), ("sekv:router", 0.25, 0.25, 0.8),
                                                            ("sekv:router", 0.125, 0.125, 0.6)])))
    out = subprocess.run([sys.executable, "-m", "benchmarks.suite.plot", "--run", str(run)], capture_output=True,
                         text=True, check=True)
    png = run / "accuracy.png"
    assert f"wrote {png}" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_folder_without_a_summary_fails(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.suite.plot", "--run", str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 2
    assert f"--run: {tmp_path} has no summary.json" in out.stderr


def test_a_long_command_is_wrapped_into_the_title_whole():
    from benchmarks.suite.plot import title_lines

    command = ("python -m benchmarks.suite.run --profile zoom --tasks vt niah_multivalue --lengths 2000 4000 8000 "
               "--budgets 0.125 --samples 18 --out benchmarks/results/suite-zoom-floor-18")
    lines = title_lines({"model": "SmolLM2-135M-Instruct", "command": command}, chars=60)
    assert len(lines) > 1 and all(len(line) <= 60 for line in lines)
    assert " ".join(lines) == f"SmolLM2-135M-Instruct: {command}"
