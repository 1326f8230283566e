"""User-facing configuration, validated once at the edge.

Deployment settings: `SeKVConfig`, passed as `--additional-config '{"sekv": {...}}'` or
`LLM(additional_config={"sekv": {...}})`. Per-request settings: `RequestOverrides`, passed in
`SamplingParams.extra_args` (OpenAI body: `"vllm_xargs": {"sekv_budget_ratio": 0.5}`).
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sekv_vllm.methods import METHOD_NAMES, METHODS, QUANTIZING_METHODS, SEKV, MethodSettings

ADDITIONAL_CONFIG_KEY = "sekv"
REQUEST_KEY_PREFIX = "sekv_"
# Settings every method reads; the other fields of SeKVConfig are SeKV's own.
COMMON_SETTINGS = frozenset({"method", "method_settings", "budget_ratio", "token_budget", "min_prompt_tokens",
                             "window_growth", "host_pool_bytes", "return_pages", "decode_room_tokens",
                             "stats_path"})


class SeKVConfigError(ValueError):
    """A configuration value is out of range; the message names the field and what is allowed."""


def _a_setting(key: str) -> bool:
    """Whether `key` is a setting of some method (else pydantic refuses it as unknown)."""
    return key in SeKVConfig.model_fields or any(key in m.model_fields for m in METHODS.values())


def _describe(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        if not e["loc"]:  # a check of the whole config: its message names the fields
            lines.append(where + e["msg"].removeprefix("Value error, "))
            continue
        field = ".".join(str(p) for p in e["loc"])
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"{where}{field}: {e['msg']}{got}")
    return "; ".join(lines)


class SeKVConfig(BaseModel):
    """Deployment-wide settings: the method, its budget, and the method's own settings.

    Another method's settings are given beside `method` (`{"method": "snapkv",
    "observation_window": 32}`) and kept in `method_settings`; a setting of another method is refused.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal[METHOD_NAMES] = Field(SEKV, description="the KV-cache method of every request that does not "
                                          "choose one (`sekv_method`)")
    method_settings: dict[str, Any] = Field(default_factory=dict, description="the method's own settings (not SeKV's)")
    budget_ratio: float = Field(0.25, gt=0.0, le=1.0, description="the share of a request's full-KV bytes it may "
                                "hold in the fast tier, everything counted (rows, span summaries, scoring codes, "
                                "learned features), for every method")
    token_budget: int | None = Field(None, ge=1, description="absolute budget, in full-KV rows' worth of fast-tier "
                                     "bytes; overrides budget_ratio")
    min_prompt_tokens: int = Field(512, ge=0, description="shorter prompts keep full KV")
    # 16, not more: at a 12.5% budget of a 1K prompt (125 rows) a 64-row window left less than one
    # span to zoom (suite, benchmarks/results/suite-zoom); there even 16 narrows (runtime/span_budget.py).
    window: int = Field(16, ge=1, description="last prompt tokens kept at full resolution (a tight budget narrows "
                        "the prompt's to as little as half: see plan_layout)")
    window_growth: int = Field(
        256, ge=0, description="rows the full-resolution window (the prompt's last tokens, then the output) may "
        "grow past `window` before its oldest rows are segmented and compressed as the prompt was (their vLLM "
        "pages returned too); 0: the output stays at full resolution")
    zoom_share: float = Field(
        0.5, ge=0.0, lt=1.0,
        description="share of the budget kept for zoomed spans; anchors are demoted until the rest fits",
    )
    min_zoom_spans: int = Field(
        1, ge=0, description="the zoom gives up its share of the budget down to this many spans' rows (max_span "
        "each) before the spans keep fewer scoring centroids (zoom_share is its share when the budget is ample)")
    recall_keys: bool = Field(
        True, description="spend the zoom rows a request's whole spans leave over on the best single keys of its "
        "other spans (ranked by their scoring codes, one row each; a span's summary then stands for its tokens not "
        "read); needs every key a scoring centroid (score_centroids >= max_span, as the budget allows); false: "
        "whole spans only")
    whole_span_share: float = Field(
        1.0, ge=0.0, le=1.0, description="share of a request's zoom rows that whole spans may take where its keys "
        "are recalled (recall_keys, every key a scoring centroid); the rest, and what whole spans leave, goes to "
        "single keys")
    # 0.3 at 12.5% (suite): dev split 2K 0.97x -> 1.03x full KV, 1K 0.92x -> 0.95x; `zoom` profile 0.98x -> 1.01x
    # (niah_multivalue at 2K-8K within 85% of full KV). At 25% the `zoom` profile fell 1.03x -> 0.97x (vt at
    # 2K/4K to 0): off by default until a share that holds at every budget is found (docs/results.md).
    whole_span_min_share: float = Field(
        0.0, ge=0.0, le=1.0, description="where keys are recalled, a span is zoomed whole only when its score holds "
        "at least this share of its request's span scores (a softmax over the spans' scores, per KV head): where "
        "no span stands out the zoom spreads over single keys of many spans, a span that dominates is read whole; "
        "0: whole spans by score alone")
    # 0.5: on the `zoom` profile as accurate as 0.8 (1.00x / 1.03x full KV at 12.5% / 25% against 1.02x / 1.01x)
    # for a fifth of its exact reads; 0.8 costs 36% of the wall time of 32 x 4K essays x 512 tokens, 0.5 ~4% per
    # output token (docs/results.md, "Exact fallback")
    exact_fallback_coverage: float = Field(
        0.5, ge=0.0, lt=1.0, description="where keys are recalled: a KV head whose rows read this step (full "
        "rows, zoomed spans, recalled keys) hold less than this share of one of its query heads' attention "
        "(estimated: full rows exactly, every other key by its scoring code) reads every prompt row instead, "
        "from the host pool, for that step (the fast tier's bytes are unchanged; `mean_exact_heads` counts "
        "them); 0: never")
    surprisal_precision: Literal["auto", "bfloat16", "model"] = Field(
        "auto", description="the prompt-token surprisal SeKV segments by: 'model' from the model's own logits (its "
        "dtype, vLLM's logits processor); 'bfloat16' from a bfloat16 copy of the output projection (within ~0.1 "
        "nats of float32's; ~2.5x faster on CPUs with bfloat16 dot products, slower on others); 'auto': bfloat16 "
        "where the CPU has bfloat16 dot products (AVX-512 BF16 or AMX) or on a GPU, else 'model'")
    surprisal_exact_tokens: int = Field(
        0, ge=0, description="0: the surprisal's log-sum-exp over every vocabulary token's logit; N > 0: over the "
        "logits of token ids below N (a BPE vocabulary's commonest), of the prompt's tokens, and of every 8th other "
        "token standing for 8 (the default model at 8192: ~3.4x less surprisal time, within ~0.05 nats on average); "
        "needs the output projection as a plain matrix (else the model's own logits, logged)")
    alpha: float = Field(1.0, ge=-3.0, le=10.0, description="anchor threshold: mean + alpha * std of surprisal")
    l_min: int = Field(4, ge=1, le=64, description="runs shorter than this stay at full resolution")
    # At max_span <= r_max every span rebuilds exactly; a longer max_span or a smaller r_max
    # trades accuracy for a smaller host pool.
    max_span: int = Field(32, ge=2, le=4096, description="longer runs are split into pieces of at most this length")
    r_max: int = Field(32, ge=1, le=1024, description="rank cap of each span's SVD basis")
    # Suite at a 12.5% row budget (6 samples per cell): every key at 2 bits (32 centroids = max_span)
    # ranks spans almost as exact keys do (router 95% of full KV's accuracy vs 64% with 4 float16
    # centroids) for ~4.7% of full KV in fast-tier bytes (codes and a range per channel and span).
    score_centroids: int = Field(
        32, ge=0, le=32, description="key centroids per span kept in the fast tier to score spans for zoom "
        "(k-means of the span's keys); 0: the summary key alone (q . k_bar / sqrt(D) + log|S|)")
    score_bits: Literal[2, 4, 8, 16] = Field(
        2, description="bits per element of the scoring centroids: 16 keeps them in float16; 2, 4 or 8 quantizes "
        "them per span, KV head and channel (with score_centroids >= max_span: every key of the span at that width)")
    # 1, not 4: a range shared by 4 spans (128 tokens) saves 0.37 rows' worth of bytes per span but its
    # coarser 2-bit steps cost more accuracy than the bytes buy (needle 1K at a 12.5% fast tier, 6 samples:
    # a range per span, where the plan keeps 16 centroids, 0.50 and 0.83 in two runs; shared, 0.00 with
    # every key a centroid, 0.33 with 16).
    summary_dtype: Literal["float16", "kv"] = Field(
        "float16", description="the spans' summary rows (their mean key and value, attended for the tokens not "
        "zoomed): float16 where the KV cache is wider (float32: half their fast-tier bytes, which go to zoom rows), "
        "or kv: the KV cache's dtype")
    score_range_spans: int = Field(
        1, ge=1, le=64, description="consecutive spans sharing each channel's quantization range of their scoring "
        "codes (score_bits < 16): a range costs 2 float16 per KV head and channel")
    zoom_policy: Literal["auto", "router", "span_score"] = Field(
        "auto", description="router: the trained router (weights shipped for the default model; another model "
        "needs router_weights); span_score: the untrained score (the span's attention mass estimated from its key "
        "centroids); auto: the router when router_weights is given or weights are shipped for the model, else "
        "span_score (the choice is logged at start-up)")
    # 0.5, not 1 (since 2026-12-07): on the `zoom` profile's evaluation samples half strength differs from full KV
    # in 34 / 31 samples at 12.5% / 25% against the full gates' 50 / 54, with fewer cells below 85% of full KV
    # (11 vs 15; vt within it); the full gates' higher average is answers surer than full KV's (docs/results.md).
    key_gate_strength: float = Field(
        0.5, ge=0, le=1, description="with the router: how much of its learned gates on each span's key directions "
        "applies (the stored key rows rebuilt as U diag(g') U^T X, g' = 1 - strength (1 - g); one eigendecomposition "
        "per span, KV head and layer at compression); 0: the key rows are kept as they are (no eigendecompositions); "
        "no effect with span_score")
    decode_kernel: Literal["auto", "cpp", "torch"] = Field(
        "auto", description="decode attention of compressed requests and the eigensolver of compression: cpp (C++ "
        "kernels compiled on first use: csrc/cpu/span_decode.cpp, one call per layer, and csrc/cpu/small_eigh.cpp, "
        "the spans' Gram matrices for the router's key gates; start-up fails if they cannot be built), torch (the "
        "reference ops: torch.linalg.eigh), auto (cpp where it builds, and for decode where the KV cache is "
        "float32; else torch, logged)")
    router_weights: str | None = Field(None, description="router weight file; default: the one shipped for the model")
    host_pool_bytes: int = Field(4 << 30, ge=0, description="capacity of the host pool holding span bases")
    return_pages: bool = Field(True, description="return a compressed request's prompt pages to vLLM's pool, "
                               "but for the fast tier's share")
    # 32 x 4K prompts, 512 output tokens, 1 GiB pool (benchmarks.perf.end_to_end): with 0, 25 requests at once,
    # ~4 prompts computed again after preemption, 1.09x stock's output tok/s (end_to_end_e7b287d_cpu.json); with
    # 1024, 19 at once, none preempted, 1.27x (end_to_end_b6c182b_cpu.json; on f0b243e 1.21x, end_to_end_cpu.json).
    decode_room_tokens: int = Field(
        1024, ge=0, description="a new request is admitted only while vLLM's pool keeps room for every running "
        "request to decode this many more tokens (up to its max_tokens): a compressed request's output pages are "
        "most of what it holds, and a request preempted for them computes its whole prompt again; 0: vLLM's own "
        "admission (the prompt must fit)")
    stats_path: str | None = Field(None, description="append one JSON line of figures per compressed request here")

    @model_validator(mode="before")
    @classmethod
    def _settings_of_the_method(cls, raw: Any) -> Any:
        """Another method's settings go to `method_settings` (validated by the method); a setting
        of a method other than the one chosen is refused naming it."""
        if not isinstance(raw, dict):
            return raw
        method = raw.get("method", SEKV)
        if method not in METHOD_NAMES:
            return raw  # the Literal names the allowed methods
        own = set(METHODS[method].model_fields) if method in METHODS else set(cls.model_fields)
        foreign = sorted(k for k in raw if k not in own and k not in COMMON_SETTINGS and _a_setting(k))
        if foreign:
            theirs = sorted(own - COMMON_SETTINGS)
            raise ValueError(f"{', '.join(foreign)}: not a setting of method {method!r}; its settings: {theirs}, "
                             f"and for every method: {sorted(COMMON_SETTINGS - {'method_settings'})}")
        if method not in METHODS:
            return raw
        settings = {**raw.get("method_settings", {}), **{k: v for k, v in raw.items() if k in own}}
        try:
            METHODS[method](**settings)
        except ValidationError as err:
            raise ValueError(_describe(err, "")) from None
        rest = {k: v for k, v in raw.items() if k not in own}
        return {**rest, "method_settings": settings}

    @model_validator(mode="after")
    def _spans_longer_than_runs(self) -> "SeKVConfig":
        if self.max_span < 2 * self.l_min:
            raise ValueError(f"max_span ({self.max_span}) must be at least 2 * l_min ({2 * self.l_min})")
        return self

    def normalised(self) -> dict[str, Any]:
        """Every setting the method reads, defaults included (what every process of the engine reads)."""
        if self.method not in METHODS:
            return self.model_dump()
        common = self.model_dump(include=COMMON_SETTINGS)
        return {**common, "method_settings": self.method_of(self.method).model_dump()}

    def method_of(self, name: str) -> MethodSettings:
        """The method `name` (not SeKV), with this deployment's settings if it is the deployment's method."""
        return METHODS[name](**(self.method_settings if name == self.method else {}))

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> "SeKVConfig | None":
        """The `sekv` entry of vLLM's additional_config, validated; None when absent."""
        if not isinstance(additional_config, dict) or ADDITIONAL_CONFIG_KEY not in additional_config:
            return None
        raw = additional_config[ADDITIONAL_CONFIG_KEY]
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise SeKVConfigError(f"additional_config.sekv must be an object of settings, got {type(raw).__name__}")
        try:
            return cls(**raw)
        except ValidationError as err:
            raise SeKVConfigError("invalid sekv config: " + _describe(err, "sekv.")) from None

    def budget_for(self, prompt_len: int, overrides: "RequestOverrides") -> int:
        """One request's budget: the fast-tier bytes of this many full-KV rows of its prompt."""
        if overrides.sekv_token_budget is not None:
            return overrides.sekv_token_budget
        if overrides.sekv_budget_ratio is not None:
            return max(1, math.ceil(overrides.sekv_budget_ratio * prompt_len))
        if self.token_budget is not None:
            return self.token_budget
        return max(1, math.ceil(self.budget_ratio * prompt_len))


class RequestOverrides(BaseModel):
    """Per-request settings read from SamplingParams.extra_args (keys starting with `sekv_`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sekv_compress: bool = Field(True, description="false keeps this request at full KV")
    sekv_method: Literal[METHOD_NAMES] | None = Field(None, description="this request's method (default settings "
                                                      "unless it is the deployment's)")
    sekv_budget_ratio: float | None = Field(None, gt=0.0, le=1.0)
    sekv_token_budget: int | None = Field(None, ge=1)
    sekv_kv_bits: Literal[2, 4, 8, 16] | None = Field(None, description="bits of this request's kept rows "
                                                      "(a method that quantizes them, named by sekv_method)")
    sekv_exact_fallback_coverage: float | None = Field(
        None, ge=0.0, lt=1.0, description="this request's `exact_fallback_coverage` (SeKV's; 0: never)")

    @model_validator(mode="after")
    def _settings_with_their_method(self) -> "RequestOverrides":
        if self.sekv_kv_bits is not None and self.sekv_method not in QUANTIZING_METHODS:
            raise ValueError(f"sekv_kv_bits needs sekv_method naming a method whose kept rows may be quantized: "
                             f"one of {sorted(QUANTIZING_METHODS)} (got sekv_method={self.sekv_method!r})")
        if self.sekv_exact_fallback_coverage is not None and self.sekv_method not in (None, SEKV):
            raise ValueError(f"sekv_exact_fallback_coverage is a setting of method {SEKV!r} "
                             f"(got sekv_method={self.sekv_method!r})")
        return self

    @classmethod
    def from_extra_args(cls, extra_args: dict[str, Any] | None) -> "RequestOverrides":
        """Validate the `sekv_*` keys of a request; other keys belong to others and are ignored."""
        ours = {k: v for k, v in (extra_args or {}).items() if k.startswith(REQUEST_KEY_PREFIX)}
        unknown = sorted(set(ours) - set(cls.model_fields))
        if unknown:
            raise SeKVConfigError(
                f"unknown per-request field(s) {unknown}; allowed: {sorted(cls.model_fields)}"
            )
        try:
            return cls(**ours)
        except ValidationError as err:
            raise SeKVConfigError("invalid per-request sekv setting: " + _describe(err, "")) from None
