"""Damaged drafter and model folders are refused with a `CheckpointError` naming the file and what is wrong
(dspark/models/files.py and its users: drafters/checkpoint.py, dspark_checkpoint.py, eagle3*.py,
models/loader.py), before any module is built:

* config.json that is a JSON list, not JSON, or with a size that is not a positive integer;
* a safetensors shard cut in half, or garbage; a shard of a sharded set cut short;
* calibration.json that is not JSON, a list, or holds a zero temperature;
* an index entry (or a symlink) that leads out of the folder: `../../etc/hostname`, `/etc/hostname`;
* num_hidden_layers 100000: refused from the headers, the module never built;
* a target (or draft-model) HF folder: the same attacks, an inflated intermediate size, generation_config.json a
  list; a GGUF cut short or garbage;
* the `dspark` CLI prints the message, no traceback.

    pytest tests/test_damaged_folders.py -q
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY_LLAMA, hf_twin
from dspark.drafters import build_drafter, check_drafter
from dspark.drafters import dspark_checkpoint
from dspark.drafters.checkpoint import save_weights
from dspark.drafters.dspark import save_dspark
from dspark.drafters.dspark_checkpoint import load_dspark
from dspark.drafters.eagle3 import save_eagle3
from dspark.models import loader
from dspark.models.files import CheckpointError
from dspark.models.loader import SafetensorsSource, read_model_config
from dspark_helpers import TARGET, random_model, random_target, spec, tiny_cfg
from test_eagle3_draft_model import random_eagle3
from test_eagle3_draft_model import random_target as eagle3_target

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory) -> Path:
    """A tiny DSpark drafter checkpoint for TARGET (2 layers, confidence head)."""
    path = tmp_path_factory.mktemp("dspark") / "ok"
    cfg = tiny_cfg(enable_confidence_head=True)
    save_dspark(random_model(cfg), cfg, path, dtype="float32")
    return path


@pytest.fixture
def drafter(drafter_folder, tmp_path) -> Path:
    """A fresh copy of the drafter folder, for one test to damage."""
    return Path(shutil.copytree(drafter_folder, tmp_path / "drafter"))


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    """A tiny HF Llama folder (config.json, generation_config.json, model.safetensors)."""
    path = tmp_path_factory.mktemp("target") / "ok"
    hf_twin(TINY_LLAMA, seed=3).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def target(target_folder, tmp_path) -> Path:
    return Path(shutil.copytree(target_folder, tmp_path / "target"))


def _refused(path: Path, match: str, *, build: bool = False) -> str:
    """The CheckpointError checking (and with `build`, building) the DSpark drafter at `path` raises."""
    s = spec(path, length_policy="threshold")
    with pytest.raises(CheckpointError, match=match) as e:
        check_drafter(s, TARGET)
        if build:
            build_drafter(s, target_config=TARGET, target_model=random_target(), dtype=torch.float32, device="cpu")
    return str(e.value)


def _edit_json(file: Path, **changes) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def _cut(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * keep)])


def _shard(folder: Path, entry: str) -> None:
    """Turn the folder's weights into a one-shard index whose entry is `entry`."""
    (folder / WEIGHTS).rename(folder / "model-00001-of-00001.safetensors")
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"fc.weight": entry}}))


def test_the_undamaged_drafter_loads(drafter):
    (drafter / "calibration.json").write_text(json.dumps({"temperatures": [1.5, 2.0]}))
    s = spec(drafter, length_policy="threshold")
    check_drafter(s, TARGET)
    built = build_drafter(s, target_config=TARGET, target_model=random_target(), dtype=torch.float32, device="cpu")
    assert built.confidence_temperatures[:2].tolist() == [1.5, 2.0]


# -- config.json ---------------------------------------------------------------------------------------

def test_config_that_is_a_json_list(drafter):
    (drafter / "config.json").write_text("[1, 2, 3]")
    msg = _refused(drafter, "expected a JSON object, got a list")
    assert msg.startswith(str(drafter / "config.json"))


def test_config_that_is_not_json(drafter):
    (drafter / "config.json").write_text('{"hidden_size": 32,')
    msg = _refused(drafter, r"not valid JSON \(line 1 col")
    assert msg.startswith(str(drafter / "config.json"))


@pytest.mark.parametrize("value", ["32", 32.0, -32, True, None], ids=["string", "float", "negative", "bool", "null"])
def test_config_size_of_the_wrong_type(drafter, value):
    _edit_json(drafter / "config.json", hidden_size=value)
    msg = _refused(drafter, "hidden_size" if value is not None else "lacks required key 'hidden_size'")
    assert str(drafter / "config.json") in msg


def test_config_with_an_unbuildable_rope_is_named(drafter):
    _edit_json(drafter / "config.json", rope_scaling="yarn")
    assert str(drafter / "config.json") in _refused(drafter, "config.json")


