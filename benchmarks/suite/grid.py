"""What a suite run measures: a validated grid of backends x budgets x tasks x lengths x samples.

Backends: `vllm` (stock vLLM, full KV: the reference), `sekv` (this plugin in vLLM with its
default zoom policy), `sekv:POLICY` (with zoom policy POLICY, e.g. `sekv:span_score`),
`sekv:METHOD` (another in-engine method, e.g. `sekv:snapkv`: sekv_vllm.methods.METHODS; `sekv:METHOD@kvB`
with its kept rows quantized to B bits, a method that quantizes: `sekv:snapkv@kv4`), and
`kvpress:PRESS` (NVIDIA kvpress on HF transformers, in its own virtual environment; PRESS one
of benchmarks.peers.kvpress_run.PRESSES). Budgets are the kept share of the prompt's KV: sekv's
budget_ratio, kvpress's 1 - compression_ratio. vLLM backends run offline (`LLM.generate`) or
through the OpenAI server with `concurrency` requests in flight.

Profiles name ready-made grids: `ci` (a minute or two), `quick` (under 30 minutes on 2 cores),
`full` (hours; resumable). Evaluation seeds start at EVAL_SEED_BASE; `split="dev"` draws other
samples (seeds from DEV_SEED_BASE) to tune settings on; router training draws its samples below
both, so none overlap.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from benchmarks.peers.presses import PRESSES
from sekv_vllm.config import COMMON_SETTINGS, SeKVConfig
from sekv_vllm.core.span_keys import QUANT_BITS
from sekv_vllm.methods import METHODS, QUANTIZING_METHODS
from sekv_vllm.policies import POLICIES
from sekv_vllm.tasks.ruler import DEV_SEED_BASE, EVAL_SEED_BASE, FAMILIES, MAX_TOKENS

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


# "sekv:span_score@c0": a sekv backend with another number of score centroids per span;
# "sekv:router@c32b2": and those centroids at 2 bits per element (score_bits).
CENTROIDS = "@c"
# "sekv:snapkv@kv4": an in-engine method with its kept rows at 4 bits (kv_bits).
KV_BITS = "@kv"
_SCORING = re.compile(r"(\d+)(?:b(\d+))?")


def _scoring(backend: str) -> tuple[int, int | None] | None:
    """(score_centroids, score_bits or None) of a backend's '@cN[bB]' suffix; None when it has none or
    it is malformed (see `_centroids_ok`)."""
    name, sep, spec = backend.partition(CENTROIDS)
    match = _SCORING.fullmatch(spec) if sep else None
    return (int(match[1]), int(match[2]) if match[2] else None) if match else None


def _kv_bits(backend: str) -> int | None:
    """B of a quantizing method's '@kvB' suffix; None when it has none or it is malformed."""
    name, sep, spec = backend.partition(KV_BITS)
    return int(spec) if sep and name[5:] in QUANTIZING_METHODS and spec in ("2", "4", "8") else None


def _centroids_ok(backend: str) -> bool:
    name, sep, _ = backend.partition(CENTROIDS)
    if not sep:
        return True
    scoring = _scoring(backend)
    return (name.startswith("sekv") and scoring is not None and 0 <= scoring[0] <= 32
            and scoring[1] in (None, *QUANT_BITS, 16))


class GridError(ValueError):
    """A grid specification is invalid; the message names the field and the allowed values."""


