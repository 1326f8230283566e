"""Router training settings: one pydantic model, read from a TOML file and validated once."""
from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sekv_vllm.config import SeKVConfig
from sekv_vllm.tasks.ruler import DEV_SEED_BASE, FAMILIES

ESSAY = "essay"


class TrainConfigError(ValueError):
    """A training setting is out of range; the message names the field."""


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="HF model folder; default: the embedded SmolLM2-135M-Instruct")
    out_dir: str = "runs/router"
    seed: int = Field(0, ge=0)
    # data: teacher passes are cached in memory and reused for every epoch
    train_samples: int = Field(96, ge=1)
    heldout_samples: int = Field(16, ge=1)
    first_train_seed: int = Field(0, ge=0, lt=DEV_SEED_BASE)
    first_heldout_seed: int = Field(500_000, ge=0, lt=DEV_SEED_BASE)
    # every RULER-style family: one needle, key-value binding (multikey), several values per key (multivalue),
    # several keys asked at once (multiquery), chained references (vt), word counts (cwe, fwe)
    sources: tuple[str, ...] = (ESSAY, "needle", "passkey", "niah_single", "niah_multikey", "niah_multivalue",
                                "niah_multiquery", "vt", "cwe", "fwe")
    lengths: tuple[int, ...] = (1000, 2000, 3000)
    essay_continuation: int = Field(64, ge=2, description="essay tokens after the prompt; queries among them")
    queries: int = Field(16, ge=1, description="query positions kept per sample")
    budget_ratios: tuple[float, ...] = (0.25, 0.125, 0.0625)
    sekv: SeKVConfig = Field(default_factory=SeKVConfig, description="the method's segmentation settings")
    # router
    d_r: int = Field(32, ge=1)
    gate_hidden: int = Field(64, ge=1)
    # optimisation (method doc: AdamW 1e-3, wd 0.01, 10% warm-up then cosine, clip 1.0)
    steps: int = Field(1200, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup: float = Field(0.1, ge=0, lt=1)
    clip: float = Field(1.0, gt=0)
    # losses
    rho: float = Field(0.9, gt=0, le=1, description="positive spans: smallest top set with this share of span mass")
    bce_weight: float = Field(0.25, ge=0)
    rank_weight: float = Field(1.0, ge=0, description="listwise span-ranking term (see losses.py)")
    pos_weight: float = Field(10.0, gt=0)
    gate_weight: float = Field(0.5, ge=0)
    budget_weight: float = Field(0.1, ge=0)
    budget_ramp: float = Field(0.5, gt=0, le=1, description="share of training over which the budget term ramps up")
    relaxed_topk: bool = Field(False, description="soft zoom relaxes the budgeted top-k (threshold at the budget's "
                               "edge) instead of thresholding at tau")
    zoom_temperature: float = Field(0.25, gt=0, description="with relaxed_topk: sharpness of the soft zoom")
    checkpoint_every: int = Field(200, ge=1)
    threads: int | None = Field(None, ge=1)

    @field_validator("sources")
    @classmethod
    def _known_sources(cls, sources: tuple[str, ...]) -> tuple[str, ...]:
        allowed = [ESSAY, *sorted(FAMILIES)]
        bad = [s for s in sources if s not in allowed]
        if bad or not sources:
            raise ValueError(f"unknown source(s) {bad}; allowed: {allowed}")
        return sources

    @field_validator("budget_ratios")
    @classmethod
    def _ratios(cls, ratios: tuple[float, ...]) -> tuple[float, ...]:
        if not ratios or any(not 0 < r <= 1 for r in ratios):
            raise ValueError(f"budget_ratios {list(ratios)} must be in (0, 1]")
        return ratios

    @model_validator(mode="after")
    def _seed_ranges(self) -> "TrainConfig":
        last_train = self.first_train_seed + self.train_samples
        last_held = self.first_heldout_seed + self.heldout_samples
        if max(last_train, last_held) > DEV_SEED_BASE:
            raise ValueError(f"training seeds must stay below the suite's DEV_SEED_BASE ({DEV_SEED_BASE}): its dev "
                             "and evaluation seeds start there")
        if self.first_train_seed < last_held and self.first_heldout_seed < last_train:
            raise ValueError("train and held-out seed ranges overlap")
        return self

    @classmethod
    def load(cls, path: str | Path | None, **overrides) -> "TrainConfig":
        raw = tomllib.loads(Path(path).read_text()) if path else {}
        raw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**raw)
        except ValidationError as err:
            msgs = [f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in err.errors()]
            raise TrainConfigError("invalid training config: " + "; ".join(msgs)) from None
