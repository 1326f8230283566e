"""The suite's batches (benchmarks.suite.batches): a sekv sample served at full KV beside its batch runs again."""
from types import SimpleNamespace

import pytest

from benchmarks.suite.batches import BATCH, batches, run_batches


class _Engine:
    """LLM.generate's stand-in: request ids as vLLM numbers them, one RequestOutput-like object per prompt."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.next_id = 0

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(list(prompts))
        outs = [SimpleNamespace(request_id=str(self.next_id + i), prompt=p) for i, p in enumerate(prompts)]
        self.next_id += len(prompts)
        return outs


def _jobs(n, task="needle", length=8000):
    return [{"task": task, "length": length, "seed": i} for i in range(n)]


def test_batches_hold_one_task_and_length_each():
    jobs = _jobs(BATCH + 2) + _jobs(3, length=1000)
    got = batches(jobs)
    assert [len(b) for b in got] == [BATCH, 2, 3]
    assert all(len({(j["task"], j["length"]) for j in b}) == 1 for b in got)


@pytest.mark.parametrize(("pool_holds", "sizes"), [(1, [8, 4, 2, 1, 1, 3, 1, 1]), (3, [8, 4, 1, 1])])
def test_samples_kept_at_full_kv_run_again_in_half_batches_until_alone(monkeypatch, pool_holds, sizes):
    engine = _Engine()

    def figures():  # the host pool holds `pool_holds` requests of each batch; the rest keep full KV
        first = engine.next_id - len(engine.calls[-1])
        return {str(i): {"fast_tier_fraction": 0.125} for i in range(first, min(first + pool_holds, engine.next_id))}

    monkeypatch.setattr("sekv_vllm.integration.vllm.runner_bridge.figures_by_request_id", figures)
    jobs = _jobs(8)
    done = list(run_batches(engine, jobs, lambda b: (b, [f"p{j['seed']}" for j in b], [None] * len(b)),
                            compressed=True, label="sekv"))
    recorded = [j for d in done for j in d.jobs]
    assert sorted(j["seed"] for j in recorded) == list(range(8))  # each sample once, none lost
    assert all(f is not None for d in done for f in d.figures)  # every one recorded compressed
    assert [len(c) for c in engine.calls] == sizes  # the rest of a batch again in batches half as large
    assert sum(d.again for d in done) == sum(sizes) - 8
    assert [d.size for d in done] == sizes
    assert all(d.items == d.jobs for d in done)


def test_a_sample_kept_at_full_kv_alone_is_recorded_without_figures(monkeypatch):
    engine = _Engine()
    monkeypatch.setattr("sekv_vllm.integration.vllm.runner_bridge.figures_by_request_id", lambda: {})
    done = list(run_batches(engine, _jobs(2), lambda b: (b, ["p"] * len(b), [None] * len(b)), compressed=True,
                            label="sekv"))
    assert [len(c) for c in engine.calls] == [2, 1, 1]
    assert [(len(d.jobs), d.figures) for d in done] == [(0, []), (1, [None]), (1, [None])]


def test_stock_vllm_samples_are_never_run_again():
    engine = _Engine()
    done = list(run_batches(engine, _jobs(5), lambda b: (b, ["p"] * len(b), [None] * len(b)), compressed=False,
                            label="vllm"))
    assert [len(c) for c in engine.calls] == [5] and done[0].figures == [None] * 5 and done[0].again == 0