def test_a_hundred_thousand_layers_are_refused_before_any_module_is_built(drafter, monkeypatch):
    _edit_json(drafter / "config.json", num_hidden_layers=100000)

    def no_model(*args, **kwargs):
        raise AssertionError("DSparkModel built for a 100000-layer config")

    monkeypatch.setattr(dspark_checkpoint, "DSparkModel", no_model)
    msg = _refused(drafter, r"num_hidden_layers 100000, but its weights hold 2 layers")
    assert msg.startswith(str(drafter / "config.json"))
    with pytest.raises(CheckpointError, match="num_hidden_layers 100000"):
        load_dspark(drafter, num_target_layers=TARGET.num_hidden_layers)


def test_a_drafter_deeper_than_its_target_is_refused(drafter, monkeypatch):
    monkeypatch.setattr(dspark_checkpoint, "header_shapes", lambda path: {f"layers.{i}.x": [1] for i in range(9)})
    _edit_json(drafter / "config.json", num_hidden_layers=9)
    _refused(drafter, r"config.json: num_hidden_layers 9 exceeds its target's num_hidden_layers 4")


def test_a_hidden_size_that_differs_from_the_target_names_the_file(drafter):
    _edit_json(drafter / "config.json", hidden_size=48)
    assert str(drafter / "config.json") in _refused(drafter, "hidden_size 48 != target hidden_size 32")


# -- safetensors -----------------------------------------------------------------------------------------

def test_shard_cut_in_half(drafter):
    _cut(drafter / WEIGHTS)
    msg = _refused(drafter, "damaged safetensors file .*truncated")
    assert msg.startswith(str(drafter / WEIGHTS))


def test_shard_of_garbage(drafter):
    (drafter / WEIGHTS).write_bytes(os.urandom(4096))
    msg = _refused(drafter, "damaged safetensors file")
    assert msg.startswith(str(drafter / WEIGHTS))


@pytest.mark.parametrize("damage", [lambda f: _cut(f, 0.9), lambda f: f.write_bytes(b"")], ids=["cut", "empty"])
def test_one_shard_of_a_sharded_set_damaged(drafter, damage):
    tensors = dspark_checkpoint.load_tensors(drafter)
    files = save_weights(tensors, drafter, max_shard_bytes=16 << 10)
    assert len(files) > 2
    damage(files[1])
    assert _refused(drafter, "damaged safetensors file").startswith(str(files[1]))


def test_a_tensor_of_an_unknown_dtype(drafter):
    data = (drafter / WEIGHTS).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].replace(b'"F32"', b'"X9"', 1)
    (drafter / WEIGHTS).write_bytes(data[:8] + header + data[8 + n:])
    assert _refused(drafter, "unknown variant").startswith(str(drafter / WEIGHTS))


# -- calibration.json ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, match", [("temperatures: 1.5", "not valid JSON"),
                                         ("[1.5, 2.0]", "expected a JSON object, got a list"),
                                         ('{"temperatures": [1.5, 0]}', "temperatures must be a list of positive"),
                                         ('{"biases": "up"}', "biases must be a list of finite numbers")],
                         ids=["not-json", "list", "zero-temperature", "string-biases"])
def test_calibration_refused_before_any_weight(drafter, text, match):
    (drafter / "calibration.json").write_text(text)
    assert _refused(drafter, match).startswith(str(drafter / "calibration.json"))


# -- paths out of the folder ---------------------------------------------------------------------------

@pytest.mark.parametrize("entry, match", [("../../etc/hostname", "resolves to .*, outside"),
                                          ("/etc/hostname", "is an absolute path"),
                                          ("missing.safetensors", "no such file"),
                                          (".", "is not a regular file"),
                                          (7, "is not a file name")],
                         ids=["dotdot", "absolute", "missing", "folder", "number"])
def test_index_entries_stay_inside_the_folder(drafter, entry, match):
    _shard(drafter, entry)
    msg = _refused(drafter, match)
    assert msg.startswith(f"{drafter / INDEX}: entry {entry!r}")


def test_index_that_is_not_an_object_of_names(drafter):
    _shard(drafter, "model-00001-of-00001.safetensors")
    (drafter / INDEX).write_text(json.dumps({"weight_map": ["model-00001-of-00001.safetensors"]}))
    assert _refused(drafter, "weight_map must be").startswith(str(drafter / INDEX))


