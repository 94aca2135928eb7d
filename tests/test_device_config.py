"""Device, dtype and tensor-parallel configuration: "auto" resolves in the config, bad values fail there,
and the flags reach the dataclasses."""

import pytest
import torch

from dspark.cli import build_parser, engine_config_from_args
from dspark.config import EngineConfig, ParallelConfig, resolve_device, resolve_dtype


def test_auto_resolves_to_a_concrete_device_and_dtype():
    c = EngineConfig()
    assert c.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert c.dtype == ("bfloat16" if c.device == "cuda" else "float32")
    assert EngineConfig(device="cpu").dtype == "float32"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("float16", "cuda") == "float16"
    assert resolve_device("cuda:3") == "cuda:3"


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:1", "", "mps"])
def test_bad_device_is_refused(device):
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device=device)


def test_bad_parallel_config_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_timeout_s"):
        ParallelConfig(distributed_timeout_s=0)


def test_flags_reach_the_config():
    args = build_parser().parse_args(["serve", "-tp", "2", "--device", "cpu", "--distributed-timeout-s", "7"])
    config = engine_config_from_args(args)
    assert config.tensor_parallel_size == 2 and config.parallel.distributed_timeout_s == 7.0
    assert config.device == "cpu" and config.dtype == "float32"
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "3"])
    assert engine_config_from_args(args).tensor_parallel_size == 3
    with pytest.raises(SystemExit, match="device"):
        engine_config_from_args(build_parser().parse_args(["serve", "--device", "tpu"]))
