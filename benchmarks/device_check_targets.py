"""The new target families on the device, for benchmarks/device_check.py: a tiny random Gemma 4 (sliding and full
layers of their own head sizes, K = V layers, KV shared by the last layers, per-layer inputs) and a tiny random
hybrid Qwen3.5 (Gated DeltaNet state slots), built in place with the same weights on the CPU and on the device:

- greedy output on the device (fp32) equals the CPU's; speculative (prompt lookup) equals plain on the device;
- batch-1 and c = 8 decode tok/s, plain, on the device (eager: neither family captures CUDA graphs).

    python benchmarks/device_check_targets.py --device cpu   # the CPU rehearsal
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.engine import Engine
from dspark.models import build_model
from dspark.models.config import ModelConfig
from dspark.sampling import SamplingParams

S, F, L = "sliding_attention", "full_attention", "linear_attention"
CONFIGS = {
    "gemma4": ModelConfig(
        architecture="Gemma4ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25}, max_position_embeddings=512,
        tie_word_embeddings=True, qk_norm=True, bos_token_id=2, eos_token_ids=(1,), hidden_activation="gelu_pytorch_tanh",
        layer_types=(S, F, S, S, F, S, F), sliding_window=8, rope_local_theta=10_000.0, query_pre_attn_scalar=1.0,
        final_logit_softcapping=30.0, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_kv_shared_layers=3, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, use_double_wide_mlp=True),
    "qwen3_5": ModelConfig(
        architecture="Qwen3_5ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, qk_norm=True,
        bos_token_id=1, eos_token_ids=(2,), layer_types=(L, L, F, L), linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=0.5, attn_output_gate=True),
}


def _weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _engine(cfg: ModelConfig, weights, device: str, *, ngram: bool, max_num_seqs: int) -> Engine:
    model = build_model(cfg, device=device)
    model.load_state_dict(weights, strict=False)
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3) if ngram \
        else None
    drafter = NgramDrafter(num_draft_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3) if ngram else None
    config = EngineConfig(device=device, dtype="float32", spec=spec,
                          cache=CacheConfig(kv_block_size=8, num_kv_blocks=256, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs))
    return Engine(config, model=model, model_config=cfg, drafter=drafter)


def _generate(engine: Engine, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float]:
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)) for p in prompts]
    out = {i: [] for i in ids}
    start = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in ids], time.perf_counter() - start


def check_new_targets(device: str, quick: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(3, 250, (5,), generator=g).tolist() * 8)[:24 + 4 * i] for i in range(8)]
    new = 16 if quick else 64
    out = {}
    for name, cfg in CONFIGS.items():
        weights = _weights(cfg)
        cpu, _ = _generate(_engine(cfg, weights, "cpu", ngram=False, max_num_seqs=8), prompts, new)
        plain, seconds_c8 = _generate(_engine(cfg, weights, device, ngram=False, max_num_seqs=8), prompts, new)
        spec, _ = _generate(_engine(cfg, weights, device, ngram=True, max_num_seqs=8), prompts, new)
        b1 = _engine(cfg, weights, device, ngram=False, max_num_seqs=1)
        _generate(b1, prompts[:1], 4)  # warm-up
        _, seconds_b1 = _generate(b1, prompts[:1], new)
        out[name] = {"pass": plain == cpu and spec == plain, "device_equals_cpu": plain == cpu,
                     "speculative_equals_plain": spec == plain, "tok_s_b1": round(new / seconds_b1, 1),
                     "tok_s_c8": round(8 * new / seconds_c8, 1)}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(json.dumps(check_new_targets(args.device, args.quick)))
