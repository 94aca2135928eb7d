"""GGUF files of Gemma 4 and the hybrid Qwen families as llama.cpp's `convert_hf_to_gguf.py` writes them
(`general.architecture` gemma4, qwen35, qwen35moe, qwen3next), one `GGUFFamily` record each, which the family's
`ModelFamily` record holds (`gguf`):

* `hf_config`: the HF config.json dict the header implies, read by `ModelConfig.from_hf`, so a file and the HF
  folder it was converted from give the same ModelConfig (tests/test_gguf_families.py checks that);
* `names`: llama.cpp's tensor names -> HF names (globals whole, block tensors by their leaf under
  `model.layers.<i>.`; a `*` in an HF name is one tensor per expert, split along the file's first dimension);
* `undo`: the inverse of what the converter did to a tensor, by HF name.

What the converter does, and how it is undone here:
* Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: every RMSNorm weight but the Gated DeltaNet's gated norm is stored as
  1 + weight (1 is subtracted: exact where the weight lies in [-0.5, 1], and the model adds 1 back in fp32);
  A_log as A = -exp(A_log) (the A_log whose exp gives the file's A exactly, where one is found); dt_bias as
  `ssm_dt.bias`; the conv1d kernel squeezed to [channels, kernel]; experts stacked [E, ...]; the MTP layer as one
  more block (`<arch>.nextn_predict_layers`), named back to `mtp.*` (the target loader skips it).
  Qwen3.5 (not Qwen3-Next) also reorders the value heads from grouped by key head to tiled, wherever they appear
  (the v rows of in_proj_qkv and of the conv, in_proj_z, in_proj_a / _b, A_log, dt_bias, out_proj's columns).
  Qwen3-Next's grouped in_proj_qkvz is written regrouped (`attn_qkv` + `attn_gate`), its in_proj_ba as it is.
* Gemma 4: no norm offset; the router's scale and per-expert scale renamed (`ffn_gate_inp.scale`,
  `ffn_down_exps.scale`); the full layers' proportional RoPE as a `rope_freqs` tensor (1 for a rotated pair, 1e30
  for an unrotated one: the partial rotary factor is read from it); per-kind head shapes and KV heads, the
  per-layer feed-forward widths (double-wide shared layers) and the sliding pattern as header arrays.

Imports nothing of dspark but `ModelConfig`; `gguf_format.gguf_model_config` dispatches here, the loader maps
tensors through `hf_tensors`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from dspark.models.config import ModelConfig

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)$")


class Header:
    """The header of a GGUF file of architecture `arch`: its keys (`get` reads `<arch>.<key>`), its tensors'
    dims (GGUF order) and the values of its small F32 tensors."""

    def __init__(self, reader: Any, arch: str) -> None:
        self.reader, self.arch = reader, arch
        self.tensors = {t.name: t for t in reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def get(self, key: str, default: Any = KeyError) -> Any:
        value = self.field(f"{self.arch}.{key}")
        if value is None:
            if default is KeyError:
                raise KeyError(f"{self.arch}.{key}")  # (the loader says: <file>: lacks <key>)
            return default
        return value

    def dims(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in self.tensors[name].shape)

    def f32(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        if int(t.tensor_type) != 0:
            raise ValueError(f"GGUF tensor {name!r} is {t.tensor_type!r}, expected F32")
        return np.asarray(t.data, dtype=np.float32).ravel()

    def eps(self) -> float:
        return float(f"{self.get('attention.layer_norm_rms_epsilon', 1e-6):.7g}")  # undo fp32 storage

    def common(self) -> dict[str, Any]:
        """The config keys every family reads the same way."""
        return {"vocab_size": self.dims("token_embd.weight")[1], "hidden_size": int(self.get("embedding_length")),
                "num_attention_heads": int(self.get("attention.head_count")), "rms_norm_eps": self.eps(),
                "max_position_embeddings": int(self.get("context_length")),
                "tie_word_embeddings": "output.weight" not in self.tensors, "attention_bias": False,
                "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
                "eos_token_id": self.field("tokenizer.ggml.eos_token_id")}


# -- the hybrid Qwen families ---------------------------------------------------------------------------------
def _qwen_config(h: Header, architecture: str) -> dict[str, Any]:
    layers = int(h.get("block_count")) - int(h.get("nextn_predict_layers", 0))
    head_dim = int(h.get("attention.key_length"))
    recurrent = h.get("attention.recurrent_layers", None)
    interval = int(h.get("full_attention_interval", 4))
    kinds = [bool(recurrent[i]) if recurrent is not None else (i + 1) % interval != 0 for i in range(layers)]
    hv = int(h.get("ssm.time_step_rank"))
    out = {**h.common(), "architectures": [architecture], "num_hidden_layers": layers,
           "intermediate_size": int(h.get("feed_forward_length", 0)),
           "num_key_value_heads": int(h.get("attention.head_count_kv")), "head_dim": head_dim,
           "layer_types": ["linear_attention" if k else "full_attention" for k in kinds],
           "linear_num_key_heads": int(h.get("ssm.group_count")), "linear_num_value_heads": hv,
           "linear_key_head_dim": int(h.get("ssm.state_size")),
           "linear_value_head_dim": int(h.get("ssm.inner_size")) // hv,
           "linear_conv_kernel_dim": int(h.get("ssm.conv_kernel")),
           "rope_parameters": {"rope_type": "default", "rope_theta": float(h.get("rope.freq_base")),
                               "partial_rotary_factor": int(h.get("rope.dimension_count")) / head_dim}}
    if h.get("expert_count", 0):  # llama.cpp always renormalises the top-k weights of these families
        out.update(num_experts=int(h.get("expert_count")), num_experts_per_tok=int(h.get("expert_used_count")),
                   moe_intermediate_size=int(h.get("expert_feed_forward_length")), norm_topk_prob=True,
                   shared_expert_intermediate_size=int(h.get("expert_shared_feed_forward_length", 0)),
                   decoder_sparse_step=1, mlp_only_layers=[])
    return out


_QWEN_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.*.gate_proj.weight", "ffn_up_exps.weight": "mlp.experts.*.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.*.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight", "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
}
# the MTP block's own tensors (the converter's `mtp.*` renames, reversed); its decoder layer's as above
_QWEN_MTP = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
             "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight"}


def a_log(a: torch.Tensor) -> torch.Tensor:
    """The A_log whose -exp gives the stored A = -exp(A_log) (the nearest float where the log is an ulp off)."""
    x = torch.log(-a)
    for _ in range(4):
        off = torch.exp(x) - (-a)
        if not off.any():
            break
        x = torch.where(off > 0, torch.nextafter(x, x - 1), torch.where(off < 0, torch.nextafter(x, x + 1), x))
    return x


def _grouped(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """Value heads along `dim` from llama.cpp's tiled order [r, hk, d] back to HF's grouped order [hk, r, d]."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], r, hk, d, *shape[dim + 1:]).transpose(dim, dim + 1)
    return t.reshape(shape)


