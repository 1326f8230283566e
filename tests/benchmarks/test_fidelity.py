"""Teacher-forced fidelity (benchmarks.suite.fidelity): its figures, and the plugin forced to full KV's answer."""
import json
import subprocess
import sys

import pytest

from benchmarks.suite.fidelity import answer_steps, step_metrics, summarize


def test_answer_steps_are_the_tokens_overlapping_an_answer_anywhere():
    pieces = ["The", " var", "s", " are", ":", " X", "Y", "Z", "KV", " and", " ab", "c", " xyz", "kv"]
    # "xyzkv" twice (case-insensitive, across token boundaries), "abc" once, "zz" nowhere
    assert answer_steps(pieces, ("xyzkv", "ABC", "zz")) == [5, 6, 7, 8, 10, 11, 12, 13]
    assert answer_steps(pieces, ("nothing",)) == []


def test_step_metrics_against_hand_counts():
    m = step_metrics(ranks=[1, 2, 1, 3], logprobs=[-0.1, -2.0, -0.2, -1.0], ref_logprobs=[-0.1, -0.5, -0.2, -0.4],
                     scored=[1, 2])
    assert m["agreement"] == 0.5 and m["first_miss"] == 1 and m["miss_steps"] == [1, 3]
    assert m["nll"] == pytest.approx(3.3 / 4) and m["nll_gap"] == pytest.approx((1.5 + 0.6) / 4)
    assert m["answer_steps"] == 2 and m["answer_agreement"] == 0.5 and m["answer_nll_gap"] == pytest.approx(0.75)
    none = step_metrics(ranks=[1, 1], logprobs=[-0.1, -0.1], ref_logprobs=[-0.1, -0.1], scored=[])
    assert none["first_miss"] == 2 and none["answer_agreement"] is None


def test_summary_means_answer_figures_over_samples_that_have_them():
    base = {"backend": "sekv:router", "budget": 0.125, "task": "vt", "length": 2000, "first_miss": 3, "nll": 0.3,
            "nll_gap": 0.1, "steps": 40}
    rows = summarize([{**base, "agreement": 1.0, "answer_agreement": 0.5, "answer_nll_gap": 0.2},
                      {**base, "agreement": 0.5, "answer_agreement": None, "answer_nll_gap": None}])
    assert len(rows) == 1
    assert rows[0]["agreement"] == 0.75 and rows[0]["answer_agreement"] == 0.5 and rows[0]["answer_samples"] == 1


@pytest.mark.vllm
def test_sekv_with_nothing_compressed_follows_full_kv_step_for_step(tmp_path):
    """Budget 1.0 compresses nothing: forced to stock vLLM's greedy answer, the plugin's top token is that answer's
    at every step, as sure of it as stock vLLM; at 12.5% the run gives every figure."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suite.fidelity", "--tasks", "needle", "--lengths", "1000",
                           "--samples", "1", "--budgets", "1.0", "0.125", "--split", "eval", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = [json.loads(x) for x in (tmp_path / "reference.jsonl").read_text().splitlines()]
    assert len(ref) == 1 and len(ref[0]["token_ids"]) == len(ref[0]["logprobs"]) > 5
    records = {r["budget"]: r for r in map(json.loads, (tmp_path / "fidelity.jsonl").read_text().splitlines())}
    exact = records[1.0]
    assert exact["agreement"] == 1.0 and exact["steps"] == len(ref[0]["token_ids"])
    assert abs(exact["nll_gap"]) < 0.02
    assert exact["answer_steps"] > 0 and exact["answer_agreement"] == 1.0  # full KV finds the 1K needle
    compressed = records[0.125]
    assert 0.0 <= compressed["agreement"] <= 1.0 and compressed["steps"] == exact["steps"]
    assert compressed["kept_full_kv"] is False
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {(r["budget"], r["samples"]) for r in summary["rows"]} == {(1.0, 1), (0.125, 1)}


def test_runs_side_by_side_table_and_plot(tmp_path):
    from benchmarks.suite.fidelity_plot import main as compare

    def run(name, config, gap):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"backend": "sekv:router", "budget": b, "task": "vt", "length": 2000, "samples": 2, "agreement": 0.9,
                 "first_miss": 3, "nll": 0.3, "nll_gap": gap, "steps": 40, "answer_agreement": 0.8,
                 "answer_nll_gap": 2 * gap, "answer_samples": 2} for b in (0.25, 0.125)]
        (folder / "summary.json").write_text(json.dumps({"command": "python -m benchmarks.suite.fidelity ...",
                                                         "model": "m", "grid": {"sekv_config": config}, "rows": rows}))
        return folder

    a, b = run("defaults", {}, 0.1), run("gates-0", {"key_gate_strength": 0}, 0.05)
    png = tmp_path / "gaps.png"
    assert compare([str(a), str(b), "--out", str(png)]) == 0
    assert png.stat().st_size > 0
    with pytest.raises(SystemExit):
        compare([str(tmp_path / "missing")])
