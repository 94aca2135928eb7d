"""vLLM's command line and engine arguments as dspark reads them: the flags generated from the config
dataclasses, size suffixes, refused flags naming themselves, the speculative config in vLLM's schema
(JSON and dotted form, inferred method and block, n-gram defaults, mapped keys) and `LLM(**engine_args)`
keyword handling. No model is loaded here."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dspark.cli import build_parser, main
from dspark.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpecConfig
from dspark.drafters.shipped import ASSETS
from dspark.engine_args import (REFUSED_FLAGS, SHORT_REFUSED, config_from_kwargs, expand_dotted,
                                json_flags, options)
from dspark.server.cli import configs_from_args
from dspark.server.config import ServerConfig
from dspark.utils.options import human_int

VLLM_LAUNCH = [
    "serve", "--model", "SmolLM2-135M-Instruct", "--host", "0.0.0.0", "--port", "8011",
    "--api-key", "k1", "k2", "--served-model-name", "smol", "other", "--max-model-len", "32K",
    "--max-num-seqs", "8", "--max-num-batched-tokens", "2k", "--no-enable-prefix-caching",
    "--block-size", "32", "--kv-cache-memory-bytes", "256M", "--dtype", "half", "--seed", "7",
    "--chat-template", "{{ messages }}", "--generation-config", "vllm", "--disable-log-requests",
    "--uvicorn-log-level", "warning", "--disable-log-stats", "--max-logprobs", "5",
    "--tensor-parallel-size", "1", "--trust-remote-code", "--enforce-eager",
    "--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "3"]


def parse(argv):
    return build_parser().parse_args(expand_dotted(list(argv), json_flags(EngineConfig)))


def test_vllm_launch_line_maps_onto_the_configs():
    config, server = configs_from_args(parse(VLLM_LAUNCH))
    assert config.model == "SmolLM2-135M-Instruct" and config.dtype == "float16" and config.seed == 7
    assert config.cache == CacheConfig(kv_block_size=32, kv_cache_memory_bytes=256 * 2**20,
                                       enable_prefix_caching=False)
    assert config.scheduler == SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2000, max_model_len=32768)
    assert (config.max_logprobs, config.generation_config, config.trust_remote_code,
            config.enforce_eager, config.tensor_parallel_size) == (5, "vllm", True, True, 1)
    assert config.device == "cpu"  # auto, on this machine
    assert config.spec == SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=5,
                                     prompt_lookup_max=5)
    assert server == ServerConfig(host="0.0.0.0", port=8011, api_key=("k1", "k2"),
                                  served_model_name=("smol", "other"), chat_template="{{ messages }}",
                                  enable_log_requests=False, uvicorn_log_level="warning",
                                  disable_log_stats=True)


def test_dspark_spellings_stay_aliases():
    config, server = configs_from_args(parse([
        "serve", "m", "--kv-block-size", "8", "--kv-cache-memory-gb", "0.5", "--no-prefix-caching",
        "--log-level", "debug", "--num-gpu-blocks-override", "40", "--speculative-config", "none"]))
    assert config.model == "m" and config.spec is None
    assert config.cache == CacheConfig(kv_block_size=8, kv_cache_memory_bytes=2**29, num_kv_blocks=40,
                                       enable_prefix_caching=False)
    assert server.uvicorn_log_level == "debug"
    config, _ = configs_from_args(parse(["serve", "m", "--enable-prefix-caching", "--speculative-config", "off"]))
    assert config.cache.enable_prefix_caching


def test_every_config_field_is_a_flag_once():
    """The generator covers every field of the dataclasses (a new field is a flag without more code)."""
    engine = {o.path for o in options(EngineConfig)}
    nested = {(name, f.name) for name, cls in (("cache", CacheConfig), ("scheduler", SchedulerConfig),
                                               ("parallel", ParallelConfig)) for f in dataclasses.fields(cls)}
    top = {(f.name,) for f in dataclasses.fields(EngineConfig) if f.name not in ("cache", "scheduler", "parallel")}
    assert engine == nested | top
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    from dspark.server.cli import register
    register(sub)
    flags = set(sub.choices["serve"]._option_string_actions)
    for o in options(EngineConfig) + options(ServerConfig):
        assert o.flags[0] in flags, o.name


@pytest.mark.parametrize("text,value", [("4096", 4096), ("4k", 4000), ("4K", 4096), ("32K", 32768),
                                        ("25.6k", 25600), ("1G", 2**30), ("2m", 2_000_000)])
def test_human_int(text, value):
    assert human_int(text) == value


@pytest.mark.parametrize("text", ["4.5K", "k4", "four", "4kb"])
def test_human_int_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_int(text)


REFUSED = sorted(REFUSED_FLAGS) + sorted(SHORT_REFUSED)


@pytest.mark.parametrize("flag", REFUSED)
def test_every_refused_flag_names_itself(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} is not supported by dspark" in err, err


@pytest.mark.parametrize("argv,flag", [
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"), (["-tp", "-1"], "--tensor-parallel-size"),
    (["--max-model-len", "4.5K"], "--max-model-len"), (["--dtype", "int8"], "--dtype"),
    (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens"), (["--block-size", "0"], "--block-size"),
    (["--speculative-config", "{bad"], "--speculative-config"), (["--port", "70000", "--speculative-config", "none"], "--port"),
    (["--speculative-config.method", "medusa"], "--speculative-config"),
])
def test_bad_values_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        configs_from_args(parse(["serve", *argv]))
    message = str(e.value.code) + capsys.readouterr().err
    assert flag in message, message


def test_unknown_flag_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--no-such-flag", "1"])
    assert "--no-such-flag" in capsys.readouterr().err


# -- speculative config ----------------------------------------------------------------------------
def test_dotted_form_merges_with_json():
    argv = expand_dotted(["serve", "--speculative-config", '{"method": "ngram"}',
                          "--speculative-config.prompt_lookup_max=4", "--speculative-config.num-speculative-tokens",
                          "2"], ("--speculative-config",))
    assert argv[:1] == ["serve"] and argv[1] == "--speculative-config"
    assert SpecConfig.from_dict(argv[2]) == SpecConfig(method="ngram", num_speculative_tokens=2,
                                                       prompt_lookup_min=4, prompt_lookup_max=4)


@pytest.mark.parametrize("folder,method", [("dspark-smollm2-135m", "dspark"), ("dflash-smollm2-135m", "dflash"),
                                           ("eagle3-smollm2-135m", "eagle3")])
def test_method_and_block_inferred_from_the_drafter(folder, method):
    spec = SpecConfig.from_dict({"model": str(ASSETS / folder)})
    assert (spec.method, spec.num_speculative_tokens) == (method, 7)


def test_inferred_block_follows_the_checkpoint(tmp_path):
    import json
    cfg = json.loads((ASSETS / "dspark-smollm2-135m" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "block_size": 4}))
    assert SpecConfig.from_dict({"model": str(tmp_path)}).num_speculative_tokens == 4
    assert SpecConfig.from_dict({"method": "dspark", "model": str(tmp_path)}).num_speculative_tokens == 4
    spec = SpecConfig.from_dict({"method": "dspark", "model": str(tmp_path), "num_speculative_tokens": 2})
    assert spec.num_speculative_tokens == 2


def test_ngram_lookup_defaults_are_vllms():
    assert (SpecConfig.from_dict({"method": "ngram"}).prompt_lookup_min,
            SpecConfig.from_dict({"method": "ngram"}).prompt_lookup_max) == (5, 5)
    one = SpecConfig.from_dict({"method": "[ngram]", "prompt_lookup_max": 3})
    assert (one.method, one.prompt_lookup_min, one.prompt_lookup_max) == ("ngram", 3, 3)
    other = SpecConfig.from_dict({"method": "ngram", "prompt_lookup_min": 2})
    assert (other.prompt_lookup_min, other.prompt_lookup_max) == (2, 2)


def test_vllm_keys_are_mapped():
    d = {"method": "dspark", "model": str(ASSETS / "dspark-smollm2-135m"), "cost_table": "c.json"}
    assert SpecConfig.from_dict({**d, "enable_adaptive_verification": True}).length_policy == "prefix"
    assert SpecConfig.from_dict({**d, "enable_adaptive_verification": False}).length_policy == "fixed"
    same = SpecConfig.from_dict({**d, "draft_tensor_parallel_size": 1, "rejection_sample_method": "standard",
                                 "dspark_draft_topk": "off"})
    assert same == SpecConfig.from_dict(d)
    assert SpecConfig.from_dict({**d, "dspark_draft_topk": 4}).draft_topk == 4  # top-K Markov candidates


@pytest.mark.parametrize("key,value", [("draft_tensor_parallel_size", 2), ("rejection_sample_method", "typical"),
                                       ("dspark_draft_topk", -1), ("dspark_draft_topk", "all"),
                                       ("enable_adaptive_verification", "yes")])
def test_vllm_keys_refuse_what_is_not_there(key, value):
    with pytest.raises(ValueError, match=key):
        SpecConfig.from_dict({"method": "ngram", key: value})


def test_adaptive_verification_conflict_is_named():
    with pytest.raises(ValueError, match="length_policy"):
        SpecConfig.from_dict({"method": "ngram", "enable_adaptive_verification": True, "length_policy": "fixed"})


def test_unknown_keys_list_the_valid_ones():
    with pytest.raises(ValueError) as e:
        SpecConfig.from_dict({"method": "ngram", "disable_by_batch_size": 4})
    message = str(e.value)
    assert "disable_by_batch_size" in message
    for key in ("num_speculative_tokens", "prompt_lookup_min", "enable_adaptive_verification", "dspark_draft_topk"):
        assert key in message


# -- LLM(**engine_args) ----------------------------------------------------------------------------
def test_engine_kwargs_in_vllm_and_dspark_spellings():
    config = config_from_kwargs(EngineConfig, {
        "model": "m", "max_model_len": "4k", "block_size": 8, "enable_prefix_caching": False,
        "kv_cache_memory_bytes": "1G", "dtype": "auto", "tensor_parallel_size": 1, "trust_remote_code": True,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    assert config.scheduler.max_model_len == 4000 and config.cache.kv_block_size == 8
    assert config.cache.kv_cache_memory_bytes == 2**30 and not config.cache.enable_prefix_caching
    assert config.dtype == "float32" and config.spec.method == "ngram"
    old = config_from_kwargs(EngineConfig, {"kv_block_size": 8, "kv_cache_memory_gb": 2})
    assert (old.cache.kv_block_size, old.cache.kv_cache_memory_bytes) == (8, 2 * 2**30)


def test_unknown_and_refused_kwargs_are_type_errors_naming_them():
    with pytest.raises(TypeError, match="bogus_a, bogus_b"):
        config_from_kwargs(EngineConfig, {"bogus_b": 1, "bogus_a": 2, "seed": 1})
    with pytest.raises(TypeError, match="swap_space"):
        config_from_kwargs(EngineConfig, {"swap_space": 4})
    with pytest.raises(TypeError, match="block_size"):
        config_from_kwargs(EngineConfig, {"block_size": 8, "kv_block_size": 16})
    from dspark.llm import LLM
    with pytest.raises(TypeError, match="LLM\\(\\) got unexpected keyword argument\\(s\\): nope"):
        LLM(nope=1)
