"""Router training on the default model: causality, one step lowers the loss, seeds, labels."""
import pytest
import torch

from benchmarks.suite.grid import make_grid
from sekv_vllm.config import SeKVConfig
from sekv_vllm.router import ZoomRouter
from sekv_vllm.tasks.ruler import DEV_SEED_BASE
from sekv_vllm.training.config import TrainConfig, TrainConfigError
from sekv_vllm.training.data import TrainingText, build_texts
from sekv_vllm.training.losses import kl_to_teacher, router_losses
from sekv_vllm.training.student import layer_memories, student_forward
from sekv_vllm.training.teacher import positive_spans, teacher_pass

CONFIG = TrainConfig(queries=64, sekv=SeKVConfig(window=32), budget_ratios=(0.25,))


@pytest.fixture(scope="module")
def lm():
    from sekv_vllm.entrypoints.default_model import prepare_default_model
    from sekv_vllm.training.frozen_lm import FrozenLM

    return FrozenLM(str(prepare_default_model()))


@pytest.fixture(scope="module")
def text(lm):
    (t,) = build_texts(TrainConfig(train_samples=1, lengths=(400,), sources=("essay",), essay_continuation=24),
                       lm.tokenizer, heldout=False)
    return TrainingText(t.source, t.seed, t.ids, t.prompt_len, 0.25)


@pytest.fixture(scope="module")
def rec(lm, text):
    return teacher_pass(lm, text, CONFIG)


def test_future_tokens_do_not_change_earlier_queries(lm, text, rec):
    """Changing the continuation from position c on changes no student output (nor loss term)
    at queries before c, and does change those at c and after."""
    c = text.prompt_len + 12
    ids2 = text.ids.clone()
    ids2[c:] = torch.flip(ids2[c:], [0]) + 7
    other = TrainingText(text.source, text.seed, ids2, text.prompt_len, text.budget_ratio)
    a, b = rec, teacher_pass(lm, other, CONFIG)
    assert torch.equal(a.query_pos, b.query_pos)  # every candidate kept (queries=64)
    router = ZoomRouter(lm.shape)
    oa = student_forward(lm, router, a, layer_memories(a, 32, 4))
    ob = student_forward(lm, router, b, layer_memories(b, 32, 4))
    before = a.query_pos < c
    assert before.any() and (~before).any()
    assert torch.allclose(oa.logp[before], ob.logp[before], atol=1e-5)
    assert not torch.allclose(oa.logp[~before], ob.logp[~before], atol=1e-3)
    for la, lb in zip(oa.score_logits, ob.score_logits):
        assert torch.allclose(la[before], lb[before], atol=1e-5)


def test_hard_full_zoom_student_matches_the_teacher(lm, rec):
    """Zooming every span with exact keys is full attention: the student's next-token
    distribution is the teacher's (same frozen model, only the attention path differs)."""
    mems = layer_memories(rec, 32, 4)
    out = student_forward(lm, None, rec, mems,
                          hard_zoom=lambda i, q, keys, zb: torch.ones(q.shape[0], q.shape[1], keys.num_spans, dtype=torch.bool))
    # the teacher's log-probs are stored in float16: compare distributions
    assert kl_to_teacher(rec.logp, out.logp) < 1e-3
    assert torch.equal(out.logp.argmax(-1), rec.logp.float().argmax(-1))
    none = student_forward(lm, None, rec, mems,
                           hard_zoom=lambda i, q, keys, zb: torch.zeros(q.shape[0], q.shape[1], keys.num_spans, dtype=torch.bool))
    assert kl_to_teacher(rec.logp, none.logp) > 1e-2  # summaries alone are not exact


def test_one_step_lowers_the_loss_and_the_budget_term_reaches_tau(lm, rec):
    mems = layer_memories(rec, 32, 4)
    router = ZoomRouter(lm.shape)
    opt = torch.optim.AdamW(router.parameters(), lr=1e-3)
    first = router_losses(student_forward(lm, router, rec, mems), rec, mems, CONFIG, budget_ramp=1.0)
    opt.zero_grad()
    first["loss"].backward()
    assert router.tau_logit.grad.abs().sum() > 0 and router.W.grad.abs().sum() > 0 and router.w3.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        after = router_losses(student_forward(lm, router, rec, mems), rec, mems, CONFIG, budget_ramp=1.0)
    assert after["loss"] < first["loss"]


def test_budget_term_has_gradient_when_over_budget(lm, rec):
    mems = layer_memories(rec, 32, 4)
    router = ZoomRouter(lm.shape)
    cfg = CONFIG.model_copy(update={"bce_weight": 0.0, "gate_weight": 0.0})
    out = student_forward(lm, router, rec, mems)
    losses = router_losses(out, rec, mems, cfg, budget_ramp=1.0)
    assert losses["budget"] > 0
    losses["budget"].backward()
    assert router.tau_logit.grad.abs().sum() > 0  # raising tau zooms less: the term pushes it


