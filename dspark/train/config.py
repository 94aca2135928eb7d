"""TrainConfig: every knob of `dspark train`, read from a JSON preset (configs/train_*.json) plus
`--set key=value` overrides. Unknown keys are errors; keys starting with "_" (like "_comment") are notes.

    cfg = load_train_config("configs/train_dspark_smollm2.json", overrides=["lr=3e-4", "max_steps=50"],
                            method="dspark")
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dspark.config import DEFAULT_MODEL

METHODS = ("dspark", "dflash", "eagle3")
SELECT_BY = ("last", "tau_process")


@dataclass(frozen=True)
class TrainConfig:
    method: str = "dspark"  # dspark | dflash | eagle3
    model: str = DEFAULT_MODEL  # target: GGUF, HF folder or the embedded default
    target_dtype: str = "float32"
    # features: precomputed once into this folder (ShardedFeatureCache); None = target online every step
    feature_cache: str | None = None
    feature_tokens_per_forward: int = 4096  # flat varlen tokens per target forward in the feature pass
    drafter_autocast: str | None = None  # "bfloat16": drafter forward under autocast on `device` (fp32 master
    #                                      weights, fp32 losses); None = plain fp32
    # where the target and the drafter run: "cpu" or "cuda[:N]" (the data pipeline stays on the CPU; batches and
    # features are moved to the device before the forward)
    device: str = "cpu"
    # drafter shape
    num_draft_layers: int = 2
    block_size: int = 7  # γ (dspark slot layout: block_size drafts per block)
    tap_layer_ids: tuple[int, ...] | None = None  # None: evenly spaced (dspark_config.default_tap_layer_ids)
    markov_rank: int = 128  # dspark only; dflash forces 0
    markov_head_type: str = "vanilla"
    anchor_features: bool = False  # block drafters: DSparkConfig.anchor_features (anchor_proj starts at zero)
    draft_vocab_size: int | None = 16384  # None: the full target vocabulary
    ttt_steps: int = 7  # eagle3 test-time-training unroll
    # data
    num_anchors: int = 64  # blocks per sequence (eagle3: TTT chains scored per sequence)
    max_seq_len: int = 1408  # prepare-data: max_prompt_tokens 1024 + max_tokens 384
    batch_size: int = 4  # sequences per rank per micro-batch
    grad_accum: int = 1
    # optimisation (reference §4.5)
    max_steps: int = 2000
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    init_std: float = 0.02
    # warm start: an exported drafter folder of this method (config.json + model.safetensors); its
    # weights replace the random init and its draft vocabulary (d2t) replaces the one built from the data
    init_from: str | None = None
    # block drafters: grow init_from to this config's num_draft_layers (the extra layers copy its last one with
    # o_proj and down_proj at zero) and markov_rank (vanilla head; new W2 columns at zero): at step 0 the same
    # drafts (methods.copy_trainable); False: the shapes must agree
    init_grow: bool = False
    # block drafters: "target" starts the draft layers as copies of target layers (warm_start_layers; None: the
    # target's last num_draft_layers) and fc as the identity on the deepest tap (dspark.train.warm_start);
    # "none": N(0, init_std). A warm start from init_from takes precedence over both
    warm_start: str = "none"
    warm_start_layers: tuple[int, ...] | None = None
    # block drafters: this fraction of each sequence's anchors is drawn from the anchors greedy decoding
    # visits (`anchors.process_anchors`), mined once with the starting weights (out_dir/focus_anchors.pt);
    # the rest uniformly. 0: uniform anchors only
    anchor_focus: float = 0.0
    # regularisation: Gaussian noise on the target taps the drafter reads (training steps only; validation and
    # labels stay exact), std = feature_noise × each tap's RMS at that token (EAGLE's feature noise, relative)
    feature_noise: float = 0.0
    # losses (reference §4.4)
    loss_ce: float = 0.1
    loss_l1: float = 0.9
    loss_confidence: float = 1.0
    loss_soft_ce: float = 0.0  # block drafters: soft CE against the target distribution (0: the reference's three terms)
    loss_decay: float = 4.0
    step_loss_decay: float = 0.8  # eagle3
    # bookkeeping
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8
    # validation also replays greedy decoding along the held-out answers (block drafters): tau_process, the
    # engine's tau, beside tau_top1's uniform anchors (costs a block at every answer position, not only at
    # num_anchors random ones)
    eval_process_tau: bool = True
    # which weights `dspark train` exports: "last" (the final step) or "tau_process" (the validation with the
    # highest tau_process, the starting weights' own validation included; needs eval_process_tau and a
    # val split; kept in checkpoints/best.pt)
    select_by: str = "last"
    # stop after this many minutes of training steps (None: run to max_steps) and export; the lr schedule
    # spans max_steps, or with schedule_by_time the steps that fit the minutes (max_steps the cap), measured
    # over the first steps; export_shard_mb: the exported weights as safetensors shards of at most that size
    max_minutes: float | None = None
    schedule_by_time: bool = False
    export_shard_mb: float | None = None
    ckpt_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.tap_layer_ids is not None:
            object.__setattr__(self, "tap_layer_ids", tuple(int(i) for i in self.tap_layer_ids))
        _need(self.method in METHODS, f"method {self.method!r} unknown; choose from {', '.join(METHODS)}")
        _need(0.0 <= self.anchor_focus <= 1.0, f"anchor_focus must be in [0, 1], got {self.anchor_focus}")
        _need(not (self.anchor_focus and self.method == "eagle3"),
              "anchor_focus applies to the block drafters (dspark, dflash), not eagle3")
        _need(self.feature_noise >= 0, f"feature_noise must be >= 0, got {self.feature_noise}")
        if self.warm_start_layers is not None:
            object.__setattr__(self, "warm_start_layers", tuple(int(i) for i in self.warm_start_layers))
        _need(self.warm_start in ("none", "target"), f"warm_start {self.warm_start!r} unknown; choose none or target")
        _need(self.warm_start == "none" or self.method != "eagle3",
              "warm_start 'target' applies to the block drafters (dspark, dflash), not eagle3")
        _need(not self.init_grow or (self.init_from is not None and self.method != "eagle3"),
              "init_grow needs init_from and a block drafter (dspark, dflash)")
        _need(self.warm_start_layers is None or self.warm_start == "target",
              "warm_start_layers needs warm_start 'target'")
        _need(self.max_minutes is None or self.max_minutes > 0, "max_minutes must be > 0")
        _need(not self.schedule_by_time or self.max_minutes is not None, "schedule_by_time needs max_minutes")
        _need(self.export_shard_mb is None or self.export_shard_mb > 0, "export_shard_mb must be > 0")
        _need(self.select_by in SELECT_BY, f"select_by {self.select_by!r} unknown; choose from {', '.join(SELECT_BY)}")
        _need(self.select_by != "tau_process" or self.eval_process_tau, "select_by tau_process needs eval_process_tau")
        _need(self.target_dtype in ("float32", "bfloat16", "float16"), f"target_dtype {self.target_dtype!r}")
        _need(self.drafter_autocast in (None, "bfloat16"), f"drafter_autocast {self.drafter_autocast!r}")
        _need(self.device == "cpu" or self.device.startswith("cuda"), f"device {self.device!r}: cpu or cuda[:N]")
        _need(self.num_draft_layers >= 1, "num_draft_layers must be >= 1")
        _need(self.block_size >= 1 and self.ttt_steps >= 1, "block_size and ttt_steps must be >= 1")
        _need(self.num_anchors >= 1 and self.batch_size >= 1 and self.grad_accum >= 1,
              "num_anchors, batch_size and grad_accum must be >= 1")
        _need(self.max_steps >= 1 and self.lr > 0, "max_steps must be >= 1 and lr > 0")
        _need(min(self.loss_ce, self.loss_l1, self.loss_confidence, self.loss_soft_ce) >= 0, "loss weights must be >= 0")
        _need(0 <= self.warmup_frac < 1 and 0 <= self.min_lr_frac <= 1, "warmup_frac in [0,1), min_lr_frac in [0,1]")
        _need(self.draft_vocab_size is None or self.draft_vocab_size >= 2, "draft_vocab_size must be >= 2")
        _need(self.log_every >= 1 and self.keep_checkpoints >= 1, "log_every and keep_checkpoints must be >= 1")
        if self.method == "dflash":
            _need(self.loss_l1 == 0 and self.loss_confidence == 0,
                  "dflash trains with CE only: set loss_l1=0 and loss_confidence=0")
        if self.method == "dspark":
            _need(self.markov_rank > 0, "dspark needs markov_rank > 0 (markov_rank 0 is dflash)")
        _need(not self.anchor_features or self.method != "eagle3",
              "anchor_features is a block drafter's (dspark, dflash): EAGLE-3's input carries the newest feature")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # bare strings: --set model=SmolLM2-135M-Instruct


def load_train_config(path: str | Path | None, *, overrides: list[str] = (), method: str | None = None
                      ) -> TrainConfig:
    known = {f.name for f in fields(TrainConfig)}
    values: dict[str, Any] = {}
    if path is not None:
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a train config must be a JSON object")
        values.update({k: v for k, v in raw.items() if not k.startswith("_")})
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value")
        values[key.strip()] = _parse_value(text.strip())
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown train config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if method is not None:
        if "method" in values and values["method"] != method:
            raise ValueError(f"--method {method} contradicts the config's method {values['method']!r}")
        values["method"] = method
    return TrainConfig(**values)
