"""The target's own multi-token-prediction layer as a drafter (`method: "mtp"`, vLLM's spelling; "qwen3_next_mtp"
and "qwen3_5_mtp" are read as it): Qwen3-Next and Qwen3.5 checkpoints ship it as `mtp.*` beside the decoder.

The layer at position p reads the target's final-normed hidden state at p and the embedding of token p + 1:
    x = fc([norm_e(embed(t_{p+1})) ; norm_h(h_p)]);  x = decoder_layer(x) (gated full attention + MLP / MoE);
    out = norm(x);  logits(t_{p+2}) = lm_head(out)
with its own K/V at slot p of one extra pool layer; the embedding and the head are the target's (shared, not
copied). Drafting k > 1 feeds the layer's own output in place of the missing target hidden state. That
pairing is EAGLE-3's (a tap at p with token p + 1, feature recycling), so the drafter is `Eagle3Drafter`'s
context and proposal logic over this module; the target's hidden state is its final norm over the last
layer's tap.

The weights come from the target's folder or GGUF file (no `model` in the speculative config: llama.cpp's converter
writes the layer into the file) or from a folder given as `model`; a checkpoint without `mtp.*` tensors, or with more than one MTP layer, is refused before any weight
loads. On a Gemma 4 target "mtp" is the separate assistant checkpoint given as `model` (vLLM's spelling too):
`check` and `build` hand it to `gemma4_assistant.py`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspark.drafters.base import Drafter
from dspark.drafters.checkpoint import header_shapes, safetensors_files
from dspark.drafters.eagle3 import Eagle3Drafter
from dspark.models.attention import AttnMetadata, flat_batch
from dspark.models.config import ModelConfig
from dspark.models.files import open_safetensors
from dspark.models.gemma3 import GemmaRMSNorm
from dspark.models.family import architectures_with, family_for_gguf, family_of
from dspark.models.layers import Linear, rope_cos_sin
from dspark.models.llama import LlamaForCausalLM
from dspark.models.moe import MoeWeights
from dspark.models.qwen3_next import HybridDecoderLayer, Qwen3NextForCausalLM

PREFIX = "mtp."


@dataclass(frozen=True)
class MtpConfig:
    tap_layer_ids: tuple[int, ...]  # the target's last decoder layer
    num_key_value_heads: int
    head_dim: int


class MtpModel(MoeWeights, LlamaForCausalLM):
    """The MTP layer; it loads weights as the target family does (its forward and logits are its own)."""

    packed_modules_mapping = Qwen3NextForCausalLM.packed_modules_mapping

    def __init__(self, target: ModelConfig, *, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        nn.Module.__init__(self)
        d = target.hidden_size
        self.config = MtpConfig((target.num_hidden_layers - 1,), target.num_key_value_heads, target.head_dim)
        self.max_positions = target.max_position_embeddings
        self.fc = Linear(2 * d, d, bias=False, dtype=dtype, device=device)
        self.pre_fc_norm_embedding = GemmaRMSNorm(d, eps=target.rms_norm_eps, dtype=dtype, device=device)
        self.pre_fc_norm_hidden = GemmaRMSNorm(d, eps=target.rms_norm_eps, dtype=dtype, device=device)
        layer_cfg = dataclasses.replace(target, num_hidden_layers=1, layer_types=("full_attention",),
                                        mlp_only_layers=())
        self.layers = nn.ModuleList([HybridDecoderLayer(layer_cfg, 0, dtype=dtype, device=device)])
        self.norm = GemmaRMSNorm(d, eps=target.rms_norm_eps, dtype=dtype, device=device)
        self._target: list[nn.Module] = []  # the shared target (a list: not a submodule of this one)

    def bind_target(self, target: nn.Module) -> "MtpModel":
        self._target = [target]
        return self

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:  # [n, d] last-layer taps -> the target's hidden [n, d]
        return self._target[0].model.norm(taps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, meta: AttnMetadata,
                kv_cache) -> torch.Tensor:  # ids, positions [n], hidden [n, d] -> normed output [n, d]
        target = self._target[0].model
        emb = self.pre_fc_norm_embedding(target.embed_tokens(input_ids))
        x = self.fc(torch.cat([emb, self.pre_fc_norm_hidden(hidden)], -1))  # [n, d]
        cos, sin = rope_cos_sin(positions, target.inv_freq, x.dtype)
        return self.norm(self.layers[0](x, cos, sin, meta, kv_cache))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, vocab] fp32
        return self._target[0].compute_logits(hidden).float()

    def load_mtp_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """`mtp.*` tensors with HF names: the target family's loader (fused q/k/v and gate/up, experts per
        expert or stacked), every parameter required."""
        self.load_weights((name[len(PREFIX):], t) for name, t in tensors.items())


class MtpDrafter(Eagle3Drafter):
    """`Eagle3Drafter`'s paged context and proposal over the MTP layer."""

    def _forward(self, chunks: list[tuple[list[int], int, list[int]]], hidden: torch.Tensor,
                 kv_block_size: int) -> torch.Tensor:
        dev = self.device
        ids, positions, meta = flat_batch(chunks, kv_block_size=kv_block_size, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev).clamp_(max=self.model.max_positions - 1)
        return self.model(torch.tensor(ids, dtype=torch.long, device=dev), pos, hidden, meta, self.kv_cache)


