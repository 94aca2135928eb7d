"""The sparse mixture-of-experts feed-forward block shared by the MoE families: Qwen3-MoE now; Qwen3-Next and
Qwen3.5-MoE add the shared expert (`shared_expert_intermediate_size`).

A token's hidden state goes through the router (`gate`, HF `mlp.gate.weight` [experts, hidden]): logits in the
activations' dtype, softmax in fp32, the top `num_experts_per_tok` probabilities (renormalised to sum to 1 when
`norm_topk_prob`), cast back to the activations' dtype: transformers' `Qwen3MoeTopKRouter` op for op. Each chosen
expert is a gated SiLU MLP; the token's output is the routing-weighted sum of its experts' outputs, plus, with a
shared expert, `sigmoid(shared_expert_gate(x)) * shared_expert(x)` (transformers' `Qwen2MoeSparseMoeBlock`).

The experts run batched by expert: the (token, slot) pairs are sorted by expert and each expert that some
token chose multiplies its rows once, so the Python loop is over experts, never tokens. The row counts per
expert are read on the host (one sync per MoE layer), so a MoE step runs eagerly: CUDA graph capture is
refused with a clear error. The expert matrices are held stacked as transformers 5.x holds them in memory,
`experts.gate_up_proj` [experts, 2 * moe_intermediate, hidden] (gate rows, then up rows) and
`experts.down_proj` [experts, hidden, moe_intermediate]; checkpoints name them per expert
(`mlp.experts.E.gate_proj.weight`, `up_proj`, `down_proj`: Hub checkpoints and transformers'
`save_pretrained`) or fused (a `state_dict()`), and `MoeWeights` loads both.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.config import ModelConfig
from dspark.models.layers import Linear, default_weight_loader, silu_and_mul
from dspark.models.llama import LlamaMLP

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


class TopKRouter(nn.Module):
    """HF `mlp.gate`: hidden -> (routing weights, chosen experts) of each token."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)  # [E, hidden]
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, experts [T, k] int64), transformers' arithmetic."""
        logits = F.linear(x, self.weight)  # [T, E] in x's dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E] fp32
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # [T, k] fp32, [T, k] int64
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)  # [T, k] fp32
        return top_w.to(logits.dtype), top_i


class Experts(nn.Module):
    """HF `mlp.experts`: `num_experts` gated SiLU MLPs, stacked. The weight loader takes one expert's projection
    (shard "E.gate" / "E.up" of `gate_up_proj`, "E" of `down_proj`) or a stacked tensor whole."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = self._param((num_experts, 2 * inter, hidden), dtype, device,  # [E, 2I, hidden]
                                        tuple(f"{e}.{p}" for e in range(num_experts) for p in ("gate", "up")))
        self.down_proj = self._param((num_experts, hidden, inter), dtype, device,  # [E, hidden, I]
                                     tuple(str(e) for e in range(num_experts)))

    def _param(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
               shard_ids: tuple[str, ...]) -> nn.Parameter:
        p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        p.shard_ids = shard_ids  # type: ignore[attr-defined]  # what a strict load must fill (LlamaForCausalLM)
        return p

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded)
        expert, _, part = shard_id.partition(".")
        if not 0 <= int(expert) < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the model has {self.num_experts} experts")
        target = param[int(expert)]  # [2I, hidden] or [hidden, I]
        if part:
            target = target.narrow(0, 0 if part == "gate" else self.inter, self.inter)  # [I, hidden]
        default_weight_loader(target, loaded)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights [T, k], experts [T, k] -> [T, hidden]: each expert runs once on its rows."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MoE layers run eagerly (the rows per expert are read on the host): CUDA graph "
                               "capture is not supported, run with --enforce-eager")
        num_tokens, k = experts.shape
        flat = experts.reshape(-1)  # [T * k] the expert of each (token, slot) pair
        order = torch.argsort(flat, stable=True)  # [T * k] the pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # rows of each expert (host)
        rows = x[order // k]  # [T * k, hidden] each pair's token, grouped by expert
        out = torch.empty_like(rows)  # [T * k, hidden]
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = F.linear(rows[start:start + n], self.gate_up_proj[e])  # [n, 2I]
                out[start:start + n] = F.linear(silu_and_mul(h), self.down_proj[e])  # [n, hidden]
                start += n
        out = out * weights.reshape(-1)[order].unsqueeze(-1)  # [T * k, hidden] routing-weighted
        pairs = torch.empty_like(out).index_copy_(0, order, out)  # [T * k, hidden] in (token, slot) order
        return pairs.view(num_tokens, k, x.shape[-1]).sum(1)  # [T, hidden]


class SparseMoeBlock(nn.Module):
    """A MoE layer's feed-forward block: router, routed experts and (when the config has one) a shared expert."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.gate = TopKRouter(cfg, dtype=dtype, device=device)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype,
                               device=device)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared, dtype=dtype, device=device)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, experts = self.gate(x)  # [T, k], [T, k]
        out = self.experts(x, weights, experts)  # [T, hidden]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, 1] * [T, hidden]
        return out


def per_expert_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A (name, tensor) stream with every stacked expert tensor (`...experts.gate_up_proj` [E, 2I, hidden],
    `...experts.down_proj` [E, hidden, I]) split into per-expert views under the per-expert HF names."""
    for name, t in weights:
        m = _FUSED.match(name)
        if m is None:
            yield name, t
            continue
        prefix, kind = m.groups()
        if t.dim() != 3:
            raise ValueError(f"checkpoint weight {name!r}: expected [experts, out, in], got {tuple(t.shape)}")
        for e in range(t.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", t[e]  # [hidden, I]
            else:
                half = t.shape[1] // 2
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :half]  # [I, hidden]
                yield f"{prefix}.{e}.up_proj.weight", t[e, half:]  # [I, hidden]


class MoeWeights:
    """Mixin for a `LlamaForCausalLM` family with `SparseMoeBlock`s: per-expert HF names go to their slice of
    the stacked expert parameters, stacked checkpoint tensors are split first (`per_expert_weights`)."""

    def _resolve(self, hf_name: str) -> tuple[str, str | None]:
        m = _PER_EXPERT.match(hf_name)
        if m is None:
            return super()._resolve(hf_name)  # type: ignore[misc]
        prefix, expert, proj = m.groups()
        if proj == "down_proj":
            return f"{prefix}.down_proj", expert
        return f"{prefix}.gate_up_proj", f"{expert}.{proj.removesuffix('_proj')}"

    def _hf_name(self, key: str) -> str:
        """'...experts.gate_up_proj:3.up' -> '...experts.3.up_proj.weight' (for error messages)."""
        name, _, shard = key.partition(":")
        prefix, _, leaf = name.rpartition(".")
        if shard and prefix.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            expert, _, part = shard.partition(".")
            return f"{prefix}.{expert}.{part or 'down'}_proj.weight"
        return super()._hf_name(key)  # type: ignore[misc]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> set[str]:
        return super().load_weights(per_expert_weights(weights), strict=strict)  # type: ignore[misc]