def test_symlink_out_of_the_folder(drafter, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    (drafter / WEIGHTS).rename(outside)
    (drafter / WEIGHTS).symlink_to(outside)
    _refused(drafter, f"{drafter / WEIGHTS} resolves to .*, outside")


def test_hub_snapshot_links_into_its_blobs_are_read(drafter_folder, tmp_path):
    """An HF hub cache folder: snapshots/<rev>/<file> are links to ../../blobs/<hash>."""
    repo = tmp_path / "models--x--drafter"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(drafter_folder.iterdir())):
        shutil.copy(file, repo / "blobs" / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    check_drafter(spec(snapshot, length_policy="threshold"), TARGET)


# -- EAGLE-3 ---------------------------------------------------------------------------------------------

def test_eagle3_folder_damage_is_named(tmp_path):
    target = eagle3_target()
    model = random_eagle3(target)
    path = tmp_path / "eagle3"
    save_eagle3(model, model.config, str(path))
    s = spec(path, method="eagle3", n=3)
    target_config = target.config
    check_drafter(s, target_config)
    (path / "config.json").write_text("[]")
    with pytest.raises(CheckpointError, match="config.json: expected a JSON object, got a list"):
        check_drafter(s, target_config)
    save_eagle3(model, model.config, str(path))
    _cut(path / WEIGHTS)
    with pytest.raises(CheckpointError, match=f"{path / WEIGHTS}: damaged safetensors file"):
        check_drafter(s, target_config)


# -- target folders --------------------------------------------------------------------------------------

def test_the_undamaged_target_reads(target):
    assert read_model_config(target) == SafetensorsSource(target).config


@pytest.mark.parametrize("text, match", [("[]", "expected a JSON object, got a list"),
                                         ("{", "not valid JSON"),
                                         ('{"architectures": ["LlamaForCausalLM"]}', "lacks 'num_attention_heads'")],
                         ids=["list", "not-json", "missing-key"])
def test_target_config_refused_by_name(target, text, match):
    (target / "config.json").write_text(text)
    for read in (read_model_config, SafetensorsSource):
        with pytest.raises(CheckpointError, match=match) as e:
            read(target)
        assert str(e.value).startswith(str(target / "config.json"))


def test_target_with_a_hundred_thousand_layers_builds_nothing(target, monkeypatch):
    _edit_json(target / "config.json", num_hidden_layers=100000)

    def no_model(*args, **kwargs):
        raise AssertionError("model built for a 100000-layer config")

    monkeypatch.setattr(loader, "build_model", no_model)
    (target / "tokenizer_config.json").write_text("{}")  # past load_model's tokenizer check, to the config's
    for read in (read_model_config, SafetensorsSource, loader.load_model):
        with pytest.raises(CheckpointError, match="config.json: num_hidden_layers 100000, but its weights hold 3"):
            read(target)


def test_target_with_inflated_sizes_is_refused_before_allocation(target):
    _edit_json(target / "config.json", intermediate_size=1 << 24)
    with pytest.raises(CheckpointError, match=r"config.json: its sizes \(.*intermediate_size 16777216"):
        SafetensorsSource(target)


def test_target_shard_damage_and_escapes(target):
    _cut(target / WEIGHTS)
    with pytest.raises(CheckpointError, match=f"{target / WEIGHTS}: damaged safetensors file .*truncated"):
        read_model_config(target)
    _shard(target, "../../etc/hostname")
    for read in (read_model_config, SafetensorsSource):
        with pytest.raises(CheckpointError, match=f"{target / INDEX}: entry '../../etc/hostname' resolves to"):
            read(target)


def test_target_generation_config_that_is_a_list(target):
    (target / "generation_config.json").write_text("[2]")
    with pytest.raises(CheckpointError, match="generation_config.json: expected a JSON object, got a list"):
        read_model_config(target)


def test_draft_model_folder_damage_is_named(target):
    _edit_json(target / "config.json", num_hidden_layers=100000)
    with pytest.raises(CheckpointError, match=f"{target / 'config.json'}: num_hidden_layers 100000"):
        check_drafter(spec(target, method="draft_model", n=3), TINY_LLAMA)


def test_gguf_cut_short_is_named(tmp_path):
    from conftest import _require
    from dspark.models.gguf_format import _gguf_reader
    gguf = _require(loader.resolve_model_path, "default")
    with open(gguf, "rb") as f:
        head = f.read(4096)
    for name, data in (("cut.gguf", head), ("garbage.gguf", os.urandom(4096))):
        (tmp_path / name).write_bytes(data)
        _gguf_reader.cache_clear()
        with pytest.raises(CheckpointError, match=f"{tmp_path / name}: damaged GGUF file"):
            read_model_config(tmp_path / name)


# -- the CLI ---------------------------------------------------------------------------------------------

def test_cli_prints_the_message_not_a_traceback(target, drafter, capsys):
    from dspark.cli import main
    (drafter / "calibration.json").write_text("[]")
    hf_twin(TARGET, seed=1).save_pretrained(target, safe_serialization=True)  # the drafter's target
    args = ["generate", "hi", "--model", str(target), "--device", "cpu",
            "--speculative-config", json.dumps({"method": "dspark", "model": str(drafter),
                                                "num_speculative_tokens": 3})]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert str(e.value) == (f"error: --speculative-config: {drafter / 'calibration.json'}: expected a JSON "
                            "object, got a list")
    (target / "config.json").write_text("[]")
    with pytest.raises(SystemExit) as e:
        main(args)
    assert str(e.value) == f"error: {target / 'config.json'}: expected a JSON object, got a list"


def test_sampling_defaults_from_a_generation_config_that_is_not_an_object(tmp_path):
    """`--generation-config` (the sampling defaults) reads the file too: a list or bytes that are not UTF-8 JSON are
    refused naming it."""
    from dspark.generation_config import sampling_defaults
    for data in (b"[2]", b"\xff\xfe"):
        (tmp_path / "generation_config.json").write_bytes(data)
        with pytest.raises(ValueError, match="generation_config.json"):
            sampling_defaults(str(tmp_path), "unused")