class Grid(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backends: tuple[str, ...] = ("vllm", "sekv")
    budgets: tuple[float, ...] = (0.5, 0.25, 0.125)
    tasks: tuple[str, ...] = ("needle", "passkey")
    lengths: tuple[int, ...] = (1000,)
    samples: int = Field(3, ge=1, le=1000)
    max_tokens: int | None = Field(None, ge=1, le=1024, description="answer length for every task; "
                                   "default: each family's own (ruler.MAX_TOKENS)")
    sekv_config: dict = Field(default_factory=dict, description="SeKVConfig fields; each sekv backend takes those "
                              "of its method (SeKV's, or an in-engine method's own) and the ones every method reads")
    press_settings: dict = Field(default_factory=dict, description="keyword settings of the kvpress presses "
                                 "(e.g. {'window_size': 16} for SnapKVPress)")
    via: Literal["offline", "server"] = "offline"
    concurrency: int = Field(8, ge=1, le=256)
    split: Literal["eval", "dev"] = Field("eval", description="eval: the evaluation samples (the published figures); "
                                          "dev: other samples of the same tasks, to tune settings on")

    @field_validator("backends")
    @classmethod
    def _known_backends(cls, backends: tuple[str, ...]) -> tuple[str, ...]:
        allowed = (["vllm", "sekv"] + [f"sekv:{p}" for p in POLICIES] + [f"kvpress:{p}" for p in PRESSES]
                   + [f"sekv:{m}" for m in METHODS])
        unknown = [b for b in backends if (b.split(CENTROIDS)[0] not in allowed or not _centroids_ok(b)
                                           or (CENTROIDS in b and b.split(CENTROIDS)[0][5:] in METHODS))
                   and _kv_bits(b) is None]
        if unknown or not backends:
            raise ValueError(f"unknown backend(s) {unknown}; allowed: {allowed}, a sekv one optionally with "
                             f"'{CENTROIDS}N' (score centroids per span, N in 0..32) or '{CENTROIDS}NbB' (and "
                             f"their bits per element, B in {[*QUANT_BITS, 16]}), an in-engine method's that "
                             f"quantizes ({list(QUANTIZING_METHODS)}) with '{KV_BITS}B' (its kept rows at B bits, B in [2, 4, 8])")
        return backends

    @field_validator("sekv_config")
    @classmethod
    def _known_settings(cls, config: dict) -> dict:
        known = set(SeKVConfig.model_fields).union(*(m.model_fields for m in METHODS.values()))
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"{unknown} are settings of no method; allowed: {sorted(known)}")
        return config

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in tasks if t not in FAMILIES]
        if unknown or not tasks:
            raise ValueError(f"unknown task(s) {unknown}; allowed: {sorted(FAMILIES)}")
        return tasks

    @field_validator("budgets")
    @classmethod
    def _budgets_in_range(cls, budgets: tuple[float, ...]) -> tuple[float, ...]:
        bad = [b for b in budgets if not 0 < b <= 1]
        if bad:
            raise ValueError(f"budgets {bad} are outside (0, 1]")
        return budgets

    @field_validator("lengths")
    @classmethod
    def _lengths_in_range(cls, lengths: tuple[int, ...]) -> tuple[int, ...]:
        bad = [n for n in lengths if not 128 <= n <= 32768]
        if bad or not lengths:
            raise ValueError(f"lengths {bad} are outside [128, 32768]")
        return lengths

    def sekv_settings(self, backend: str) -> dict | None:
        """The SeKVConfig fields a sekv backend runs with; None for the other backends."""
        if not backend.startswith("sekv"):
            return None
        name = backend.partition(CENTROIDS)[0].partition(KV_BITS)[0]
        if name[5:] in METHODS:  # an in-engine method beside SeKV: its own settings and those every method reads
            own = COMMON_SETTINGS | set(METHODS[name[5:]].model_fields)
            bits = _kv_bits(backend)
            return {**{k: v for k, v in self.sekv_config.items() if k in own}, "method": name[5:],
                    **({"kv_bits": bits} if bits else {})}
        out = {k: v for k, v in self.sekv_config.items() if k in SeKVConfig.model_fields}
        if name.startswith("sekv:"):
            out["zoom_policy"] = name.split(":", 1)[1]
        scoring = _scoring(backend)
        if scoring is not None:
            out["score_centroids"] = scoring[0]
            if scoring[1] is not None:
                out["score_bits"] = scoring[1]
        return out

    @property
    def first_seed(self) -> int:
        return EVAL_SEED_BASE if self.split == "eval" else DEV_SEED_BASE

    def jobs(self) -> list[dict]:
        """Every (backend, budget, task, length, seed, depth, max_tokens) cell; full KV has budget 1.0."""
        out = []
        for backend in self.backends:
            for budget in (self.budgets if backend != "vllm" else (1.0,)):
                for task in self.tasks:
                    for n in self.lengths:
                        for i in range(self.samples):
                            out.append({"backend": backend, "budget": budget, "task": task, "length": n,
                                        "seed": self.first_seed + i, "depth": DEPTHS[i % len(DEPTHS)],
                                        "max_tokens": self.max_tokens or MAX_TOKENS[task]})
        return out


