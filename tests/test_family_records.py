"""A model family and a drafter method are each one record: a toy Llama-like family (its own HF architecture
and model_type, Llama's module class) registered with one `ModelFamily` and a toy drafter (prompt lookup under
a new name) registered with one `DrafterMethod` are served through `dspark.LLM`, and greedy decoding equals the
same weights served as plain Llama; unregistered, both are refused by the config checks.

    pytest tests/test_family_records.py -q
"""

from __future__ import annotations

import json
import shutil

import pytest

from dspark.drafters.methods import DrafterMethod, register_method, unregister_method
from dspark.drafters.ngram import NgramDrafter
from dspark.llm import LLM
from dspark.models.config import ModelConfig
from dspark.models.family import ModelFamily, family_of, register_family, unregister_family
from dspark.models.llama import LlamaForCausalLM
from dspark.sampling import SamplingParams


class ToyLlamaForCausalLM(LlamaForCausalLM):
    """Llama's module under another name; counts its instances (the registry reached `build_model`)."""

    built = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        type(self).built += 1


# the toy family: one record (Llama's config.json field names, reader and writer by default)
TOY_FAMILY = ModelFamily(architecture="ToyLlamaForCausalLM", model_class=ToyLlamaForCausalLM,
                         model_types=("toy_llama",))


class ToyLookupDrafter(NgramDrafter):
    """Prompt lookup under a new method name; counts its proposals."""

    proposals = 0

    def propose(self, batch):
        type(self).proposals += 1
        return super().propose(batch)


def build(spec, *, target_config, target_model, dtype, device) -> ToyLookupDrafter:
    """The toy method's builder (its record names this module)."""
    return ToyLookupDrafter(num_draft_tokens=spec.num_speculative_tokens,
                            prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)


# the toy method: one record
TOY_METHOD = DrafterMethod("toy_lookup", __name__, prompt_lookup=True)
TOY_SPEC = {"method": "toy_lookup", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture
def toy_registered():
    register_family(TOY_FAMILY)
    register_method(TOY_METHOD)
    try:
        yield
    finally:
        unregister_family(TOY_FAMILY.architecture)
        unregister_method(TOY_METHOD.name)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the tiny random Llama folder, the same files with config.json naming the toy family)."""
    from tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("family")
    llama = write_tiny_checkpoint(root / "llama")
    toy = shutil.copytree(llama, root / "toy")
    hf = json.loads((llama / "config.json").read_text())
    (toy / "config.json").write_text(json.dumps({**hf, "architectures": ["ToyLlamaForCausalLM"],
                                                 "model_type": "toy_llama"}))
    return llama, toy


PROMPTS = [[1, 9, 10, 11, 12, 9, 10, 11], [1, 20, 21, 22, 20, 21], list(range(1, 12))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_unregistered_toy_family_and_method_are_refused(folders):
    _, toy = folders
    assert family_of("ToyLlamaForCausalLM") is None
    with pytest.raises(ValueError, match="architecture 'ToyLlamaForCausalLM' is not supported"):
        LLM(str(toy))
    with pytest.raises(ValueError, match="speculative method 'toy_lookup' unknown"):
        LLM(str(folders[0]), speculative_config=TOY_SPEC)


def test_toy_family_reads_and_writes_its_config(toy_registered):
    hf = {"model_type": "toy_llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = ModelConfig.from_hf(hf)  # no `architectures`: the model_type names the family
    assert cfg.architecture == "ToyLlamaForCausalLM" and not cfg.qk_norm
    out = cfg.to_hf()
    assert out["architectures"] == ["ToyLlamaForCausalLM"] and out["model_type"] == "toy_llama"
    assert ModelConfig.from_hf(out) == cfg


def test_toy_family_serves_as_llama_and_toy_drafter_speculates(folders, toy_registered):
    llama, toy = folders
    plain = _tokens(LLM(str(llama)))
    built = ToyLlamaForCausalLM.built
    served = LLM(str(toy))
    assert ToyLlamaForCausalLM.built > built  # the record's class, reached through the loader
    assert served.engine.model_config.architecture == "ToyLlamaForCausalLM"
    assert _tokens(served) == plain
    proposals = ToyLookupDrafter.proposals
    speculative = LLM(str(toy), speculative_config=TOY_SPEC)
    assert _tokens(speculative) == plain
    assert ToyLookupDrafter.proposals > proposals  # the record's drafter proposed