def test_positive_spans_are_the_smallest_top_set():
    mass = torch.tensor([[0.05, 0.5, 0.3, 0.15], [0.0, 0.0, 0.0, 0.0]])
    assert positive_spans(mass, 0.9).tolist() == [[False, True, True, True], [False] * 4]
    assert positive_spans(mass, 0.5).tolist()[0] == [False, True, False, False]


def test_training_seeds_are_disjoint_from_the_suite(lm):
    cfg = TrainConfig(train_samples=7, heldout_samples=3, lengths=(300,))
    seeds = [t.seed for t in build_texts(cfg, lm.tokenizer, heldout=False)]
    held = [t.seed for t in build_texts(cfg, lm.tokenizer, heldout=True)]
    suite = {j["seed"] for split in ("eval", "dev") for j in make_grid("full", split=split).jobs()}
    assert max(seeds + held) < DEV_SEED_BASE <= min(suite)
    assert not set(seeds) & set(held)
    with pytest.raises(TrainConfigError, match="DEV_SEED_BASE"):
        TrainConfig.load(None, first_heldout_seed=DEV_SEED_BASE - 2, heldout_samples=5)
    with pytest.raises(TrainConfigError, match="overlap"):
        TrainConfig.load(None, first_train_seed=0, train_samples=100, first_heldout_seed=50)
    with pytest.raises(TrainConfigError, match="sources"):
        TrainConfig.load(None, sources=["essay", "poetry"])


def test_relaxed_topk_threshold_sits_at_the_budget_edge():
    from sekv_vllm.training.student import budget_threshold

    ell = torch.tensor([[[5.0, 1.0, 3.0, 0.0]]])
    lens = torch.full((4,), 5)  # each span costs 4 rows
    assert budget_threshold(ell, lens, 8).item() == 2.0  # takes 5 and 3, leaves 1
    assert budget_threshold(ell, lens, 0).item() == 5.5  # takes none
    assert budget_threshold(ell, lens, 100).item() == -0.5  # takes all
    # sigmoid(score - threshold) is above 1/2 exactly for the spans the hard budgeted top-k takes
    z = torch.sigmoid(ell - budget_threshold(ell, lens, 8))
    assert (z > 0.5).flatten().tolist() == [True, False, True, False]


def test_heldout_evaluation_splits_by_source(lm, rec):
    from sekv_vllm.policies import SpanScorePolicy
    from sekv_vllm.training.evaluate import evaluate_policy

    (t,) = build_texts(TrainConfig(train_samples=1, first_train_seed=3, lengths=(400,), sources=("niah_single",)),
                       lm.tokenizer, heldout=False)
    task = teacher_pass(lm, TrainingText(t.source, t.seed, t.ids, t.prompt_len, 0.25), CONFIG)
    res = evaluate_policy(lm, SpanScorePolicy(), None, [rec, task], r_max=32, score_centroids=32, score_bits=2)
    per = res["by_source"]
    assert set(per) == {"essay", "niah_single"} and all(p["records"] == 1 for p in per.values())
    # one text per source: the overall KL is the mean of the two; recall is averaged over every
    # (query, layer, head), so it lies between the two sources'
    assert res["kl_to_full_kv"] == pytest.approx((per["essay"]["kl_to_full_kv"] + per["niah_single"]["kl_to_full_kv"]) / 2)
    lo, hi = sorted(p["span_recall"] for p in per.values())
    assert lo - 1e-6 <= res["span_recall"] <= hi + 1e-6
    assert 0 < res["span_recall"] <= 1


def test_cached_teacher_passes_are_those_of_the_same_text(lm, tmp_path, monkeypatch):
    from sekv_vllm.training import train

    cfg = TrainConfig(train_samples=1, lengths=(300,), sources=("essay",), essay_continuation=16, queries=8,
                      out_dir=str(tmp_path))
    passes = []
    monkeypatch.setattr(train, "teacher_pass", lambda *args: passes.append(args[1].ids) or teacher_pass(*args))
    first = train.teacher_records(lm, cfg, "model", heldout=False)
    again = train.teacher_records(lm, cfg, "model", heldout=False)
    assert len(passes) == 1 and torch.equal(first[0].logp, again[0].logp)  # read back, not run again
    # the same seed with another text (a task template changed since): run again, never the stale pass
    build = train.build_texts
    monkeypatch.setattr(train, "build_texts", lambda *a, **k: [TrainingText(t.source, t.seed, t.ids.flip(0), t.prompt_len,
                                                                            t.budget_ratio) for t in build(*a, **k)])
    train.teacher_records(lm, cfg, "model", heldout=False)
    assert len(passes) == 2 and torch.equal(passes[1], passes[0].flip(0))