def job_key(job: dict) -> tuple:
    return (job["backend"], job["budget"], job["task"], job["length"], job["seed"], job["max_tokens"])


PEERS = ("kvpress:snapkv", "kvpress:expected_attention")

PROFILES: dict[str, dict] = {
    "ci": {"tasks": ("needle",), "lengths": (1000,), "samples": 2, "budgets": (0.5,)},
    # Every method at the same budgets, a share of full KV's bytes for all of them: full KV, SeKV, every
    # in-engine method and kvpress's presses (the fast tier each really holds is in the table's last rows).
    "quick": {"backends": ("vllm", "sekv", *(f"sekv:{m}" for m in METHODS), *PEERS),
              "tasks": ("needle", "passkey", "niah_multikey"), "lengths": (1000, 2000), "samples": 3,
              "budgets": (0.25, 0.125)},
    # The trained router against the untrained score, budgets down to 1/16 of the prompt.
    "router": {"backends": ("vllm", "sekv:router", "sekv:span_score"),
               "tasks": ("needle", "passkey", "niah_multikey", "vt"), "lengths": (1000, 2000, 4000), "samples": 3,
               "budgets": (0.25, 0.125, 0.0625)},
    # Span scoring from key centroids (0: the summary key alone), the untrained score and the router.
    "centroids": {"backends": ("vllm", "sekv:span_score@c0", "sekv:span_score", "sekv:router"),
                  "tasks": ("needle", "passkey", "niah_multikey", "vt"), "lengths": (1000, 2000, 4000), "samples": 3,
                  "budgets": (0.125, 0.0625)},
    # Upper bounds of span scoring at a 12.5% budget: 32 centroids per span score every token
    # exactly (the spans that really carry the most attention), 8 centroids.
    "oracle": {"backends": ("vllm", "sekv:span_score@c32", "sekv:span_score@c8"),
               "tasks": ("needle", "passkey", "niah_multikey", "vt"), "lengths": (1000, 2000, 4000), "samples": 3,
               "budgets": (0.125,)},
    # The defaults (the trained router, every key scored at 2 bits, 16-row window) at fast tiers of 25% and
    # 12.5% of full KV (a budget bounds every byte), every family at 1K-8K, 6 samples per cell (hours: resumable).
    "zoom": {"backends": ("vllm", "sekv:router"), "tasks": tuple(FAMILIES), "lengths": (1000, 2000, 4000, 8000),
             "samples": 6, "budgets": (0.25, 0.125)},
    # KV quantization composed with SnapKV's choice of rows and with quest's pages, against both at 16 bits and
    # SeKV at the same budgets (a budget is bytes: quantized rows buy more rows, quantized pages more pages read).
    "kv-quant": {"backends": ("vllm", "sekv", "sekv:snapkv", "sekv:snapkv@kv8", "sekv:snapkv@kv4", "sekv:snapkv@kv2",
                              "sekv:quest", "sekv:quest@kv8", "sekv:quest@kv4"),
                 "tasks": ("needle", "passkey", "niah_multikey"), "lengths": (1000,), "samples": 3,
                 "budgets": (0.25, 0.125)},
    "full": {"backends": ("vllm", "sekv", "sekv:span_score", *(f"kvpress:{p}" for p in PRESSES)), "tasks": tuple(sorted(FAMILIES)),
             "lengths": (1000, 2000, 4000, 8000), "samples": 10, "budgets": (0.5, 0.25, 0.125, 0.0625)},
}


def make_grid(profile: str | None = None, **overrides) -> Grid:
    """The grid of a profile with overrides applied; GridError names any bad field."""
    if profile is not None and profile not in PROFILES:
        raise GridError(f"profile: {profile!r} is not one of {sorted(PROFILES)}")
    raw = {**(PROFILES[profile] if profile else {}), **{k: v for k, v in overrides.items() if v is not None}}
    try:
        return Grid(**raw)
    except ValidationError as err:
        msgs = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]
        raise GridError("invalid grid: " + "; ".join(msgs)) from None
