"""The needle task generator: deterministic, near the target length, scored by string match."""
import pytest

from benchmarks.tasks.needle import make_sample, score


@pytest.fixture(scope="module")
def count_tokens():
    from transformers import AutoTokenizer

    from sekv_vllm.entrypoints.default_model import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    return lambda text: len(tok(text, add_special_tokens=False).input_ids)


def test_same_seed_same_sample_other_seed_other_sample(count_tokens):
    a = make_sample("needle", 1000, 0.5, 7, count_tokens)
    assert a == make_sample("needle", 1000, 0.5, 7, count_tokens)
    assert a.answer != make_sample("needle", 1000, 0.5, 8, count_tokens).answer


@pytest.mark.parametrize("task, n", [("needle", 1000), ("passkey", 2000)])
def test_length_reaches_target_by_at_most_one_sentence(task, n, count_tokens):
    s = make_sample(task, n, 0.3, 1, count_tokens)
    assert n <= count_tokens(s.prompt) < n + 120
    assert s.answer in s.prompt


def test_needle_sits_at_the_requested_depth(count_tokens):
    for depth in (0.1, 0.9):
        s = make_sample("needle", 1000, depth, 2, count_tokens)
        at = s.prompt.index(s.answer) / len(s.prompt)
        assert abs(at - depth) < 0.1


def test_scoring():
    assert score("1234567", "The number is 1234567.") == 1.0
    assert score("1234567", "123456") == 0.0
    assert score("1234567", "") == 0.0


def test_unknown_task_is_refused(count_tokens):
    with pytest.raises(ValueError, match=r"task: 'nedle' is not one of \['needle', 'passkey'\]"):
        make_sample("nedle", 1000, 0.5, 0, count_tokens)
