"""DSparkConfig: the DSpark / DFlash drafter's architecture, read from a DeepSpec `config.json`
(reference §1.1, §3.2) or made fresh for one of our targets (`dspark_config_for_target`).

DeepSpec's `target_layer_ids` is renamed `tap_layer_ids` here, once, in `from_deepspec_json`.
Unknown HF keys (architectures, dtype, layer_types, num_anchors, ...) are ignored; a missing required
key raises `ValueError` naming it. Our own extra keys: `slot_layout`, `draft_vocab_size`,
`anchor_features` (the newest context feature added to each block row's input; DeepSpec's have none) and
`draft_layers`, the draft layers' style (`DRAFT_LAYERS`: "qwen3", DeepSpec's Qwen3 layers, or "gemma4", Gemma 4
layers: `gemma4_dspark.py`, whose HF config.json `gemma4_dspark_json` reads into these keys).

Slot layouts (reference §7.3, §8):
  "dspark": block = [anchor, mask × (block_size-1)] at anchor_pos .. ; slot k predicts anchor_pos+k+1,
            so block_size slots give block_size drafts (DeepSpec's DSpark and DFlash checkpoints).
  "zlab":   block = [anchor, mask × (block_size-1)]; the mask at position p predicts the token at p,
            so block_size slots give block_size-1 drafts (z-lab's original DFlash).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dspark.models.config import dense_width
from dspark.models.layers import drafter_rope_scaling

SLOT_LAYOUTS = ("dspark", "zlab")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")  # keys of heads.SEQUENTIAL_HEADS
# draft layer style -> its feed-forward activation (the network: `dspark_checkpoint.DRAFT_NETWORKS`)
DRAFT_LAYERS = {"qwen3": "silu", "gemma4": "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class DSparkConfig:
    vocab_size: int  # target vocabulary (embedding rows, markov_w1 rows)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # draft depth
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_target_layers: int  # target depth (tap ids must be < num_target_layers - 1)
    block_size: int  # trained block slots (γ for the dspark layout)
    mask_token_id: int
    tap_layer_ids: tuple[int, ...]  # target residual-stream outputs concatenated as context features
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling / non-default rope_parameters
    max_position_embeddings: int = 8192
    markov_rank: int = 0  # 0: no sequential head (DFlash)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True  # confidence input [h ; W1[prev]] (else h only)
    slot_layout: str = "dspark"  # dspark | zlab
    draft_vocab_size: int | None = None  # None: full target vocab; else a reduced vocab with `d2t`
    # our extension, off in DeepSpec's checkpoints: every block row's input adds anchor_proj(H_ctx at the
    # anchor's previous position), the newest context feature, as EAGLE's input carries it
    anchor_features: bool = False
    draft_layers: str = "qwen3"  # a key of DRAFT_LAYERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "tap_layer_ids", tuple(int(i) for i in self.tap_layer_ids))
        _need(len(self.tap_layer_ids) > 0, "tap_layer_ids must not be empty")
        for i in self.tap_layer_ids:
            _need(-1 <= i < self.num_target_layers - 1,
                  f"tap layer id {i} out of range [-1, {self.num_target_layers - 1}) for a "
                  f"{self.num_target_layers}-layer target (the final layer is forbidden)")
        _need(self.slot_layout in SLOT_LAYOUTS,
              f"slot_layout {self.slot_layout!r} unknown; choose from {', '.join(SLOT_LAYOUTS)}")
        _need(self.block_size >= (2 if self.slot_layout == "zlab" else 1),
              f"block_size {self.block_size} too small for the {self.slot_layout} layout")
        _need(self.markov_rank >= 0, f"markov_rank must be >= 0, got {self.markov_rank}")
        _need(self.markov_head_type in MARKOV_HEAD_TYPES,
              f"markov_head_type {self.markov_head_type!r} unknown; "
              f"choose from {', '.join(MARKOV_HEAD_TYPES)}")
        _need(self.num_attention_heads % self.num_key_value_heads == 0,
              f"num_attention_heads={self.num_attention_heads} is not a multiple of "
              f"num_key_value_heads={self.num_key_value_heads}")
        _need(0 <= self.mask_token_id < self.vocab_size,
              f"mask_token_id {self.mask_token_id} outside the vocabulary (size {self.vocab_size})")
        _need(not self.anchor_features or self.hidden_size % 2 == 0,
              f"anchor_features stores each context feature in two halves: hidden_size {self.hidden_size} is odd")
        _need(self.draft_layers in DRAFT_LAYERS,
              f"draft_layers {self.draft_layers!r} unknown; choose from {', '.join(DRAFT_LAYERS)}")
        _need(self.draft_vocab_size is None or 0 < self.draft_vocab_size <= self.vocab_size,
              f"draft_vocab_size {self.draft_vocab_size} must be in (0, vocab_size={self.vocab_size}]")

    # -- derived ----------------------------------------------------------------------------------
    @property
    def num_taps(self) -> int:
        return len(self.tap_layer_ids)

    @property
    def effective_draft_vocab_size(self) -> int:
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def slot_offset(self) -> int:
        """Index of the first predicting slot: 0 (dspark) or 1 (zlab, the anchor predicts nothing)."""
        return 0 if self.slot_layout == "dspark" else 1

    @property
    def max_draft_tokens(self) -> int:
        """Drafts one block yields: the largest usable num_speculative_tokens."""
        return self.block_size - self.slot_offset

    # -- (de)serialisation -------------------------------------------------------------------------
    @classmethod
    def from_deepspec_json(cls, d: dict[str, Any]) -> "DSparkConfig":
        """From a DeepSpec (or z-lab DFlash, or our own) config.json dict."""
        nested = d.get("dflash_config") or {}  # z-lab nests these two keys
        def req(key: str, *alts: Any) -> Any:
            for value in (d.get(key), *alts):
                if value is not None:
                    return value
            raise ValueError(f"drafter config.json lacks required key {key!r}")
        layers = d.get("draft_layers", "qwen3")
        act = DRAFT_LAYERS.get(layers)
        if act is not None and d.get("hidden_act", act) != act:
            raise ValueError(f"hidden_act {d['hidden_act']!r} unsupported ({layers} DSpark layers use {act})")
        if d.get("attention_bias", False):
            raise ValueError("attention_bias=true unsupported (DSpark layers have no biases)")
        bad_types = [t for t in d.get("layer_types") or [] if t != "full_attention"]
        if bad_types:
            raise ValueError(f"layer_types {bad_types[0]!r} unsupported (only full_attention)")
        heads = req("num_attention_heads")
        rope_theta, rope_scaling = d.get("rope_theta"), d.get("rope_scaling")
        params = d.get("rope_parameters")  # transformers v5
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        layout = d.get("slot_layout")
        if layout is None:
            zlab = "dflash_config" in d or d.get("sample_from_anchor") is False
            layout = "zlab" if zlab else "dspark"
        markov_rank = int(d.get("markov_rank") or 0)
        return cls(
            vocab_size=req("vocab_size"), hidden_size=req("hidden_size"),
            intermediate_size=req("intermediate_size"), num_hidden_layers=req("num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or req("hidden_size") // heads,
            num_target_layers=req("num_target_layers"),
            block_size=req("block_size"),
            mask_token_id=req("mask_token_id", nested.get("mask_token_id")),
            tap_layer_ids=tuple(req("target_layer_ids", nested.get("target_layer_ids"),
                                    d.get("tap_layer_ids"))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
            markov_rank=markov_rank,
            markov_head_type=d.get("markov_head_type") or "vanilla",
            enable_confidence_head=bool(d.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", True)),
            slot_layout=layout,
            draft_vocab_size=d.get("draft_vocab_size"),
            anchor_features=bool(d.get("anchor_features", False)),
            draft_layers=layers,
        )

    def to_json(self) -> dict[str, Any]:
        """A DeepSpec-compatible config.json dict (plus our slot_layout / draft_vocab_size keys)."""
        d = asdict(self)
        d["target_layer_ids"] = list(d.pop("tap_layer_ids"))
        if self.draft_layers == "qwen3":
            d.pop("draft_layers")  # the default: DeepSpec's and the converter's layout as it is
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        # sample_from_anchor: the slot layout in the key vLLM Speculators and llama.cpp's converter read
        # (Gemma 4 layers are saved in these flat keys: "Gemma4DSparkModel" names the HF layout, not this one)
        arch = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3"} if self.draft_layers == "qwen3" else {}
        return {**arch, **d, "sample_from_anchor": self.slot_layout == "dspark",
                "rope_parameters": rope, "hidden_act": DRAFT_LAYERS[self.draft_layers], "attention_bias": False,
                "tie_word_embeddings": False,
                "layer_types": ["full_attention"] * self.num_hidden_layers}


def default_tap_layer_ids(num_target_layers: int, num_taps: int = 5) -> tuple[int, ...]:
    """Evenly spaced taps from layer 1, DeepSpec's spacing ([1,9,17,25,33] for 36 layers,
    [1,10,19,28,37] for 40), never the final layer."""
    step = max(1, (num_target_layers - 4) // max(1, num_taps - 1))
    ids = [min(1 + i * step, num_target_layers - 2) for i in range(num_taps)]
    return tuple(sorted(set(ids)))


def dspark_config_for_target(
    target,  # dspark.models.config.ModelConfig
    *,
    num_hidden_layers: int,
    block_size: int,
    tap_layer_ids: tuple[int, ...] | None = None,
    markov_rank: int = 0,
    markov_head_type: str = "vanilla",
    enable_confidence_head: bool | None = None,
    confidence_head_with_markov: bool = True,
    mask_token_id: int | None = None,
    slot_layout: str = "dspark",
    draft_vocab_size: int | None = None,
    anchor_features: bool = False,
) -> DSparkConfig:
    """A fresh drafter config with the target's per-layer geometry (reference §1.1).

    enable_confidence_head defaults to markov_rank > 0 (DSpark) / off (DFlash). mask_token_id defaults
    to the last vocabulary row (the embedding is frozen, so the mask is just an unlikely token's row).
    """
    return DSparkConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=dense_width(target), num_hidden_layers=num_hidden_layers,
        num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim, num_target_layers=target.num_hidden_layers, block_size=block_size,
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        tap_layer_ids=tuple(tap_layer_ids) if tap_layer_ids is not None
        else default_tap_layer_ids(target.num_hidden_layers),
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
        rope_scaling=drafter_rope_scaling(target.rope_scaling), max_position_embeddings=target.max_position_embeddings,
        markov_rank=markov_rank, markov_head_type=markov_head_type,
        enable_confidence_head=(markov_rank > 0 if enable_confidence_head is None
                                else enable_confidence_head),
        confidence_head_with_markov=confidence_head_with_markov, slot_layout=slot_layout,
        draft_vocab_size=draft_vocab_size, anchor_features=anchor_features)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
