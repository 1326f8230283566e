"""Configuration is validated once at the edge, with errors that name the field."""
import pytest

from sekv_vllm.config import RequestOverrides, SeKVConfig, SeKVConfigError


def test_defaults_validate():
    cfg = SeKVConfig.from_additional_config({"sekv": {}})
    assert cfg.budget_ratio == 0.25 and cfg.max_span >= 2 * cfg.l_min
    assert SeKVConfig.from_additional_config({"other": 1}) is None


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"budget_ratio": 0}, "sekv.budget_ratio: Input should be greater than 0"),
        ({"r_max": "many"}, "sekv.r_max: Input should be a valid integer"),
        ({"budget": 10}, "sekv.budget: Extra inputs are not permitted"),
        ({"l_min": 40, "max_span": 64}, "max_span (64) must be at least 2 * l_min (80)"),
        ({"zoom_policy": "magic"}, "sekv.zoom_policy: Input should be 'auto', 'router' or 'span_score'"),
        ({"score_bits": 3}, "sekv.score_bits: Input should be 2, 4, 8 or 16"),
        ({"surprisal_precision": "fp8"}, "sekv.surprisal_precision: Input should be 'auto', 'bfloat16' or 'model'"),
        ({"surprisal_exact_tokens": -8}, "sekv.surprisal_exact_tokens: Input should be greater than or equal to 0"),
        ({"whole_span_min_share": 1.5}, "sekv.whole_span_min_share: Input should be less than or equal to 1"),
        ({"exact_fallback_coverage": 1.0}, "sekv.exact_fallback_coverage: Input should be less than 1"),
        ({"decode_room_tokens": -1}, "sekv.decode_room_tokens: Input should be greater than or equal to 0"),
        ({"summary_dtype": "bfloat16"}, "sekv.summary_dtype: Input should be 'float16' or 'kv'"),
    ],
)
def test_bad_values_name_the_field(raw, message):
    with pytest.raises(SeKVConfigError) as err:
        SeKVConfig.from_additional_config({"sekv": raw})
    assert message in str(err.value)


def test_budget_resolution_order():
    cfg = SeKVConfig(budget_ratio=0.25)
    assert cfg.budget_for(1000, RequestOverrides()) == 250
    assert cfg.budget_for(1000, RequestOverrides(sekv_budget_ratio=0.5)) == 500
    assert cfg.budget_for(1000, RequestOverrides(sekv_token_budget=77)) == 77
    assert SeKVConfig(token_budget=300).budget_for(1000, RequestOverrides()) == 300


def test_request_overrides_ignore_other_keys_and_refuse_unknown_sekv_keys():
    assert RequestOverrides.from_extra_args({"session_id": "x"}) == RequestOverrides()
    assert RequestOverrides.from_extra_args({"sekv_compress": 0}).sekv_compress is False
    with pytest.raises(SeKVConfigError, match=r"unknown per-request field\(s\) \['sekv_ratio'\]; allowed: "):
        RequestOverrides.from_extra_args({"sekv_ratio": 0.5})


def test_a_request_sets_its_exact_fallback_for_sekv_only():
    from sekv_vllm.router import ModelShape
    from sekv_vllm.runtime import SeKVRuntime, Status

    assert RequestOverrides.from_extra_args({"sekv_exact_fallback_coverage": 0.8}).sekv_exact_fallback_coverage == 0.8
    with pytest.raises(SeKVConfigError, match="sekv_exact_fallback_coverage: Input should be less than 1"):
        RequestOverrides.from_extra_args({"sekv_exact_fallback_coverage": 1.0})
    with pytest.raises(SeKVConfigError, match="sekv_exact_fallback_coverage is a setting of method 'sekv'"):
        RequestOverrides.from_extra_args({"sekv_exact_fallback_coverage": 0.5, "sekv_method": "snapkv"})
    shape = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    sekv = SeKVRuntime(SeKVConfig(min_prompt_tokens=10), ["l0"], shape)
    assert sekv.admit("a", 500, {"sekv_exact_fallback_coverage": 0.8}).exact_fallback_coverage == 0.8
    assert sekv.admit("b", 500, None).exact_fallback_coverage is None
    # a deployment of another method cannot apply it: the request keeps full KV and says why
    snapkv = SeKVRuntime(SeKVConfig(method="snapkv", min_prompt_tokens=10), ["l0"], shape)
    mem = snapkv.admit("c", 500, {"sekv_exact_fallback_coverage": 0.8})
    assert mem.status is Status.FULL_KV and "deployment's method is 'snapkv'" in mem.reason
