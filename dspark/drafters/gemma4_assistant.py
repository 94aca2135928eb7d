"""Gemma 4's assistant (`Gemma4AssistantForCausalLM`, transformers' `gemma4_assistant`) as a drafter: `method: "mtp"`
on a Gemma 4 target (vLLM's spelling; "gemma4_assistant" is read as it), `model` the assistant's folder.

transformers' `SinglePositionMultiTokenCandidateGenerator`, op for op. The anchor t_a (the last committed token, not
yet run through the target) sits at position a; h_{a-1} is the target's final-normed hidden state at a - 1 (its
last-layer tap through its final norm: transformers' `hidden_states[-1]`):
    x = pre_projection([embed(t_a) * sqrt(D) ; h_{a-1}])  (the target's own embedding, [2D] -> the assistant's d)
    y = norm(layers(x));  logits = head(y);  h' = post_projection(y)  (d -> D)
Every assistant layer is Q-only (transformers' KV sharing across all its layers): its queries, RoPE'd at position a,
attend to the TARGET's K/V of positions < a, read in place from the engine's paged pool (`bind_target_kv`, never
copied): a full layer the last full-attention layer that owns K/V, a sliding layer the last sliding one (the layers
transformers returns as `shared_kv_states`); a sliding layer reads the last `sliding_window` + 1 of them
(transformers' bidirectional window, flipped to the past, is inclusive). Draft k + 1 repeats the step with draft k
and h' at the same position a over the same K/V: the assistant keeps no K/V, so it has no context rows of its own.
Indexing is EAGLE-3's first row (the tap at a - 1 paired with the anchor), but nothing else of `Eagle3Drafter`
applies (no rows per committed position, no scratch slots, a constant position): `extend_context` keeps only the
last committed position's hidden state per request.

The head: `lm_head` (the assistant's own tied embedding, no soft-capping), or with `use_ordered_embeddings` the
centroid head: `centroids(y)` picks the top `centroid_intermediate_top_k` clusters, `token_ordering` viewed
[clusters, vocab / clusters] names their tokens, those are scored by `lm_head`'s rows and every other token gets
-inf (transformers fills them with the batch's smallest logit - 1: the same argmax; here a draft law that does not
depend on the batch).

The folder's config is checked against the target's before any weight loads (backbone hidden size, vocabulary,
the head shapes and KV heads of the target layers it reads) and every tensor name and shape against its header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from dspark.drafters.base import ContextUpdate, DraftProposal, Drafter, ProposeBatch
from dspark.drafters.checkpoint import check_shapes, config_file, header_shapes, load_tensors, read_config
from dspark.drafters.draft_sampling import DraftAccumulator
from dspark.models.attention import SeqSpec, build_attn_metadata
from dspark.models.config import ModelConfig
from dspark.models.files import CONFIG_ERRORS, CheckpointError, check_num_layers, check_sizes, config_error
from dspark.models.gemma3 import _rounded
from dspark.models.gemma4 import Gemma4DecoderLayer, Gemma4RMSNorm, Gemma4Rotary, kv_layout, layer_shape
from dspark.models.family import family_of
from dspark.models.gemma4_hf import gemma4_fields
from dspark.models.layers import LMHead, Linear, VocabEmbedding
from dspark.models.llama import KVCache, LlamaForCausalLM

ARCHITECTURE = "Gemma4AssistantForCausalLM"
# k/v projections and norms a checkpoint may keep for its Q-only layers: transformers ignores them, so do we
_UNUSED_KV = re.compile(r"^model\.layers\.\d+\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


@dataclass(frozen=True)
class AssistantConfig:
    text: ModelConfig  # the assistant's own decoder (hidden size d, Q-only layers)
    backbone_hidden_size: int  # D: the target's hidden size it was trained on
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_intermediate_top_k: int


def read_assistant_config(path) -> AssistantConfig:
    """The folder's config.json as an `AssistantConfig`; anything but a Gemma 4 assistant is refused by name, a
    malformed one naming the file."""
    hf = read_config(path)
    archs = hf.get("architectures") or []
    if hf.get("model_type") != "gemma4_assistant" and ARCHITECTURE not in archs:
        raise ValueError(f"{path}: method 'mtp' on a Gemma 4 target drafts with a {ARCHITECTURE} checkpoint "
                         f"(model_type 'gemma4_assistant'); this config.json is model_type={hf.get('model_type')!r}, "
                         f"architectures={archs}; give the assistant's folder as \"model\"")
    file = config_file(path)
    try:
        check_sizes(hf, file=file)
        return _assistant_config(file, hf)
    except CONFIG_ERRORS as e:
        raise config_error(file, e) from None


def _assistant_config(file, hf: dict) -> AssistantConfig:
    text = dict(hf.get("text_config") or {})
    if not text:
        raise CheckpointError(f"{file}: the Gemma 4 assistant config has no text_config")
    for field, want in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False),
                        ("use_double_wide_mlp", False)):
        if (text.get(field) or 0) != want:
            raise CheckpointError(f"{file}: a Gemma 4 assistant has {field}={want}, this one {text.get(field)!r}")
    text.setdefault("vocab_size_per_layer_input", 0)
    fields = gemma4_fields({**text, "hidden_size_per_layer_input": 0})
    fields.update(num_kv_shared_layers=fields["num_hidden_layers"],
                  tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))
    cfg = AssistantConfig(ModelConfig(**fields), backbone_hidden_size=int(hf.get("backbone_hidden_size", 1536)),
                          use_ordered_embeddings=bool(hf.get("use_ordered_embeddings", False)),
                          num_centroids=int(hf.get("num_centroids", 2048)),
                          centroid_intermediate_top_k=int(hf.get("centroid_intermediate_top_k", 32)))
    if cfg.use_ordered_embeddings and (cfg.text.vocab_size % cfg.num_centroids
                                       or not 0 < cfg.centroid_intermediate_top_k <= cfg.num_centroids):
        raise CheckpointError(f"{file}: ordered embeddings need num_centroids ({cfg.num_centroids}) dividing vocab_size "
                         f"({cfg.text.vocab_size}) and 0 < centroid_intermediate_top_k "
                         f"({cfg.centroid_intermediate_top_k}) <= num_centroids")
    return cfg


def target_kv_layers(target: ModelConfig) -> dict[str, int]:
    """Attention kind -> the target layer whose K/V the assistant's layers of that kind read: the last layer of the
    kind that owns K/V (transformers' `store` layers)."""
    owners, _ = kv_layout(target)
    return {target.layer_type(i): i for i in owners}  # later owners overwrite earlier ones


class Gemma4Assistant(LlamaForCausalLM):
    """The assistant's weights under transformers' names (`LlamaForCausalLM`'s loader: q_proj into a q-only
    `qkv_proj`, gate|up fused); its forward is `step`."""

    def __init__(self, acfg: AssistantConfig, *, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        nn.Module.__init__(self)
        cfg = acfg.text
        self.config, self.assistant = cfg, acfg
        d, D = cfg.hidden_size, acfg.backbone_hidden_size
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(cfg.vocab_size, d, dtype=dtype, device=device)
        self.model.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i, shared=True, dtype=dtype, device=device)
                                          for i in range(cfg.num_hidden_layers))
        for layer in self.model.layers:  # transformers' window, flipped to the past, is inclusive: W + 1 keys
            if layer.self_attn.window is not None:
                layer.self_attn.window = cfg.sliding_window + 1
        self.model.norm = Gemma4RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.rotary = Gemma4Rotary(cfg, device=device)
        self.lm_head = LMHead(cfg.vocab_size, d, tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None,
                              dtype=dtype, device=device)
        self.pre_projection = Linear(2 * D, d, bias=False, dtype=dtype, device=device)
        self.post_projection = Linear(d, D, bias=False, dtype=dtype, device=device)
        self.kinds = sorted({cfg.layer_type(i) for i in range(cfg.num_hidden_layers)})
        if acfg.use_ordered_embeddings:
            self.masked_embedding = nn.Module()
            self.masked_embedding.centroids = Linear(d, acfg.num_centroids, bias=False, dtype=dtype, device=device)
            self.register_buffer("token_ordering", torch.zeros(cfg.vocab_size, dtype=torch.long, device=device))

    def expected_shapes(self) -> dict[str, list[int]]:
        """Every tensor the checkpoint must hold (transformers' names) and its shape."""
        out = {}
        for name, p in self.named_parameters():
            rows = getattr(self.get_submodule(name.rpartition(".")[0]), "shard_rows", None)
            for shard, (_, n) in (rows or {}).items():
                out[self._hf_name(f"{name}:{shard}")] = [n, *p.shape[1:]]
            if not rows:
                out[name] = list(p.shape)
        if self.assistant.use_ordered_embeddings:
            out["masked_embedding.token_ordering"] = [self.config.vocab_size]
        return out

    def load_assistant(self, tensors: dict[str, torch.Tensor]) -> None:
        ordering = tensors.pop("masked_embedding.token_ordering", None)
        self.load_weights(tensors.items())
        if self.assistant.use_ordered_embeddings:
            self.token_ordering.copy_(ordering.long())

    def step(self, x: torch.Tensor, positions: torch.Tensor, meta, kv: dict[str, KVCache]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, 2D] = [scaled target embedding ; target hidden], positions [n] -> (logits [n, vocab] fp32, the
        projected state [n, D] the next step reads)."""
        x = self.pre_projection(x)
        tables = {kind: self.rotary.lookup(positions, kind, x.dtype) for kind in self.kinds}
        for layer in self.model.layers:
            kind = layer.self_attn.layer_type
            x = layer(x, None, *tables[kind], meta, kv[kind])
        y = self.model.norm(x)  # [n, d]
        return self.compute_logits(y), self.post_projection(y)

    def compute_logits(self, y: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, vocab] fp32
        if not self.assistant.use_ordered_embeddings:
            return self.lm_head(y)
        a = self.assistant
        top = self.masked_embedding.centroids(y).topk(a.centroid_intermediate_top_k, dim=-1).indices  # [n, k]
        clusters = self.token_ordering.view(a.num_centroids, -1)  # [C, vocab / C]
        tokens = clusters[top].reshape(y.shape[0], -1)  # [n, k * vocab / C]
        rows = self.lm_head.dense_weight(tokens.reshape(-1)).to(y.dtype).view(*tokens.shape, -1)  # [n, m, d]
        picked = (rows @ y.unsqueeze(-1)).squeeze(-1)  # [n, m]
        out = torch.full((y.shape[0], self.config.vocab_size), float("-inf"), device=y.device)
        return out.scatter_(1, tokens, picked.float())


class Gemma4AssistantDrafter(Drafter):
    def __init__(self, model: Gemma4Assistant, target_model, *, target_config: ModelConfig, num_draft_tokens: int):
        self.model, self.num_draft_tokens = model, num_draft_tokens
        self._target = [target_model]  # a list: the target is no part of this drafter's modules
        self.tap_layer_ids = (target_config.num_hidden_layers - 1,)
        self.read_layers = target_kv_layers(target_config)  # kind -> target layer
        self.kv: dict[str, KVCache] = {}
        self.device = model.pre_projection.weight.device
        self._last: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (position, target hidden [D])

    def bind_target_kv(self, kv_caches: list[KVCache], kv_layer_of: list[int] | None) -> None:
        """The target's pool, in place: the entries of the layers `read_layers` names."""
        kv = {}
        for kind in self.model.kinds:
            layer = self.read_layers[kind]
            k_cache, v_cache = kv_caches[layer if kv_layer_of is None else kv_layer_of[layer]]
            want = layer_shape(self.model.config, kind)
            if tuple(k_cache.shape[2:]) != want:
                raise ValueError(f"Gemma 4 assistant: target layer {layer} ({kind}) holds K/V of (heads, head_dim)="
                                 f"{tuple(k_cache.shape[2:])}, its {kind} layers read {want}")
            kv[kind] = (k_cache, v_cache)
        self.kv = kv

    def release(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    @torch.inference_mode()
    def extend_context(self, update: ContextUpdate) -> dict[str, int]:
        segs = [s for s in update.segments if s.token_ids]
        if not segs:
            return {}
        if update.taps is None:
            raise ValueError("the Gemma 4 assistant needs the target's last-layer taps in ContextUpdate")
        rows = torch.tensor([s.tap_rows.stop - 1 for s in segs], device=update.taps.device)
        hidden = self._target[0].model.norm(update.taps[rows])  # [num_segs, D] final-normed, a copy
        for seg, h in zip(segs, hidden):
            self._last[seg.request_id] = (seg.start_pos + len(seg.token_ids) - 1, h)
        return {}

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        reqs = batch.requests
        acc = DraftAccumulator(reqs, method=batch.draft_sample_method)
        hidden, seqs = [], []
        for i, r in enumerate(reqs):
            a = r.anchor_pos
            last = self._last.get(r.request_id)
            if last is None or last[0] != a - 1:
                raise RuntimeError(f"Gemma 4 assistant has no target hidden state at position {a - 1} for request "
                                   f"{r.request_id!r} (anchor_pos={a})")
            hidden.append(last[1])
            # one query per request, reading the target's keys 0 .. a-1 (its causal limit at a - 1); nothing stored
            seqs.append(SeqSpec(block_table=r.block_table, num_cached=a - 1, num_query=1, token_offset=i, store=False))
        dev = self.device
        meta = build_attn_metadata(seqs, num_tokens=len(reqs), kv_block_size=batch.kv_block_size, device=dev)
        pos = torch.tensor([r.anchor_pos for r in reqs], dtype=torch.long, device=dev).clamp_(
            max=self.model.config.max_position_embeddings - 1)
        target = self._target[0].model
        h = torch.stack(hidden).to(dev)  # [n, D]
        ids = torch.tensor([r.all_ids[r.anchor_pos] for r in reqs], dtype=torch.long, device=dev)
        for _ in range(self.num_draft_tokens):
            emb = target.embed_tokens(ids)
            emb = emb * _rounded(target.embed_scale, emb.dtype)  # [n, D], the target's scaled embedding
            logits, h = self.model.step(torch.cat([emb, h.to(emb.dtype)], -1), pos, meta, self.kv)
            ids = acc.sample(logits)
        return acc.proposal()


# -- registry hooks (through dspark.drafters.mtp, which dispatches on the target) ------------------------

def check(spec, target_config: ModelConfig) -> AssistantConfig:
    """Before any weight: the folder is a Gemma 4 assistant that fits this target."""
    if family_of(target_config.architecture).mtp != "assistant":  # the family record names its assistant
        raise ValueError(f"a Gemma 4 assistant drafts for a Gemma 4 target, not {target_config.architecture}")
    if not spec.model:
        raise ValueError("method 'mtp' on a Gemma 4 target needs the assistant's folder as \"model\" "
                         f"(a {ARCHITECTURE} checkpoint)")
    acfg = read_assistant_config(spec.model)
    a, where = acfg.text, f"Gemma 4 assistant {spec.model!r}"
    for field, mine, theirs in (("backbone_hidden_size", acfg.backbone_hidden_size, target_config.hidden_size),
                                ("vocab_size", a.vocab_size, target_config.vocab_size)):
        if mine != theirs:
            field_t = "hidden_size" if field == "backbone_hidden_size" else field
            raise ValueError(f"{where}: {field}={mine} does not match the target's {field_t}={theirs}")
    reads = target_kv_layers(target_config)
    for kind in sorted({a.layer_type(i) for i in range(a.num_hidden_layers)}):
        if kind not in reads:
            raise ValueError(f"{where}: its {kind} layers read the target's last {kind} layer; the target has none")
        mine, theirs = layer_shape(a, kind), layer_shape(target_config, kind)
        if mine != theirs:
            raise ValueError(f"{where}: its {kind} layers read (num_key_value_heads, head_dim)={mine}; the target's "
                             f"layer {reads[kind]} ({kind}) holds {theirs}")
        if a.num_attention_heads % mine[0]:
            raise ValueError(f"{where}: num_attention_heads={a.num_attention_heads} is not a multiple of the "
                             f"{kind} KV heads ({mine[0]})")
    shapes = {k: v for k, v in header_shapes(spec.model).items() if not _UNUSED_KV.match(k)}
    check_num_layers(a.num_hidden_layers, shapes, file=config_file(spec.model), limit=target_config.num_hidden_layers,
                     limit_what="the target's num_hidden_layers", key="text_config.num_hidden_layers")
    try:
        expected = Gemma4Assistant(acfg, device="meta").expected_shapes()
    except CONFIG_ERRORS as e:  # a config no module is built from
        raise config_error(config_file(spec.model), e) from None
    optional = {"lm_head.weight": [a.vocab_size, a.hidden_size]} if a.tie_word_embeddings else {}
    check_shapes(expected, shapes, where=where, optional=optional)
    return acfg


def build(spec, *, target_config, target_model, dtype, device) -> Gemma4AssistantDrafter:
    acfg = check(spec, target_config)
    model = Gemma4Assistant(acfg, dtype=dtype, device=device)
    tensors = load_tensors(spec.model, dtype=dtype)
    if acfg.text.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.no_grad():
        model.load_assistant({k: v.to(device) for k, v in tensors.items() if not _UNUSED_KV.match(k)})
    return Gemma4AssistantDrafter(model.eval(), target_model, target_config=target_config,
                                  num_draft_tokens=spec.num_speculative_tokens)


__all__ = ["AssistantConfig", "Gemma4Assistant", "Gemma4AssistantDrafter", "build", "check", "read_assistant_config",
           "target_kv_layers"]
