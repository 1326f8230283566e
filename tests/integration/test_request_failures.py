"""One request's failure fails that request alone; the engine and the other requests go on, and
every page and host-pool byte comes back (faults injected by fault_job.py)."""
import pytest

from sekv_vllm.tasks.ruler import make_sample
from tests.integration.conftest import run_job

pytestmark = pytest.mark.vllm

FAULT_JOB = run_job.__globals__["JOB"].with_name("fault_job.py")


@pytest.fixture(scope="module")
def fault_run(model_dir, count_tokens, tmp_path_factory):
    prompts = [make_sample("needle", n, 0.5, 20 + i, count_tokens).prompt for i, n in enumerate((1000, 1300, 1600, 1900))]
    reqs = [{"prompt": p, "max_tokens": 40} for p in prompts]
    full_kv = {"prompt": prompts[0], "max_tokens": 40, "extra_args": {"sekv_compress": False}}
    spec = {"model": model_dir, "sekv": {"min_prompt_tokens": 256, "window_growth": 8}, "rounds": [
        {"requests": [*reqs, full_kv]},
        {"requests": reqs, "faults": {"compress": 0, "spanify_window": 1}},
        {"requests": reqs, "faults": {"attend_batch": 2}},
        {"requests": reqs, "faults": {"model_step": True}},
        {"requests": reqs},
    ]}
    return run_job(spec, tmp_path_factory.mktemp("faults"), job=FAULT_JOB)


def test_a_failed_compression_keeps_full_kv_and_a_failed_compressed_request_fails_alone(fault_run):
    clean, faulted = fault_run["rounds"][0], fault_run["rounds"][1]
    assert faulted[0]["finish_reason"] != "error"
    assert faulted[0]["token_ids"] == clean[4]["token_ids"]  # went on at full KV
    assert faulted[1]["finish_reason"] == "error"  # its pages had gone back: it fails
    assert "output spanification failed: RuntimeError: injected fault" in fault_run["stderr"]
    for i in (2, 3):
        assert faulted[i]["token_ids"] == clean[i]["token_ids"]


def test_a_failed_decode_call_fails_only_the_requests_it_decodes(fault_run):
    clean, faulted = fault_run["rounds"][0], fault_run["rounds"][2]
    assert faulted[2]["finish_reason"] == "error"
    served = [i for i, out in enumerate(faulted) if out["finish_reason"] != "error"]
    assert served  # the request still prefilling when the call failed was not in it
    for i in served:
        assert faulted[i]["token_ids"] == clean[i]["token_ids"]


def test_a_failed_model_step_fails_its_requests_and_the_engine_goes_on(fault_run):
    rounds = fault_run["rounds"]
    assert all(out["finish_reason"] == "error" for out in rounds[3])
    assert [o["token_ids"] for o in rounds[4]] == [o["token_ids"] for o in rounds[0][:4]]
    assert "model step failed: RuntimeError: injected fault in the model's forward" in fault_run["stderr"]


def test_failed_requests_give_back_every_page_and_host_pool_byte(fault_run):
    errors = sum(out["finish_reason"] == "error" for r in fault_run["rounds"] for out in r)
    assert fault_run["failed_total"] == errors
    assert fault_run["pages_not_returned"] == 0
    assert fault_run["runtime_requests_left"] == 0
    assert fault_run["host_pool_used_bytes"] == 0