def _undo_qwen(name: str, t: torch.Tensor, cfg: ModelConfig, reordered: bool) -> torch.Tensor:
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight") or name.startswith("mtp.pre_fc_norm"):
        t = t - 1.0
    if name.endswith("linear_attn.A_log"):
        t = a_log(t)
    elif name.endswith("linear_attn.conv1d.weight"):
        t = t.unsqueeze(1)  # HF's [channels, 1, kernel]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if not reordered or hk == hv or ".linear_attn." not in name:
        return t
    r, dv, qk = hv // hk, cfg.linear_value_head_dim, 2 * hk * cfg.linear_key_head_dim
    leaf = name.rpartition(".linear_attn.")[2]
    if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
        return torch.cat([t[:qk], _grouped(t[qk:], 0, hk, r, dv)])
    if leaf == "in_proj_z.weight":
        return _grouped(t, 0, hk, r, dv)
    if leaf in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return _grouped(t, 0, hk, r, 1)
    if leaf == "out_proj.weight":
        return _grouped(t, 1, hk, r, dv)
    return t


def _qwen_block_name(i: int, leaf: str, cfg: ModelConfig) -> str:
    if i < cfg.num_hidden_layers:
        return f"model.layers.{i}.{_QWEN_BLOCK[leaf]}"
    return _QWEN_MTP.get(leaf) or f"mtp.layers.{i - cfg.num_hidden_layers}.{_QWEN_BLOCK[leaf]}"


