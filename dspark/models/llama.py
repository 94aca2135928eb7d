"""Llama-family target model (Llama 2/3, SmolLM2) over the paged KV pool, with residual-stream taps.

One forward takes a flat variable-length batch (`input_ids`, `positions`), the step's `AttnMetadata` and
the per-layer KV caches; the module itself holds no per-request state. `tap_layer_ids` selects which
residual-stream outputs come back concatenated along the feature dim: id i is the output of decoder
layer i (HF `output_hidden_states[i + 1]`), -1 is the embeddings.

Parameters are fused (qkv_proj, gate_up_proj); `load_weights` accepts HF names and routes each tensor
through `packed_modules_mapping` and the parameter's `weight_loader`. Qwen3 (`qwen3.py`) subclasses this
file's classes and only adds the per-head q/k RMSNorm; Qwen3-MoE (`qwen3_moe.py`) swaps the MLP of its MoE
layers (`LlamaDecoderLayer.build_mlp`) for a sparse MoE block, which the one-call CPU stack does not run.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from dspark import kernels
from dspark.models.attention import AttnMetadata, one_group_metadata, paged_attention, store_kv
from dspark.models.config import ModelConfig
from dspark.models.family import ModelFamily
from dspark.models.layers import (LMHead, Linear, MergedLinear, RMSNorm, RotaryEmbedding, VocabEmbedding,
                                  apply_rope, silu_and_mul)

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_kv_blocks, kv_block_size, num_kv_heads, head_dim]

# checkpoint buffers that are recomputed here and never loaded
IGNORED_WEIGHTS = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.(cos|sin)_cached)$")


def _product_weight(linear: Linear) -> torch.Tensor:
    """The weight the kernels multiply by: the packed Q4_1 blocks under `use_q4_1_products`, the bf16 copy
    under `use_bf16_products`, else the weight."""
    for name in ("weight_q4", "weight_bf16"):
        w = getattr(linear, name, None)
        if w is not None:
            return w
    return linear.weight


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, (("q", q_size), ("k", kv_size), ("v", kv_size)),
                                     bias=cfg.attention_bias, dtype=dtype, device=device)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False, dtype=dtype, device=device)
        self.qk_size = q_size + kv_size
        self.scale = self.head_dim ** -0.5

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv [num_tokens, (H + 2 Hkv) * hd] -> rotated q [T, H, hd], k [T, Hkv, hd]; q and k share one
        rope call (the Qwen3 subclass normalises them first)."""
        qk = qkv[:, :self.qk_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)  # [T, H + Hkv, hd]
        return qk[:, :self.num_heads], qk[:, self.num_heads:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv_cache: KVCache) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * hd]
        q, k = self.rope_qk(qkv, cos, sin)
        v = qkv[:, self.qk_size:].view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, hd]
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, all_stored=meta.all_stored)
        out = paged_attention(q, k_cache, v_cache, meta, scale=self.scale)  # [T, H, hd]
        return self.o_proj(out.reshape(out.shape[0], -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, (("gate", inter), ("up", inter)), bias=False,
                                         dtype=dtype, device=device)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                 layer_id: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, dtype=dtype, device=device)
        self.mlp = self.build_mlp(cfg, layer_id, dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype,
                                                device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv_cache: KVCache) -> torch.Tensor:  # residual stream [T, hidden] -> [T, hidden]
        attn = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        x, h = self.post_attention_layernorm.add_forward(attn, x)  # x + attn, and its norm
        return x + self.mlp(h)

    def build_mlp(self, cfg: ModelConfig, layer_id: int, *, dtype: torch.dtype,
                  device: torch.device | str) -> nn.Module:
        """Decoder layer `layer_id`'s feed-forward block (families with MoE layers choose per layer)."""
        return LlamaMLP(cfg, dtype=dtype, device=device)


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(self.layer_cls(cfg, dtype=dtype, device=device, layer_id=i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(head_dim=cfg.head_dim, max_positions=cfg.max_position_embeddings,
                                          theta=cfg.rope_theta, scaling=cfg.rope_scaling, dtype=dtype,
                                          device=device)


class LlamaForCausalLM(nn.Module):
    model_cls: type[LlamaModel] = LlamaModel
    # HF projection name -> (our fused parameter's module name, shard id)
    packed_modules_mapping: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg, dtype=dtype, device=device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None,
                              dtype=dtype, device=device)

    @property
    def num_kv_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The decoder layers whose feed-forward block is a sparse MoE block (`ModelConfig.is_moe_layer`)."""
        cfg = self.config
        return tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)) if cfg.num_experts else ()

    @property
    def kv_spec(self) -> tuple[int, int]:
        """(KV heads, head_dim) of one layer's cache on this process (a tensor-parallel rank keeps its own
        heads: dspark.distributed.shard)."""
        return getattr(self, "tp_num_kv_heads", self.config.num_key_value_heads), self.config.head_dim

    def _tap_slots(self, tap_layer_ids: tuple[int, ...]) -> dict[int, list[int]]:
        slots: dict[int, list[int]] = {}
        for j, layer_id in enumerate(tap_layer_ids):
            if not -1 <= layer_id < self.config.num_hidden_layers:
                raise ValueError(f"tap layer id {layer_id} is out of range [-1, {self.config.num_hidden_layers})")
            slots.setdefault(layer_id, []).append(j)
        return slots

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] long
        positions: torch.Tensor,  # [num_tokens] long
        attn_meta: AttnMetadata,
        kv_caches: list[KVCache],
        tap_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final-normed hidden [num_tokens, hidden], taps [num_tokens, len(tap_layer_ids) * hidden] or
        None)."""
        m = self.model
        if len(kv_caches) != len(m.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(m.layers)} layers")
        x = m.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = m.rotary_emb.lookup(positions)  # [T, 1, hd] each
        taps, tap_slots, capture = self._tap_buffer(x, tap_layer_ids)
        if self._fused_layers(x, cos, sin, attn_meta, kv_caches, taps, tap_slots):
            return m.norm(x), taps
        for i, (layer, kv_cache) in enumerate(zip(m.layers, kv_caches)):
            x = layer(x, cos, sin, attn_meta, kv_cache)
            if i in tap_slots:
                capture(i, x)
        return m.norm(x), taps

    def _tap_buffer(self, x: torch.Tensor, tap_layer_ids: tuple[int, ...]):
        """A forward's taps: (taps [T, len(tap_layer_ids) * hidden] or None, layer id -> tap columns, capture(layer
        id, value) writing a layer's output into its columns), the embedding `x` (tap -1) already captured."""
        tap_slots = self._tap_slots(tuple(tap_layer_ids)) if tap_layer_ids else {}
        hidden = x.shape[-1]
        taps = x.new_empty(x.shape[0], len(tap_layer_ids) * hidden) if tap_slots else None  # [T, n_taps * hidden]

        def capture(layer_id: int, value: torch.Tensor) -> None:
            for j in tap_slots.get(layer_id, ()):
                taps[:, j * hidden:(j + 1) * hidden] = value

        capture(-1, x)
        return taps, tap_slots, capture

    def stack_rows(self) -> int:
        """The most rows a step of this model may have and run every decoder layer in one CPU kernel call
        (`kernels.MAX_ROWS`), 0 where no step does: what `_stack_applies` and the stacks check that does not
        depend on the step (the runner checks the device, the dtype and that every row is stored). The runner
        cuts a larger step into pieces of at most this many rows. MoE layers (`moe_layers`): 0, the stack
        multiplies dense MLPs only."""
        if kernels.ops() is None or self.config.attention_bias or getattr(self, "tp", None) is not None or \
                self.moe_layers:
            return 0
        qkv = getattr(self.model.layers[0].self_attn, "qkv_proj", None)
        if getattr(qkv, "blocks", None) is not None and self._block_stack() is None:
            return 0  # matrices held as GGUF blocks of a type the block stack does not multiply
        return kernels.MAX_ROWS

    def _stack_applies(self, x: torch.Tensor, meta: AttnMetadata, kv_caches: list[KVCache]) -> bool:
        """Does a one-call decoder stack serve this step: an fp32 CPU step of at most `kernels.MAX_ROWS` rows
        (decode and verification rows, prompt chunks, or a mix: its attention groups read as one,
        `one_group_metadata`) over an fp32 KV pool, every row stored, no bias, no MoE layer, no tensor
        parallelism, the kernels built (checked last: a CUDA step never loads them)?"""
        return not (not meta.groups or not meta.all_stored or x.shape[0] > kernels.MAX_ROWS or self.config.attention_bias
                    or self.moe_layers or x.dtype != torch.float32 or x.device.type != "cpu" or kv_caches[0][0].dtype != torch.float32
                    or getattr(self, "tp", None) is not None  # tensor parallelism: all-reduces between layers
                    or not kernels.enabled())

    def _fused_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                      kv_caches: list[KVCache], taps: torch.Tensor | None, tap_slots: dict[int, list[int]]) -> bool:
        """A step `_stack_applies` to runs all decoder layers in one CPU kernel call (`kernels.decoder_layers`,
        or `kernels.block_layers` for matrices resident as GGUF blocks: the same arithmetic as the per-layer
        modules). False when it does not apply: the modules run instead."""
        if not self._stack_applies(x, meta, kv_caches):
            return False
        meta = one_group_metadata(meta)
        rope = (cos.view(x.shape[0], -1), sin.view(x.shape[0], -1))
        if self.model.layers[0].self_attn.qkv_proj.blocks is not None:  # resident as GGUF blocks (a layer view too)
            g = meta.groups[0]
            rows = (g.token_index, g.key_limit, g.kv_slots)
            return self._block_layers(x, {False: rope, True: rope}, meta, {False: rows, True: rows},
                                      [False] * len(kv_caches), kv_caches, taps, tap_slots)
        attn = self.model.layers[0].self_attn
        tap_layers, tap_cols = self._tap_columns(tap_slots, x.shape[-1])
        g = meta.groups[0]
        return kernels.decoder_layers(
            x, self._layer_weights(), [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], *rope,
            meta.slot_mapping, g.token_index, g.key_limit, g.kv_slots, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, eps=self.config.rms_norm_eps, scale=attn.scale, taps=taps,
            tap_layers=tap_layers, tap_cols=tap_cols)

    @staticmethod
    def _tap_columns(tap_slots: dict[int, list[int]], hidden: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(layer ids, first columns) of the decoder layers' taps (-1, the embedding, is the caller's)."""
        items = [(i, j * hidden) for i, js in tap_slots.items() if i >= 0 for j in js]
        return tuple(i for i, _ in items), tuple(c for _, c in items)

    def _block_layers(self, x: torch.Tensor, rope: dict, meta: AttnMetadata, rows: dict, local: list[bool],
                      kv_caches: list[KVCache], taps: torch.Tensor | None, tap_slots: dict[int, list[int]]) -> bool:
        """All decoder layers through `kernels.block_layers` (rope / rows: local? -> the layer kind's RoPE
        tables and attention rows); False when a matrix has a part it does not multiply (bf16)."""
        stack = self._block_stack()
        if stack is None:
            return False
        norms, matrices = stack
        attn = self.model.layers[0].self_attn
        tap_layers, tap_cols = self._tap_columns(tap_slots, x.shape[-1])
        return kernels.block_layers(
            x, norms, matrices, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], rope, meta.slot_mapping,
            rows, local, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, eps=self.config.rms_norm_eps,
            scale=attn.scale, gelu_tanh=self.stack_gelu_tanh, taps=taps, tap_layers=tap_layers, tap_cols=tap_cols)

    stack_gelu_tanh = False  # the MLP's activation in `kernels.block_layers` (else SiLU)
    # the part types `kernels.block_layers` multiplies: F32, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K (GGML ids), packed Q4_K
    STACK_TYPES = (0, 3, 6, 8, 12, 14, 1012)

    def _stack_norms(self, layer: nn.Module) -> list[torch.Tensor | None]:
        """A layer's 6 norm vectors for `kernels.block_layers` (cpu_ops_block_layers.inc; None: absent)."""
        a = layer.self_attn
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return [layer.input_layernorm.weight, q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None, None, layer.post_attention_layernorm.weight, None]

    @staticmethod
    def _stack_parts(lin: nn.Module) -> list[tuple[int, torch.Tensor]] | None:
        """A Linear's matrix as [(GGML type, part)]: its BlockMatrix parts, or its fp32 weight (type 0) when no
        bf16 / Q4_1 copy is what its products read; None otherwise."""
        if lin.blocks is not None:
            return list(lin.blocks.parts)
        if getattr(lin, "weight_q4", None) is None and getattr(lin, "weight_bf16", None) is None and \
                lin.weight.dtype == torch.float32:
            return [(0, lin.weight)]
        return None

    def _block_stack(self) -> tuple[list[torch.Tensor], list[list[tuple[int, torch.Tensor]]]] | None:
        """(norms, matrices) for `kernels.block_layers`, built once: each Linear's BlockMatrix parts, or its
        fp32 weight; None when some matrix has another form (bf16 or Q4_1 copies, a part of another type)."""
        if getattr(self, "_block_stack_list", None) is None:
            none = torch.empty(0)
            norms = [none if w is None else w for layer in self.model.layers for w in self._stack_norms(layer)]
            matrices = [self._stack_parts(lin) for layer in self.model.layers
                        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                    layer.mlp.down_proj)]
            ok = all(m is not None and all(t in self.STACK_TYPES for t, _ in m) for m in matrices)
            self._block_stack_list = (norms, matrices) if ok else False
        return self._block_stack_list or None

    def _layer_weights(self) -> list[torch.Tensor]:
        """The 8 tensors per layer that `kernels.decoder_layers` reads (Parameters: later in-place loads and
        `.to()` stay visible); built once."""
        if getattr(self, "_layer_weight_list", None) is None:
            none = torch.empty(0)
            weights = []
            for layer in self.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
                weights += [layer.input_layernorm.weight, _product_weight(a.qkv_proj),
                            q_norm.weight if q_norm is not None else none,
                            k_norm.weight if k_norm is not None else none, _product_weight(a.o_proj),
                            layer.post_attention_layernorm.weight, _product_weight(mlp.gate_up_proj),
                            _product_weight(mlp.down_proj)]
            self._layer_weight_list = weights
        return self._layer_weight_list

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] fp32
        return self.lm_head(hidden)

    # ------------------------------------------------------------------------------------ weights

    def _resolve(self, hf_name: str) -> tuple[str, str | None]:
        """HF parameter name -> (our parameter name, shard id or None)."""
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in self.packed_modules_mapping:
            fused, shard = self.packed_modules_mapping[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), shard
        return hf_name, None

    def _hf_name(self, key: str) -> str:
        """'...qkv_proj.weight:k' -> '...k_proj.weight' (for error messages)."""
        name, _, shard = key.partition(":")
        if not shard:
            return name
        for hf_module, (fused, s) in self.packed_modules_mapping.items():
            if s == shard and f".{fused}." in name:
                return name.replace(f".{fused}.", f".{hf_module}.")
        return key

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> set[str]:
        """Load (HF name, tensor) pairs; unknown names raise `KeyError` naming the key, and with `strict`
        any parameter (or shard) left unfilled raises `KeyError` naming it. Returns the loaded names."""
        params = dict(self.named_parameters())
        expected = set()
        for name in params:
            module_name, _, leaf = name.rpartition(".")
            shards = (getattr(params[name], "shard_ids", None)  # a parameter packing several tensors
                      or getattr(self.get_submodule(module_name), "shard_rows", None))
            expected.update(f"{name}:{s}" for s in shards) if shards else expected.add(name)
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if IGNORED_WEIGHTS.search(hf_name):
                continue
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding matrix is the head
            name, shard = self._resolve(hf_name)
            if name not in params:
                raise KeyError(f"checkpoint weight {hf_name!r} does not match any parameter of "
                               f"{type(self).__name__}")
            param = params[name]
            try:
                param.weight_loader(param, tensor, shard) if shard else param.weight_loader(param, tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint weight {hf_name!r}: {e}") from None
            loaded.add(f"{name}:{shard}" if shard else name)
        missing = sorted(self._hf_name(key) for key in expected - loaded)
        if strict and missing:
            raise KeyError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                           + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
        return loaded


# Llama's config.json field names (the default reader and writer); llama.cpp interleaves its q/k rows
FAMILY = ModelFamily(architecture="LlamaForCausalLM", model_class=LlamaForCausalLM, model_types=("llama",),
                     gguf_names=("llama",), gguf_qk_permuted=True, gguf_blocks=True)
