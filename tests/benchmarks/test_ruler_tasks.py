"""The task generator: deterministic, shortest message reaching the target, RULER scoring."""
import pytest

from sekv_vllm.tasks.ruler import FAMILIES, chat_prompt, make_sample, score, split_after_question


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sekv_vllm.entrypoints.default_model import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def count_tokens(tokenizer):
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("task", sorted(FAMILIES))
def test_every_family_is_deterministic_and_holds_its_answers(task, count_tokens):
    a = make_sample(task, 1000, 0.5, 7, count_tokens)
    assert a == make_sample(task, 1000, 0.5, 7, count_tokens)
    assert a.answers != make_sample(task, 1000, 0.5, 8, count_tokens).answers
    assert a.answers and all(ans in a.prompt for ans in a.answers)


@pytest.mark.parametrize("task", ["needle", "niah_multikey", "vt", "fwe"])
@pytest.mark.parametrize("target", [1000, 3000])
def test_message_is_the_shortest_reaching_the_target(task, target, count_tokens):
    s = make_sample(task, target, 0.3, 1, count_tokens)
    n = count_tokens(s.prompt)
    assert target <= n < target + 150  # one unit (a sentence, a noise line) past the target at most


def test_needle_sits_at_the_requested_depth(count_tokens):
    for depth in (0.1, 0.9):
        s = make_sample("needle", 1000, depth, 2, count_tokens)
        body = s.prompt.split("\n\n")[1]
        assert abs(body.index(s.answers[0]) / len(body) - depth) < 0.1


def test_multi_answer_families_ask_for_several_values(count_tokens):
    assert len(make_sample("niah_multivalue", 1000, 0.5, 0, count_tokens).answers) == 4
    assert len(make_sample("niah_multiquery", 1000, 0.5, 0, count_tokens).answers) == 4
    vt = make_sample("vt", 1000, 0.5, 0, count_tokens)
    order = [vt.prompt.index(f"VAR {name} =") for name in vt.answers]
    assert order == sorted(order)  # the chain appears in assignment order


def test_scoring_is_string_match_all():
    assert score(("1234567",), "The number is 1234567.") == 1.0
    assert score(("1234567",), "123456") == 0.0
    assert score(("1234567",), "") == 0.0
    assert score(("aa", "bb", "cc", "dd"), "AA and bb, then x") == 0.5


def test_bad_task_or_depth_is_refused(count_tokens):
    with pytest.raises(ValueError, match=r"task: 'nedle' is not one of \["):
        make_sample("nedle", 1000, 0.5, 0, count_tokens)
    with pytest.raises(ValueError, match=r"depth: 1.5 is outside \[0, 1\]"):
        make_sample("needle", 1000, 1.5, 0, count_tokens)


@pytest.mark.parametrize("task", sorted(FAMILIES))
def test_chat_prompt_and_the_peer_split_carry_the_same_text(task, tokenizer, count_tokens):
    s = make_sample(task, 1000, 0.5, 3, count_tokens)
    text = chat_prompt(s, tokenizer)
    assert text.startswith("<|im_start|>") and s.prompt in text  # chat template applied, BOS as it has it
    assert text.endswith(s.answer_prefix)
    compressed, rest = split_after_question(s, tokenizer)
    assert compressed + rest == text
    assert compressed.endswith(s.question) and s.context in compressed
    assert rest.startswith("<|im_end|>") and rest.endswith(s.answer_prefix)
    assert all(a not in rest for a in s.answers)  # the answers are in the compressed part only
