"""DSpark / DFlash checkpoints: read (ours, DeepSpec's, vLLM Speculators', the GGUF files llama.cpp's converter
writes: `gguf_drafters.py`), check against the target before any weight loads, load, save.

`check` reads config.json and the safetensors headers only (every tensor name and shape against the model
the config describes), so `engine/build.py` fails before the target's weights load. The frozen embedding and
LM head: a checkpoint without them takes the target's (aliased, no copy); a checkpoint whose copies hold the
target's values (up to its dtype's rounding) takes the target's too; a checkpoint whose copies differ keeps its
own (logged, with the largest difference): the drafter was trained with them. A reduced-vocabulary LM head is
always the checkpoint's own. Calibration: an optional `calibration.json` beside the weights
({"temperatures": [T_k]} and optionally "greedy_temperatures", "biases", "greedy_biases").

The draft network is a record (`DraftNetwork`, `DRAFT_NETWORKS`, keyed by `DSparkConfig.draft_layers`): Qwen3-style
layers (`DSparkModel`, DeepSpec's Qwen3 DSpark / DFlash and everything dspark trains) or Gemma 4 layers
(`gemma4_dspark.Gemma4DSparkModel`), whose HF config.json, named by its architecture, is read into `DSparkConfig`
keys and whose tensor names are mapped to ours by the record, for a folder and a GGUF file alike.

`d2t` is written as offsets with `"d2t_format": "offset"` in config.json and read in either convention
(`vocab.py`); a full-vocabulary checkpoint can be given a reduced vocabulary at load (spec "draft_vocab_size":
`load_dspark(draft_vocab=)` keeps those rows of the LM head and of Markov W2).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dspark.drafters.checkpoint import (DTYPE_NAMES, check_shapes, config_file, header_shapes, load_tensors,
                                        read_config, same_weights, save_weights, write_json)
from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.dspark_model import DSparkModel
from dspark.drafters.gemma4_dspark import (ARCHITECTURE as GEMMA4_ARCHITECTURE, Gemma4DSparkModel,
                                           gemma4_dspark_json, gemma4_dspark_tensor_name)
from dspark.drafters.formats import (checkpoint_format, header_shapes_speculators, names_target_depth,
                                     speculators_dspark_json, speculators_tensors)
from dspark.drafters.vocab import (D2T_FORMAT_KEY, MAP_NAMES, WRITTEN_FORMAT, draft_vocab_at_load, read_d2t,
                                   slices_at_load, to_offsets)
from dspark.models.files import (CONFIG_ERRORS, CheckpointError, check_num_layers, check_sizes, config_error,
                                 folder_file, read_json_object)

log = logging.getLogger(__name__)

CALIBRATION_NAME = "calibration.json"
CALIBRATION_KEYS = ("temperatures", "biases", "greedy_temperatures", "greedy_biases")
HEAD_PREFIXES = ("markov_head.", "confidence_head.")
CONFIDENCE_POLICIES = ("threshold", "prefix", "async")


@dataclass(frozen=True)
class DraftNetwork:
    model: type[DSparkModel]  # the network of configs with these draft layers
    architectures: tuple[str, ...] = ()  # config.json architectures read through `config_json`
    config_json: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # → from_deepspec_json keys
    tensor_name: Callable[[str], str] | None = None  # its checkpoints' tensor names → ours


DRAFT_NETWORKS: dict[str, DraftNetwork] = {
    "qwen3": DraftNetwork(DSparkModel),
    "gemma4": DraftNetwork(Gemma4DSparkModel, (GEMMA4_ARCHITECTURE,), gemma4_dspark_json, gemma4_dspark_tensor_name),
}


def network_of(d: dict[str, Any]) -> DraftNetwork | None:
    """The record whose HF architecture a config.json names (None: DeepSpec's / dspark's own keys)."""
    names = d.get("architectures") or []
    return next((n for n in DRAFT_NETWORKS.values() if any(a in n.architectures for a in names)), None)


def build_network(cfg: DSparkConfig) -> DSparkModel:
    """The network `cfg` describes (its `draft_layers`' record), built on the current default device."""
    return DRAFT_NETWORKS[cfg.draft_layers].model(cfg)


def _our_names(d: dict[str, Any], named: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's {name: tensor or shape} under our names (its network's mapping, where it has one)."""
    network = network_of(d)
    if network is None or network.tensor_name is None:
        return named
    return {network.tensor_name(k): v for k, v in named.items()}


def read_dspark_config(path: str | Path, *, num_target_layers: int | None = None) -> DSparkConfig:
    """The DSparkConfig of a checkpoint folder in any format; `num_target_layers` (the target's depth) fills
    in what a Speculators config does not say."""
    d = read_config(path)
    fmt = checkpoint_format(d)
    if fmt in ("deepspec-eagle3", "speculators-eagle3"):
        raise ValueError(f"drafter checkpoint {str(path)!r} is an EAGLE-3 checkpoint ({fmt}): use method 'eagle3'")
    if not names_target_depth(fmt) and num_target_layers is None:
        raise ValueError(f"drafter checkpoint {str(path)!r} ({fmt}) does not name the target's depth; "
                         "load it against a target")
    file = config_file(path)
    try:
        if fmt.startswith("speculators-"):
            d = speculators_dspark_json(d, num_target_layers=num_target_layers)
        elif not names_target_depth(fmt):
            d = {**d, "num_target_layers": num_target_layers}
        check_sizes(d, file=file)
        network = network_of(d)
        if network is not None and network.config_json is not None:
            d = network.config_json(d)
            if "num_target_layers" not in d and num_target_layers is not None:
                d["num_target_layers"] = num_target_layers  # (the file does not say: its target's)
        return DSparkConfig.from_deepspec_json(d)
    except CONFIG_ERRORS as e:
        raise config_error(file, e) from None


def check(spec, target_config) -> None:
    """Validate the checkpoint's config.json and safetensors headers against the target and the spec; reads
    no weight."""
    cfg = read_dspark_config(spec.model, num_target_layers=target_config.num_hidden_layers)
    check_config(cfg, spec=spec, target_config=target_config, file=config_file(spec.model))
    check_header(spec.model, cfg, drop_heads=spec.method == "dflash")
    where = f"drafter checkpoint {str(spec.model)!r}"
    read_d2t(spec.model, vocab_size=cfg.vocab_size, where=where)  # the map alone: refused before any weight
    slices_at_load(spec, target_config, checkpoint_draft_vocab=cfg.draft_vocab_size, where=where)
    calibration = folder_file(spec.model, CALIBRATION_NAME)
    if calibration.is_file():
        read_calibration(calibration)


def spec_draft_vocab(spec, target_config) -> torch.Tensor | None:
    """The target ids spec "draft_vocab_size" keeps of a full-vocabulary checkpoint (None: none sliced)."""
    cfg = read_dspark_config(spec.model, num_target_layers=target_config.num_hidden_layers)
    return draft_vocab_at_load(spec, target_config, checkpoint_draft_vocab=cfg.draft_vocab_size,
                               where=f"drafter checkpoint {str(spec.model)!r}")


def expected_shapes(cfg: DSparkConfig) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(required, optional) tensor shapes of a checkpoint of `cfg`: the frozen embedding and a full-vocabulary
    LM head are optional (the target's are used)."""
    with torch.device("meta"):
        state = build_network(cfg).state_dict()
    shapes = {k: list(v.shape) for k, v in state.items()}
    optional = {"embed_tokens.weight": shapes.pop("embed_tokens.weight")}
    if cfg.draft_vocab_size is None:
        optional["lm_head.weight"] = shapes.pop("lm_head.weight")
    return shapes, optional


def check_depth(path: str | Path, cfg: DSparkConfig, shapes: dict[str, list[int]]) -> None:
    """num_hidden_layers against the layers the weights hold and the depth of the target (`check_config`: the
    target's own), before any module of that many layers is built."""
    check_num_layers(cfg.num_hidden_layers, shapes, file=config_file(path), limit=cfg.num_target_layers,
                     limit_what="its target's num_hidden_layers")


def check_header(path: str | Path, cfg: DSparkConfig, *, drop_heads: bool = False) -> None:
    """Every tensor name and shape in the safetensors headers against the model `cfg` describes."""
    d = read_config(path)
    shapes = _our_names(d, header_shapes(path))
    check_depth(path, cfg, shapes)
    if checkpoint_format(d).startswith("speculators-"):
        shapes = header_shapes_speculators(shapes)
    if drop_heads:
        shapes = {k: v for k, v in shapes.items() if not k.startswith(HEAD_PREFIXES)}
        cfg = without_heads(cfg)
    try:
        required, optional = expected_shapes(cfg)
    except CONFIG_ERRORS as e:  # a config no module is built from (an unknown rope_scaling type, ...)
        raise config_error(config_file(path), e) from None
    check_shapes(required, shapes, optional=optional, where=f"drafter checkpoint {str(path)!r}")


def check_config(cfg: DSparkConfig, *, spec, target_config, file: str | Path = "drafter config.json") -> None:
    """Every drafter/target/spec mismatch as a ValueError naming the field and both values (the sizes also the
    config `file`)."""
    for name in ("vocab_size", "hidden_size"):
        mine, theirs = getattr(cfg, name), getattr(target_config, name)
        if mine != theirs:
            raise CheckpointError(f"{file}: drafter {name} {mine} != target {name} {theirs}")
    if cfg.block_size > target_config.max_position_embeddings:  # each proposal holds a block of ids
        raise CheckpointError(f"{file}: block_size {cfg.block_size} exceeds the target's max_position_embeddings "
                              f"{target_config.max_position_embeddings}")
    num_layers = target_config.num_hidden_layers
    for i in cfg.tap_layer_ids:
        if not -1 <= i < num_layers - 1:
            raise ValueError(f"drafter tap layer id {i} (target_layer_ids {list(cfg.tap_layer_ids)}) "
                             f"out of range [-1, {num_layers - 1}) for the {num_layers}-layer target "
                             "(the final layer is forbidden)")
    if cfg.num_target_layers != num_layers:
        raise ValueError(f"drafter num_target_layers {cfg.num_target_layers} != target "
                         f"num_hidden_layers {num_layers}")
    if spec.num_speculative_tokens > cfg.max_draft_tokens:
        raise ValueError(f"num_speculative_tokens {spec.num_speculative_tokens} > the drafter's "
                         f"{cfg.max_draft_tokens} drafts per block (block_size {cfg.block_size}, "
                         f"{cfg.slot_layout} layout)")
    if spec.draft_topk and (spec.method != "dspark" or cfg.markov_rank == 0):
        raise ValueError(f"draft_topk {spec.draft_topk} applies to a Markov head (method 'dspark'); "
                         f"method {spec.method!r} with markov_rank {cfg.markov_rank} has none: set draft_topk 0")
    if spec.method == "dspark" and cfg.markov_rank == 0:
        raise ValueError("method 'dspark' needs a Markov head but the checkpoint has markov_rank 0; "
                         "use method 'dflash'")
    has_conf = cfg.enable_confidence_head and spec.method == "dspark"
    if spec.length_policy in CONFIDENCE_POLICIES and not has_conf:
        raise ValueError(f"length_policy {spec.length_policy!r} needs a confidence head; method "
                         f"{spec.method!r} with enable_confidence_head={cfg.enable_confidence_head} "
                         "has none")


def without_heads(cfg: DSparkConfig) -> DSparkConfig:
    """The DFlash view of a DSpark config: Markov and confidence heads off."""
    return dataclasses.replace(cfg, markov_rank=0, enable_confidence_head=False)


def target_shared_weights(target_model) -> tuple[torch.Tensor | torch.nn.Module, torch.Tensor | torch.nn.Module]:
    """(embedding [vocab, hidden], LM head [vocab, hidden]) of a dspark.models target: their weights, or where
    the target holds one only as blocks (resident as quantized, `layers.drop_dense_weights`) its module
    (`DSparkModel.share_target_weights` then uses the module itself)."""
    embed, head = target_model.model.embed_tokens, target_model.lm_head
    return (embed if embed.weight is None else embed.weight), (head if head.weight is None else head.weight)


def load_dspark(path: str | Path, *, target_model=None, embed_weight: torch.Tensor | None = None,
                lm_head_weight: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", drop_heads: bool = False,
                num_target_layers: int | None = None, draft_vocab: torch.Tensor | None = None
                ) -> tuple[DSparkModel, dict[str, list[float]] | None]:
    """Build a DSparkModel from a checkpoint folder → (model, calibration or None).

    The frozen embedding / LM head come from the target (`target_model`, or explicit weights) where the
    checkpoint has none or holds the target's values; a checkpoint's own differing copies are kept (see the
    module docstring). `drop_heads` loads a DSpark checkpoint as DFlash. `num_target_layers` defaults to the
    target's depth (Speculators checkpoints do not store it). `draft_vocab` (target ids, ascending) gives a
    full-vocabulary checkpoint that reduced vocabulary: its LM head rows (the target's or its own) and Markov W2
    rows at those ids (`vocab.draft_vocab_at_load`). The stored d2t is read and checked before any weight."""
    if target_model is not None:
        embed_weight, lm_head_weight = target_shared_weights(target_model)
        if num_target_layers is None:
            num_target_layers = len(target_model.model.layers)
    cfg = read_dspark_config(path, num_target_layers=num_target_layers)
    where = f"drafter checkpoint {str(path)!r}"
    d2t = read_d2t(path, vocab_size=cfg.vocab_size, where=where)  # absolute target ids, or None
    if draft_vocab is not None:
        if cfg.draft_vocab_size is not None:
            raise ValueError(f"draft_vocab_size {draft_vocab.numel()}: {where} already has a {cfg.draft_vocab_size}"
                             "-token d2t; a reduced vocabulary is chosen at load for a full-vocabulary one only")
        d2t = draft_vocab.long().cpu()
        cfg = dataclasses.replace(cfg, draft_vocab_size=d2t.numel())
    if drop_heads:
        cfg = without_heads(cfg)
    d = read_config(path)
    check_depth(path, cfg, _our_names(d, header_shapes(path)))
    with torch.device("meta"):
        model = build_network(cfg).to(dtype)  # no memory until the checkpoint's tensors are assigned
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tensors = _our_names(d, load_tensors(path, skip=(HEAD_PREFIXES if drop_heads else ()) + MAP_NAMES, device=device))
    if drop_heads:  # (also those whose names were mapped to the heads')
        tensors = {k: v for k, v in tensors.items() if not k.startswith(HEAD_PREFIXES)}
    if checkpoint_format(d).startswith("speculators-"):
        tensors = speculators_tensors(tensors, where=where)
    share = {}
    for key, target_w in (("embed_tokens.weight", embed_weight), ("lm_head.weight", lm_head_weight)):
        in_ckpt = tensors.get(key)
        own_rows = key == "lm_head.weight" and cfg.draft_vocab_size is not None and draft_vocab is None
        if target_w is None or own_rows:
            continue
        dense = None if in_ckpt is None else target_w if isinstance(target_w, torch.Tensor) else target_w.dense_weight()
        if in_ckpt is not None and not same_weights(in_ckpt, dense):
            if tuple(in_ckpt.shape) == tuple(dense.shape):
                diff = (in_ckpt.float() - dense.detach().float().to(in_ckpt.device)).abs().max().item()
                log.warning("%s: its %s differs from the target's (max |diff| %.3g): the checkpoint's own is used",
                            where, key, diff)
            continue  # its own (a shape mismatch fails in check_shapes below, naming both shapes)
        tensors.pop(key, None)
        expected.pop(key)
        share[key] = target_w
    if draft_vocab is not None:  # the kept rows of a full-vocabulary checkpoint's own head and Markov W2
        for key in ("lm_head.weight", "markov_head.markov_w2.weight"):
            if key in tensors:
                tensors[key] = tensors[key][d2t.to(tensors[key].device)]
    if d2t is not None:
        tensors["d2t"] = d2t.to(device)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    check_shapes(expected, {k: t.shape for k, t in tensors.items()}, where=where)
    model.load_state_dict(tensors, strict=False, assign=True)
    model.reset_buffers(d2t=tensors.get("d2t"), device=device)
    model.share_target_weights(embed_weight=share.get("embed_tokens.weight"),
                               lm_head_weight=share.get("lm_head.weight"))
    for p in model.parameters():
        if p.is_meta:
            raise ValueError("drafter checkpoint left a parameter unfilled")
    for module in (model.embed_tokens, model.lm_head):
        if module.weight is not None:
            module.weight.requires_grad_(False)
    calibration = folder_file(path, CALIBRATION_NAME)
    temps = read_calibration(calibration) if calibration.is_file() else None
    return model.to(device=device), temps


def read_calibration(path: str | Path) -> dict[str, list[float]]:
    """calibration.json → {"temperatures": [T_k] (sampling requests), "greedy_temperatures": [T_k]
    (greedy requests; absent when one fit serves both), and the optional shifts "biases" /
    "greedy_biases" [b_k]}. Each is a list of finite numbers, the temperatures positive."""
    data = read_json_object(path)
    out = {}
    for key in (k for k in CALIBRATION_KEYS if k in data):
        values, positive = data[key], "temperatures" in key
        if not (isinstance(values, list) and all(_finite(v) and (v > 0 or not positive) for v in values)):
            raise CheckpointError(f"{path}: {key} must be a list of {'positive' if positive else 'finite'} numbers, "
                                  f"got {values!r:.80}")
        out[key] = [float(v) for v in values]
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def save_dspark(model: DSparkModel, cfg: DSparkConfig, path: str | Path, *, dtype: str = "bfloat16",
                include_shared: bool = False, max_shard_bytes: int | None = None) -> None:
    """Write config.json + model.safetensors (float tensors in `dtype`; with `max_shard_bytes`, shards of at most
    that size and an index). The frozen embedding and a full-vocab LM head are left out unless `include_shared`
    (loading takes them from the target); a reduced-vocab LM head and `d2t` are always written, `d2t` as offsets
    (target id = draft id + d2t[draft id], `"d2t_format": "offset"` in config.json: what vLLM, SGLang and
    llama.cpp read)."""
    if cfg != model.cfg:
        raise ValueError("save_dspark: cfg differs from model.cfg")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} unknown; choose from {', '.join(DTYPE_NAMES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if not include_shared:
        state.pop("embed_tokens.weight")
        if cfg.draft_vocab_size is None:
            state.pop("lm_head.weight")
    extra = {}
    if "d2t" in state:
        state["d2t"] = to_offsets(state["d2t"])
        extra[D2T_FORMAT_KEY] = WRITTEN_FORMAT
    save_weights(state, path, dtype=DTYPE_NAMES[dtype], max_shard_bytes=max_shard_bytes)
    write_json({**cfg.to_json(), "dtype": dtype, **extra}, path / "config.json")