# -- Gemma 4 --------------------------------------------------------------------------------------------------
def _per_layer(value: Any, layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers


def _gemma4_config(h: Header) -> dict[str, Any]:
    layers = int(h.get("block_count"))
    sliding = [bool(s) for s in h.get("attention.sliding_window_pattern")]
    kinds = ["sliding_attention" if s else "full_attention" for s in sliding[:layers]]
    kv = _per_layer(h.get("attention.head_count_kv"), layers)
    ff = _per_layer(h.get("feed_forward_length"), layers)
    shared = int(h.get("attention.shared_kv_layers", 0))
    head_dim, global_head_dim = int(h.get("attention.key_length_swa")), int(h.get("attention.key_length"))
    if int(h.get("rope.dimension_count_swa", head_dim)) != head_dim:
        raise ValueError(f"GGUF gemma4: partial RoPE on the sliding layers ({h.get('rope.dimension_count_swa')} of "
                         f"{head_dim} dims) is not supported")
    full = {"rope_type": "default", "rope_theta": float(h.get("rope.freq_base"))}
    if "rope_freqs.weight" in h.tensors:  # proportional: 1 for each rotated pair of the full layers' heads
        pairs = int((h.f32("rope_freqs.weight") == 1.0).sum())
        full.update(rope_type="proportional", partial_rotary_factor=2 * pairs / global_head_dim)
    full_layers = [i for i, k in enumerate(kinds) if k == "full_attention"]
    owners = [i for i in full_layers if i < layers - shared]  # full layers with their own K/V
    out = {**h.common(), "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": layers,
           "intermediate_size": ff[0], "use_double_wide_mlp": any(f != ff[0] for f in ff),
           "num_key_value_heads": kv[kinds.index("sliding_attention")] if "sliding_attention" in kinds else kv[0],
           "head_dim": head_dim, "layer_types": kinds, "sliding_window": int(h.get("attention.sliding_window")),
           "per_layer_config": {str(i): {"head_dim": global_head_dim, "num_key_value_heads": kv[i]}
                                for i in full_layers},
           "attention_k_eq_v": bool(owners) and all(f"blk.{i}.attn_v.weight" not in h.tensors for i in owners),
           "num_kv_shared_layers": shared, "hidden_activation": "gelu_pytorch_tanh",
           "final_logit_softcapping": h.get("final_logit_softcapping", None),
           "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                     "rope_theta": float(h.get("rope.freq_base_swa"))},
                               "full_attention": full},
           "hidden_size_per_layer_input": int(h.get("embedding_length_per_layer_input", 0)),
           "vocab_size_per_layer_input": h.dims("per_layer_token_embd.weight")[1]
           if "per_layer_token_embd.weight" in h.tensors else 0}
    if h.get("expert_count", 0):
        out.update(enable_moe_block=True, num_experts=int(h.get("expert_count")),
                   top_k_experts=int(h.get("expert_used_count")),
                   moe_intermediate_size=int(h.get("expert_feed_forward_length")))
    return out


_GEMMA4_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight", "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale", "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj", "ffn_down_exps.weight": "experts.down_proj",
}
_GEMMA4_GLOBAL = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                  "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                  "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
                  "rope_freqs.weight": ""}  # read into the config (the full layers' partial rotary factor)


