"""The plugin's flags and start-up validation on vLLM's EngineArgs (no engine is built)."""
import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine_args_cls():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return AsyncEngineArgs


def parse(engine_args_cls, argv):
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = engine_args_cls.add_cli_args(FlexibleArgumentParser())
    return engine_args_cls.from_cli_args(parser.parse_args(argv))


def test_kv_cache_backend_flag_becomes_additional_config(engine_args_cls, model_dir):
    args = parse(engine_args_cls, ["--model", model_dir, "--kv-cache-backend", "sekv",
                                   "--sekv-config", '{"budget_ratio": 0.125}'])
    assert args.additional_config == {"sekv": {"budget_ratio": 0.125}}
    assert parse(engine_args_cls, ["--model", model_dir]).additional_config == {}


def test_sekv_config_without_the_backend_is_refused(engine_args_cls, model_dir):
    with pytest.raises(ValueError, match="--sekv-config needs --kv-cache-backend sekv"):
        parse(engine_args_cls, ["--model", model_dir, "--sekv-config", "{}"])


def test_create_engine_config_validates_and_turns_prefix_caching_off(engine_args_cls, model_dir):
    from sekv_vllm.config import SeKVConfigError

    bad = engine_args_cls(model=model_dir, additional_config={"sekv": {"r_max": 0}})
    with pytest.raises(SeKVConfigError, match=r"sekv\.r_max: Input should be greater than or equal to 1 \(got 0\)"):
        bad.create_engine_config()
    good = engine_args_cls(model=model_dir, dtype="float32", additional_config={"sekv": {}})
    config = good.create_engine_config()
    assert config.cache_config.enable_prefix_caching is False
    assert config.parallel_config.distributed_executor_backend == "uni"  # the worker in the scheduler's process
    assert config.additional_config["sekv"]["budget_ratio"] == 0.25  # normalised: every process sees all fields


def test_a_row_keeping_method_is_normalised_with_its_own_settings_only(engine_args_cls, model_dir):
    from sekv_vllm.config import SeKVConfig, SeKVConfigError

    foreign = engine_args_cls(model=model_dir, additional_config={"sekv": {"method": "snapkv", "r_max": 8}})
    with pytest.raises(SeKVConfigError, match=r"sekv\.r_max: not a setting of method 'snapkv'"):
        foreign.create_engine_config()
    args = engine_args_cls(model=model_dir, dtype="float32",
                           additional_config={"sekv": {"method": "snapkv", "observation_window": 32}})
    settings = args.create_engine_config().additional_config["sekv"]
    assert settings["method_settings"] == {"kv_bits": 16, "kv_quant_group": 32, "observation_window": 32,
                                           "pooling_kernel": 5} and "r_max" not in settings
    assert SeKVConfig.from_additional_config({"sekv": settings}).method == "snapkv"  # what the worker reads


def test_speculative_decoding_is_refused_with_sekv(engine_args_cls, model_dir):
    from sekv_vllm.config import SeKVConfigError

    args = engine_args_cls(model=model_dir, additional_config={"sekv": {}},
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(SeKVConfigError, match="speculative_config: speculative decoding is not supported with sekv"):
        args.create_engine_config()


def test_the_cpp_decode_kernel_with_a_non_float32_cache_is_refused_at_start_up(engine_args_cls, model_dir):
    from sekv_vllm.config import SeKVConfigError

    args = engine_args_cls(model=model_dir, dtype="bfloat16", additional_config={"sekv": {"decode_kernel": "cpp"}})
    with pytest.raises(SeKVConfigError, match=r"sekv\.decode_kernel: 'cpp' needs a float32 KV cache, this one is "
                                              r"torch\.bfloat16; allowed with it: 'auto' or 'torch'"):
        args.create_engine_config()
    ok = engine_args_cls(model=model_dir, dtype="float32", additional_config={"sekv": {"decode_kernel": "cpp"}})
    assert ok.create_engine_config().additional_config["sekv"]["decode_kernel"] == "cpp"


def test_a_worker_in_another_process_is_refused_with_sekv(engine_args_cls, model_dir):
    from sekv_vllm.config import SeKVConfigError

    args = engine_args_cls(model=model_dir, additional_config={"sekv": {}}, distributed_executor_backend="mp")
    with pytest.raises(SeKVConfigError, match="distributed_executor_backend: sekv needs 'uni'"):
        args.create_engine_config()
