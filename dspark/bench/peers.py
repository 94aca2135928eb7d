"""Peer engines for `dspark bench offline --peers`, batch 1, greedy, the same prompt ids and output
lengths as dspark: HF transformers `generate` (plain, and prompt lookup) and llama-cpp-python
(plain, and `LlamaPromptLookupDecoding`). Not run directly.

Each peer function returns ({name: latency summary}, {name: why it was skipped}); a missing package
or an unusable model is a skip with a message, never an error. Timing per prompt: TTFT = a
1-token generation (HF) or the first streamed token (llama.cpp); TPOT = (time for all n tokens −
TTFT) / (n − 1). HF cannot stop early or go long: min_new_tokens = max_new_tokens = n.
"""

from __future__ import annotations

import time
from pathlib import Path


def _summary(ttft_s: list[float], tpot_s: list[float], num_tokens: int) -> dict:
    from dspark.bench.report import latency_summary

    return latency_summary(ttft_s, tpot_s) | {"tau": None, "total_output_tokens": num_tokens}


def _load_hf(model: str):
    import torch
    from transformers import AutoModelForCausalLM

    from dspark.models.loader import resolve_model_path

    path = Path(resolve_model_path(model))
    if path.is_file():  # GGUF: transformers dequantises it
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return hf.eval()


def hf_peer(*, model: str, prompt_ids: list[list[int]], lengths: list[int],
            prompt_lookup_num_tokens: int, num_threads: int | None = None,
            gguf: str | None = None) -> tuple[dict, dict]:
    """HF transformers greedy `generate`, plain and with prompt lookup."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        return {}, {"hf_transformers": f"transformers not installed ({e})"}
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        hf = _load_hf(model)
    except Exception as e:  # noqa: BLE001 - an unloadable model is a skipped peer
        return {}, {"hf_transformers": f"cannot load {model} with transformers: {e}"}
    pad_id = hf.generation_config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id
    variants = {"hf_transformers": {},
                f"hf_transformers_prompt_lookup_k{prompt_lookup_num_tokens}":
                    {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}}
    out = {}
    for name, extra in variants.items():
        ttft, tpot = [], []
        for ids, n in zip(prompt_ids, lengths):
            x = torch.tensor([ids])
            kwargs = dict(do_sample=False, pad_token_id=pad_id, **extra)
            with torch.inference_mode():
                t0 = time.perf_counter()
                hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kwargs)
                t1 = time.perf_counter()
                hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kwargs)
                t2 = time.perf_counter()
            ttft.append(t1 - t0)
            if n > 1:
                tpot.append(max((t2 - t1) - (t1 - t0), 1e-9) / (n - 1))
        out[name] = _summary(ttft, tpot, sum(lengths))
    return out, {}


def llama_without_repack(**kwargs):
    """llama_cpp.Llama with `use_extra_bufts` off: llama-cpp-python 0.3.36's runtime weight repacking
    segfaults in the first decode of the shipped Q4_1 GGUF on AVX-512 CPUs (F16/F32
    copies are unaffected). `Llama` takes no model-params override, so its default-params factory is
    swapped for the duration of the load."""
    from llama_cpp import llama as llama_module
    default = llama_module.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    llama_module.llama_cpp.llama_model_default_params = params
    try:
        return llama_module.Llama(**kwargs)
    finally:
        llama_module.llama_cpp.llama_model_default_params = default


def llama_cpp_peer(*, model: str, prompt_ids: list[list[int]], lengths: list[int],
                   prompt_lookup_num_tokens: int, num_threads: int | None = None,
                   gguf: str | None = None) -> tuple[dict, dict]:
    """llama.cpp through llama-cpp-python on a GGUF, plain and with prompt-lookup decoding."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {}, {"llama_cpp": "llama-cpp-python not installed (PEERS=1 bash scripts/setup.sh)"}
    import torch

    from dspark.models.loader import resolve_model_path

    path = Path(gguf) if gguf else Path(resolve_model_path(model))
    if path.suffix != ".gguf":
        return {}, {"llama_cpp": f"{path} is not a GGUF file; pass --llama-cpp-gguf"}
    variants = {"llama_cpp": None}
    try:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        variants[f"llama_cpp_prompt_lookup_k{prompt_lookup_num_tokens}"] = (
            lambda: LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup_num_tokens))
    except ImportError:
        pass
    n_ctx = max(len(ids) + n for ids, n in zip(prompt_ids, lengths)) + 64
    out, skipped = {}, {}
    if len(variants) == 1:
        skipped["llama_cpp_prompt_lookup"] = "llama_cpp.llama_speculative not available"
    for name, make_draft in variants.items():
        llm = llama_without_repack(model_path=str(path), n_ctx=n_ctx, verbose=False,
                                   n_threads=num_threads or torch.get_num_threads(),
                                   draft_model=make_draft() if make_draft else None)
        ttft, tpot = [], []
        for ids, n in zip(prompt_ids, lengths):
            t0 = time.perf_counter()
            t_first, count = None, 0
            for _token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
                count += 1
                if count == 1:
                    t_first = time.perf_counter()
                if count >= n:
                    break
            end = time.perf_counter()
            ttft.append(t_first - t0)
            if count > 1:
                tpot.append((end - t_first) / (count - 1))
        out[name] = _summary(ttft, tpot, sum(lengths)) | {"gguf": path.name}
        del llm
    return out, skipped