# -- registry hooks ----------------------------------------------------------------------------------

def check(spec, target_config) -> None:
    """Before any weight: a hybrid target with exactly one MTP layer in the checkpoint (a Gemma 4 target: its
    assistant's folder, `gemma4_assistant.check`)."""
    how = family_of(target_config.architecture).mtp  # the family's record: its own layers, or an assistant
    if how == "assistant":
        from dspark.drafters.gemma4_assistant import check as check_assistant
        check_assistant(spec, target_config)
        return
    if how != "layers":
        raise ValueError(f"method 'mtp' drafts with a checkpoint's own MTP layers (Qwen3-Next, Qwen3.5: "
                         f"{', '.join(architectures_with('mtp', 'layers'))}) or Gemma 4's assistant; "
                         f"{target_config.architecture} has neither")
    if not spec.model:
        raise ValueError("method 'mtp' needs the checkpoint folder holding the mtp.* tensors (the engine passes "
                         "the target's own)")
    names = _mtp_names(Path(spec.model))
    if not names:
        raise ValueError(f"{spec.model}: the checkpoint has no mtp.* tensors (no MTP layer to draft with)")
    layers = {int(m.group(1)) for n in names if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    if layers != {0}:
        raise ValueError(f"{spec.model}: MTP layers {sorted(layers)}; dspark drafts with exactly one (mtp.layers.0)")


def build(spec, *, target_config, target_model, dtype, device) -> Drafter:
    if family_of(target_config.architecture).mtp == "assistant":
        from dspark.drafters.gemma4_assistant import build as build_assistant
        return build_assistant(spec, target_config=target_config, target_model=target_model, dtype=dtype,
                               device=device)
    check(spec, target_config)
    model = MtpModel(target_config, dtype=dtype, device=device)
    tensors = {name: t.to(dtype) for name, t in _mtp_tensors(Path(spec.model))}
    with torch.no_grad():
        model.load_mtp_weights(tensors)
    return MtpDrafter(model.bind_target(target_model).eval(), num_draft_tokens=spec.num_speculative_tokens)


def _gguf_mtp(path: Path):
    """(the file's GGUFSource, GGUF name -> HF name of its MTP layer's tensors): llama.cpp's converter writes the
    layer as one block past the decoder's (`models.gguf_families` names it back to `mtp.*`)."""
    from dspark.models.loader import GGUFSource
    source = GGUFSource(path)
    record = family_for_gguf(source.field("general.architecture"))
    family = record and record.gguf
    names = {} if family is None else {t.name: family.hf_name(t.name, source.config) for t in source.reader.tensors}
    return source, {g: h for g, h in names.items() if h.startswith(PREFIX)}


def _mtp_names(path: Path) -> list[str]:
    """The checkpoint's `mtp.*` tensor names: an HF folder's, or a GGUF file's."""
    if path.suffix == ".gguf":
        return list(_gguf_mtp(path)[1].values())
    return [n for n in header_shapes(path) if n.startswith(PREFIX)]


def _mtp_tensors(path: Path):
    """(name, tensor) of the checkpoint's `mtp.*` tensors only, not the decoder's: from an HF folder's safetensors,
    or dequantized from a GGUF file with the converter's transforms undone."""
    if path.suffix == ".gguf":
        source, mtp = _gguf_mtp(path)
        yield from source.weights(skip={t.name for t in source.reader.tensors} - set(mtp))
        return
    for file in safetensors_files(path):
        with open_safetensors(file) as f:
            for k in f.keys():
                if k.startswith(PREFIX):
                    yield k, f.get_tensor(k).clone()