# -- the records ----------------------------------------------------------------------------------------------
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class GGUFFamily:
    hf_config: Callable[[Header], dict[str, Any]]
    block_name: Callable[[int, str, ModelConfig], str]  # (block index, GGUF leaf, config) -> HF name
    global_names: dict[str, str]  # GGUF name -> HF name ("" : none, the config read it)
    undo: Callable[[str, torch.Tensor, ModelConfig], torch.Tensor]  # (HF name, tensor, config) -> HF tensor

    def model_config(self, reader: Any, arch: str) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config(Header(reader, arch)))

    def hf_name(self, name: str, cfg: ModelConfig) -> str:
        """llama.cpp tensor name -> HF name ("" for a tensor the config holds)."""
        if name in self.global_names:
            return self.global_names[name]
        m = _BLOCK.match(name)
        try:
            if m is None:
                raise KeyError(name)
            return self.block_name(int(m.group(1)), m.group(2), cfg)
        except KeyError:
            raise KeyError(f"GGUF tensor {name!r} has no known HF equivalent") from None

    def orders(self, hf: str, cfg: ModelConfig, shape: tuple[int, int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(rows, cols) long or None: `undo` of a matrix [n, k] named `hf` is its rows in order `rows` and its
        columns in order `cols` (None: as they are), read off `undo` itself on index tensors, so a quantized
        matrix, whose rows cannot be re-cut along its columns, is reordered by whole rows or through its input.
        ValueError where `undo` does more to the matrix than reorder it. An `undo` that hands back the tensor it
        was given left the matrix as it is: (None, None) without the index tensors."""
        n, k = shape
        untouched = torch.zeros((), dtype=torch.int16).expand(n, k)  # [n, k] in no memory
        if self.undo(hf, untouched, cfg) is untouched:
            return None, None
        dtype = torch.int16 if max(n, k) < 2 ** 15 else torch.int32
        out = []
        for dim, size in ((0, n), (1, k)):
            index = torch.arange(size, dtype=dtype)
            probe = (index[:, None] if dim == 0 else index[None, :]).expand(n, k).contiguous()
            moved = self.undo(hf, probe, cfg)
            line = moved[:, 0] if dim == 0 else moved[0, :]
            if moved.shape != (n, k) or moved.dtype != dtype or not torch.equal(
                    moved, (line[:, None] if dim == 0 else line[None, :]).expand(n, k)) or not torch.equal(
                    line.sort().values, index):
                raise ValueError(f"{hf}: the converter's change to this matrix is not a reordering of its rows "
                                 f"and columns; load it with --matmul-dtype float32")
            out.append(None if torch.equal(line, index) else line.long())
        return out[0], out[1]

    def hf_tensors(self, name: str, t: torch.Tensor, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs of the file's tensor `name` (fp32, HF's [out, in] layout): none for one the
        config holds, one per expert for stacked experts."""
        hf = self.hf_name(name, cfg)
        if not hf:
            return
        t = self.undo(hf, t, cfg)
        if "*" not in hf:
            yield hf, t
            return
        for e in range(t.shape[0]):
            yield hf.replace("*", str(e)), t[e].clone()


def qwen_gguf(architecture: str, *, reordered_value_heads: bool) -> GGUFFamily:
    """The record of a hybrid Qwen GGUF (qwen35, qwen35moe, qwen3next), read as the HF `architecture`;
    `reordered_value_heads`: the converter tiled the value heads (Qwen3.5, not Qwen3-Next)."""
    return GGUFFamily(lambda h: _qwen_config(h, architecture), _qwen_block_name, _GLOBAL,
                      lambda n, t, c: _undo_qwen(n, t, c, reordered_value_heads))


GEMMA4_GGUF = GGUFFamily(_gemma4_config, lambda i, leaf, cfg: f"model.layers.{i}.{_GEMMA4_BLOCK[leaf]}",
                         {**_GLOBAL, **_GEMMA4_GLOBAL}, lambda n, t, c: t)
