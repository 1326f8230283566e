"""benchmarks.suite.list_copy: the cwe list's first items an output copies, counted against the sample itself."""
import json
import subprocess
import sys

from benchmarks.suite.list_copy import copied_head, items


def test_items_and_the_copied_head_against_hand_counts():
    listed = items("Below is a list.\n\n1. sister 2. arranged 3. detecting 4. arranged")
    assert listed == ["sister", "arranged", "detecting", "arranged"]
    assert copied_head(listed, "1. Sister\n2. arranged\n3. arranging 4. detecting") == 2
    assert copied_head(listed, "1. arranged 2. sister") == 0
    assert copied_head(listed, "sister, arranged, detecting") == 0  # not a numbered list
    assert copied_head(listed, "1. sister 2. arranged 3. detecting 4. arranged 5. more") == 4


def test_the_command_counts_a_records_copy_of_its_own_sample(tmp_path):
    from transformers import AutoTokenizer

    from sekv_vllm.entrypoints.default_model import default_model_dir
    from sekv_vllm.tasks.ruler import make_sample, token_counter

    sample = make_sample("cwe", 1000, 0.5, 900_003, token_counter(AutoTokenizer.from_pretrained(default_model_dir())))
    first = items(sample.context)[:3]
    copy = " ".join(f"{i + 1}. {w}" for i, w in enumerate(first))
    base = {"task": "cwe", "length": 1000, "depth": 0.5, "seed": 900_003}
    records = [dict(base, backend="vllm", budget=1.0, output=copy, score=0.2),
               dict(base, backend="sekv:router", budget=0.125, output="1. nothing 2. here", score=0.0),
               dict(base, task="needle", backend="vllm", budget=1.0, output="", score=1.0)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = subprocess.run([sys.executable, "-m", "benchmarks.suite.list_copy", str(run)], capture_output=True,
                         text=True, check=True).stdout
    assert "| run | vllm | 1 | 1000 | 1 | 3.00 | 0 / 0 / 0 / 1 | 0.200 |" in out
    assert "| run | sekv:router | 0.125 | 1000 | 1 | 0.00 | 1 / 0 / 0 / 0 | 0.000 |" in out
    assert "needle" not in out
