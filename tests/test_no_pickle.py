"""No pickle anywhere in loading: an audit of the package's source (every `torch.load` passes
`weights_only=True`, nothing imports pickle / dill / cloudpickle / joblib / marshal / shelve,
`numpy.load` never allows pickle, every `from_pretrained` is local only), and the loaders refuse a
pickle checkpoint folder. Weights are safetensors or GGUF, configs JSON.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dspark"
PICKLERS = {"pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve", "_pickle"}


def _calls(tree: ast.AST, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if called == name:
                yield node


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _sources():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50, "the audit must see the package"
    return [(f.relative_to(PACKAGE.parent), ast.parse(f.read_text())) for f in files]


def test_no_pickle_in_the_package():
    problems = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                continue
            problems += [f"{path}:{node.lineno} imports {n}" for n in names if n in PICKLERS]
        for call in _calls(tree, "load"):
            f = call.func
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            if owner == "torch":
                wo = _kw(call, "weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    problems.append(f"{path}:{call.lineno} torch.load without weights_only=True")
            if owner in ("np", "numpy"):
                ap = _kw(call, "allow_pickle")
                if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                    problems.append(f"{path}:{call.lineno} numpy.load with allow_pickle")
        for call in _calls(tree, "from_pretrained"):
            if "bench/peers.py" in str(path):
                continue  # the benchmark's HF peer reads the same local files
            lo = _kw(call, "local_files_only")
            if not (isinstance(lo, ast.Constant) and lo.value is True):
                problems.append(f"{path}:{call.lineno} from_pretrained without local_files_only=True")
    assert not problems, "\n".join(problems)


def test_a_pickle_checkpoint_folder_is_refused(tmp_path):
    from dspark.models.loader import SafetensorsSource

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 8, '
                                          '"hidden_size": 8, "intermediate_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 1}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(FileNotFoundError, match="pickle checkpoints are not loaded"):
        SafetensorsSource(tmp_path)


@pytest.mark.parametrize("method", ["dspark", "eagle3", "draft_model"])
def test_hub_names_are_never_fetched(method):
    """A model or drafter path is a local path: a hub-style name that is no local file or folder is
    an error naming it, from the path checks (the loaders never call the hub)."""
    import torch

    from dspark.config import SpecConfig
    from dspark.drafters import build_drafter
    from dspark.models.loader import resolve_model_path
    from server_harness import TINY, build_tiny_model

    with pytest.raises(FileNotFoundError, match="HuggingFaceTB/SmolLM2-135M"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises((FileNotFoundError, ValueError), match="org/name"):
        build_drafter(SpecConfig(method=method, model="org/name", num_speculative_tokens=4),
                      target_config=TINY, target_model=build_tiny_model(), dtype=torch.float32,
                      device="cpu")
