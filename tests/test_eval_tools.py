"""Tests for the evaluation tools: acceptance statistics (dspark/speculation/acceptance.py), `dspark eval
accept` (dspark/train/eval_accept.py), `dspark parity` (dspark/parity.py), `dspark calibrate`
(dspark/train/calibrate_cli.py) and `dspark profile` (dspark/cli_profile.py), on hand-made
statistics and a tiny random Llama with the n-gram drafter (no downloads).

    pytest tests/test_eval_tools.py -q
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from conftest import TINY_LLAMA
from dspark.bench.datasets import BenchPrompt
from dspark.config import CacheConfig, EngineConfig, SpecConfig
from dspark.drafters.base import DraftProposal
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.request import SpecStats
from dspark.speculation.acceptance import AcceptCounts, RoundRecord, summarize
from dspark.verify.rejection import VerifyResult

GAMMA = 4


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls on a shared 2-core box: one intra-op thread is ~50x faster under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ByteChatTokenizer:
    """Stand-in for the tokenizer bundle: a chat turn → [bos] + its bytes folded into the vocab."""

    tokenizer = None

    def __init__(self, vocab_size: int = TINY_LLAMA.vocab_size):
        self.vocab_size = vocab_size

    def apply_chat_template(self, conversation, add_generation_prompt=True):
        text = conversation[0]["content"]
        return [1] + [3 + b % (self.vocab_size - 3) for b in text.encode()][:40]

    def encode(self, text):
        return self.apply_chat_template([{"content": text}])


class ConfidentNgram(NgramDrafter):
    """N-gram drafts plus a deterministic pseudo-confidence per draft token (for calibration)."""

    has_confidence = True

    def propose(self, batch):
        p = super().propose(batch)
        z = ((p.draft_ids * 37) % 17).float() / 2 - 4.0  # [num_reqs, γ] logits in [-4, 4]
        return DraftProposal(p.draft_ids, p.draft_probs, torch.sigmoid(z), p.num_valid)


def tiny_llm(drafter_cls=NgramDrafter, *, seed: int = 0) -> LLM:
    from dspark.models import build_model
    torch.manual_seed(seed)
    model = build_model(TINY_LLAMA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, p.shape[-1] ** -0.5)
    spec = SpecConfig(method="ngram", num_speculative_tokens=GAMMA, prompt_lookup_min=1,
                      prompt_lookup_max=3)
    cache = CacheConfig(num_kv_blocks=96, kv_block_size=16)
    config = EngineConfig(model="tiny", cache=cache, spec=spec)
    drafter = drafter_cls(num_draft_tokens=GAMMA, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = Engine(config, model=model, model_config=TINY_LLAMA, drafter=drafter)
    llm = LLM(engine=engine, tokenizer=None)
    llm.tokenizer = ByteChatTokenizer()
    return llm


def prompts(n: int, domain: str = "math") -> list[BenchPrompt]:
    return [BenchPrompt(f"question {i}: " + "abc " * (i % 3), domain, "test") for i in range(n)]


def _parse(register, argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


# -- acceptance statistics ---------------------------------------------------------------------------

# γ = 3. Request A: rounds accepting 3, 1, 0; request B: 2, 2.
ROUNDS = [RoundRecord("a", 3, 3), RoundRecord("a", 3, 1), RoundRecord("a", 3, 0),
          RoundRecord("b", 3, 2), RoundRecord("b", 3, 2)]
STATS = [SpecStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=4, accepted_per_pos=[2, 1, 1]),
         SpecStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4, accepted_per_pos=[2, 2, 0])]


def test_tau_and_per_position_rates_from_spec_stats():
    counts = AcceptCounts.from_spec_stats(STATS, num_draft_tokens=3)
    assert counts.exact and counts.num_rounds == 5
    assert counts.acceptance_length == pytest.approx(1 + 8 / 5)  # bonus counted
    assert counts.accepted_per_pos == (4, 3, 1)
    assert counts.survival == pytest.approx([4 / 5, 3 / 5, 1 / 5])
    assert counts.conditional_acceptance == pytest.approx([4 / 5, 3 / 4, 1 / 3])
    assert counts.verify_rate == pytest.approx((8 + 5) / (15 + 5))
    assert counts == AcceptCounts.from_rounds(ROUNDS)  # exact path agrees on full-length rounds


def test_rates_from_rounds_with_short_verification():
    rounds = [RoundRecord("a", 1, 1), RoundRecord("a", 3, 1), RoundRecord("b", 2, 0),
              RoundRecord("b", 0, 0)]  # a round without drafts is not a round
    counts = AcceptCounts.from_rounds(rounds)
    assert counts.num_rounds == 3 and counts.acceptance_length == pytest.approx(1 + 2 / 3)
    assert counts.verified_per_pos == (3, 2, 1)
    assert counts.trials_per_pos == (3, 1, 0)  # position 2 tried only where position 1 passed
    assert counts.conditional_acceptance == [pytest.approx(2 / 3), 0.0, None]
    assert counts.survival == [pytest.approx(2 / 3), 0.0, 0.0]
    short = AcceptCounts.from_spec_stats(
        [SpecStats(num_drafts=2, num_draft_tokens=3, num_accepted_tokens=1, accepted_per_pos=[1])],
        num_draft_tokens=2)
    assert not short.exact  # the totals reveal rounds shorter than γ
    total = counts + AcceptCounts.from_rounds(ROUNDS)
    assert total.num_rounds == 8 and total.accepted_per_pos == (6, 3, 1)


def test_domain_means_and_macro_match_paper_table1():
    # Qwen3-4B DSpark row of Table 1 (reference §10): macro 4.727, math 5.57, code 5.12, chat 3.49.
    taus = {"gsm8k": 6.11, "math": 5.70, "aime25": 4.89, "mbpp": 5.13, "humaneval": 5.38, "lcb": 4.86,
            "mt-bench": 3.64, "alpaca": 3.54, "arena": 3.29}
    domains = dict.fromkeys(["gsm8k", "math", "aime25"], "math") | dict.fromkeys(
        ["mbpp", "humaneval", "lcb"], "code") | dict.fromkeys(["mt-bench", "alpaca", "arena"], "chat")
    s = summarize(taus, domains)
    assert s["macro"] == pytest.approx(4.727, abs=5e-4)
    assert s["domain_means"] == pytest.approx({"math": 5.567, "code": 5.123, "chat": 3.49}, abs=5e-4)


# -- eval accept -------------------------------------------------------------------------------------

def test_eval_accept_tiny_model_and_table():
    from dspark.train.eval_accept import evaluate_acceptance, markdown_table, summarize_results
    llm = tiny_llm()
    data = {"gsm8k": prompts(3, "math"), "mt-bench": prompts(2, "chat")}
    results = evaluate_acceptance(llm, data, temperatures=[0.0, 1.0], max_tokens=24, seed=3)
    assert [(r["dataset"], r["temperature"]) for r in results] == [
        ("gsm8k", 0.0), ("mt-bench", 0.0), ("gsm8k", 1.0), ("mt-bench", 1.0)]
    for r in results:
        assert r["num_rounds"] > 0 and r["exact"]
        assert 1.0 <= r["acceptance_length"] <= 1 + GAMMA
        assert len(r["conditional_acceptance"]) <= GAMMA
    assert llm.engine.spec.verify_observers == []  # the recorder is detached afterwards
    doc = {"label": "ngram", "results": results, "summary": summarize_results(results)}
    assert doc["summary"]["T=0"]["macro"] == pytest.approx(
        (results[0]["acceptance_length"] + results[1]["acceptance_length"]) / 2)
    math_pooled = doc["summary"]["T=0"]["domain_pooled"]["math"]  # one dataset: pooled == its own
    assert math_pooled["acceptance_length"] == pytest.approx(results[0]["acceptance_length"])
    assert math_pooled["conditional_acceptance"] == results[0]["conditional_acceptance"]
    lines = markdown_table([doc, doc | {"label": "other"}]).splitlines()
    assert lines[0] == "| Drafter | T | GSM8K | MT-Bench | Math | Chat | Macro |"
    assert len(lines) == 2 + 4 and lines[2].startswith("| ngram | 0 | ")


def test_eval_accept_cli(monkeypatch, tmp_path, capsys):
    from dspark.train import eval_accept
    llm = tiny_llm()
    monkeypatch.setattr("dspark.llm.LLM", lambda **kw: llm)
    monkeypatch.setattr("dspark.bench.datasets.load_prompts", lambda name, n, seed: prompts(n))
    args = _parse(eval_accept.register, [
        "eval", "accept", "--speculative-config", '{"method": "ngram", "length_policy": "threshold"}',
        "--datasets", "gsm8k,math500", "--temperatures", "0", "--num-prompts", "2",
        "--max-tokens", "16",
        "--out", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "t.md")])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["speculative_config"]["length_policy"] == "fixed"
    assert set(doc["summary"]["T=0"]["acceptance_length"]) == {"gsm8k", "math500"}
    assert (tmp_path / "t.md").read_text().startswith("| Drafter | T | GSM8K | MATH500 |")
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["label"] == "ngram" and "macro" in last["T=0"]


def test_eval_accept_base_model_continues_the_text(monkeypatch, tmp_path):
    """A model without a chat template (auto -> plain): each prompt's text is submitted and continued, the
    chat path never taken, and the JSON says which format ran."""
    from dspark.train import eval_accept
    llm = tiny_llm()
    monkeypatch.setattr(llm.tokenizer, "chat_template", None, raising=False)
    monkeypatch.setattr(llm, "chat", lambda *a, **k: pytest.fail("a base model has no chat template"))
    submitted = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda texts, params: submitted.extend(texts) or generate(texts, params))
    monkeypatch.setattr("dspark.llm.LLM", lambda **kw: llm)
    data = prompts(2)
    monkeypatch.setattr("dspark.bench.datasets.load_prompts", lambda name, n, seed: data)
    args = _parse(eval_accept.register, [
        "eval", "accept", "--speculative-config", '{"method": "ngram"}', "--datasets", "gsm8k",
        "--temperatures", "0", "--num-prompts", "2", "--max-tokens", "8", "--out", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["prompt_format"] == "plain" and submitted == [p.prompt for p in data]
    assert doc["results"][0]["num_rounds"] > 0


# -- parity ------------------------------------------------------------------------------------------

def _accept_everything_argmax(*, target_argmax, draft_ids):
    """A broken verifier on the engine's all-greedy lane (argmax ids): every draft is accepted and the
    bonus is the argmax after the last one."""
    return VerifyResult(num_accepted=[len(d) for d in draft_ids],
                        output_ids=[list(d) + [ids[len(d)]] for ids, d in zip(target_argmax, draft_ids)],
                        is_bonus=[True] * len(draft_ids))


def _accept_everything_one(target_argmax, draft_ids):
    """The same broken rule for one request on the per-request greedy lane (verify/sampler.py)."""
    return len(draft_ids), list(draft_ids) + [target_argmax[len(draft_ids)]], True


def _break_verifier(monkeypatch) -> None:
    monkeypatch.setattr("dspark.verify.sampler.verify_greedy_argmax", _accept_everything_argmax)
    monkeypatch.setattr("dspark.verify.sampler.accept_greedy", _accept_everything_one)


def test_first_divergence():
    from dspark.parity import first_divergence
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_parity_ngram_exact_and_broken_verifier_detected(monkeypatch):
    from dspark.parity import check_parity
    llm = tiny_llm()
    token_prompts = [[1] + [3 + (i * 7 + j * 13) % 250 for j in range(8 + i)] for i in range(5)]
    report = check_parity(llm, token_prompts, max_tokens=32, chat=False)
    assert report.ok and report.num_exact == 5, report.to_dict()
    assert report.num_spec_rounds > 0
    _break_verifier(monkeypatch)
    broken = check_parity(llm, token_prompts, max_tokens=32, chat=False)
    assert not broken.ok, "accepting every n-gram draft must change some greedy output"
    m = broken.mismatches[0]
    assert 0 <= m.first_divergent_pos < 32 and m.plain_token_id != m.spec_token_id


@pytest.mark.parametrize("broken", [False, True])
def test_parity_cli_exit_code(monkeypatch, capsys, tmp_path, broken):
    from dspark import parity
    llm = tiny_llm()
    monkeypatch.setattr("dspark.llm.LLM", lambda **kw: llm)
    monkeypatch.setattr("dspark.bench.datasets.load_prompts", lambda name, n, seed: prompts(n))
    if broken:
        _break_verifier(monkeypatch)
    out = tmp_path / "parity.json"
    args = _parse(parity.register, ["parity", "--speculative-config", '{"method": "ngram"}',
                                    "--num-prompts", "4", "--max-tokens", "24", "--out", str(out)])
    rc = args.func(args)
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == (1 if broken else 0) and (last["num_mismatch"] > 0) == broken
    written = json.loads(out.read_text())  # the result file: the report with its provenance
    assert written["num_mismatch"] == last["num_mismatch"] and written["num_prompts"] == 4
    assert {"command", "date", "machine", "matmul_dtype", "kernels"} <= set(written)


def test_parity_cli_takes_base_model_prompts(monkeypatch, capsys):
    """`--prompt-format plain`: each prompt's text is continued as it is (a base model), not run as a chat."""
    from dspark import parity
    llm = tiny_llm()
    monkeypatch.setattr("dspark.llm.LLM", lambda **kw: llm)
    monkeypatch.setattr("dspark.bench.datasets.load_prompts", lambda name, n, seed: prompts(n))
    monkeypatch.setattr(llm, "chat", lambda *a, **kw: pytest.fail("a plain prompt went through the chat template"))
    args = _parse(parity.register, ["parity", "--speculative-config", '{"method": "ngram"}', "--num-prompts", "3",
                                    "--max-tokens", "16", "--prompt-format", "plain"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_exact"] == 3


# -- calibrate ---------------------------------------------------------------------------------------

def test_calibrate_synthetic_rounds_recovers_temperature():
    from dspark.train.calibrate_cli import calibrate_rounds
    g = torch.Generator().manual_seed(0)
    z = 2.5 * torch.randn(6000, 3, generator=g)  # reported c = σ(z); the truth is σ(z / 2.5)
    passed = torch.rand(6000, 3, generator=g) < torch.sigmoid(z / 2.5)
    num_accepted = passed.int().cumprod(dim=1).sum(dim=1)
    rounds = [RoundRecord(str(i), 3, int(n), tuple(torch.sigmoid(z[i]).tolist()))
              for i, n in enumerate(num_accepted)]
    sts, report = calibrate_rounds(rounds)
    assert sts.temperatures[0] == pytest.approx(2.5, rel=0.25), sts.temperatures
    s = report["summary"]
    assert s["ece_after"] < 0.5 * s["ece_before"], s
    first = report["positions"][0]  # one temperature is order-preserving; later products need not be
    assert first["auroc_after"] == pytest.approx(first["auroc_before"], abs=1e-9)
    # undoing temperatures the drafter already applied recovers the same raw logits
    pre = [RoundRecord(r.request_id, 3, r.num_accepted, tuple(torch.sigmoid(
        torch.logit(torch.tensor(r.confidence, dtype=torch.float64)) / 2).tolist())) for r in rounds]
    again, _ = calibrate_rounds(pre, applied_temperatures=[2.0, 2.0, 2.0])
    assert again.temperatures == pytest.approx(sts.temperatures)


def test_calibrate_end_to_end_on_engine(tmp_path):
    from dspark.train.calibrate_cli import calibrate_rounds, collect_rounds
    from dspark.speculation.calibration import STSCalibration
    llm = tiny_llm(ConfidentNgram)
    convs = [[{"role": "user", "content": p.prompt}] for p in prompts(6)]
    rounds = collect_rounds(llm, convs, temperature=1.0, max_tokens=32, seed=0)
    assert rounds and all(len(r.confidence) == r.num_verified for r in rounds)
    sts, report = calibrate_rounds(rounds)  # (the CLI test below draws the diagram)
    first = report["positions"][0]
    assert first["ece_after"] <= first["ece_before"] + 1e-12  # T_1 = 1 is on the grid
    sts.save(tmp_path / "calibration.json")
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert saved["temperatures"] == list(sts.temperatures)  # what the DSpark drafter reads
    assert STSCalibration.load(tmp_path / "calibration.json") == sts


def test_calibrate_cli_on_random_dspark_drafter(tmp_path, monkeypatch, capsys):
    """`dspark calibrate --drafter D` on a tiny random DSpark checkpoint writes D/calibration.json,
    which the DSpark drafter then loads as its confidence temperatures."""
    from dspark.drafters.dspark import CALIBRATION_NAME, build, save_dspark
    from dspark.drafters.dspark_config import dspark_config_for_target
    from dspark.drafters.dspark_model import DSparkModel
    from dspark.models import build_model
    from dspark.train import calibrate_cli

    target_config = dataclasses.replace(TINY_LLAMA, num_hidden_layers=2)
    torch.manual_seed(0)
    target = build_model(target_config)
    cfg = dspark_config_for_target(target_config, num_hidden_layers=1, block_size=GAMMA,
                                   tap_layer_ids=(-1, 0), markov_rank=8, enable_confidence_head=True)
    drafter_model = DSparkModel(cfg)
    with torch.no_grad():
        for name, p in list(target.named_parameters()) + list(drafter_model.named_parameters()):
            p.fill_(1.0) if "norm" in name else p.normal_(0, p.shape[-1] ** -0.5)
    save_dspark(drafter_model, cfg, tmp_path / "drafter", dtype="float32")

    def fake_llm(*, config):
        drafter = build(config.spec, target_config=target_config, target_model=target,
                        dtype=torch.float32, device="cpu")
        engine = Engine(dataclasses.replace(config, cache=CacheConfig(num_kv_blocks=96)),
                        model=target, model_config=target_config, drafter=drafter)
        llm = LLM(engine=engine, tokenizer=None)
        llm.tokenizer = ByteChatTokenizer()
        return llm

    monkeypatch.setattr("dspark.llm.LLM", fake_llm)
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"turns": [f"prompt {i} " + "xy" * i]}) + "\n" for i in range(6)))
    args = _parse(calibrate_cli.register, [
        "calibrate", "--drafter", str(tmp_path / "drafter"), "--num-speculative-tokens", str(GAMMA),
        "--prompts", str(tmp_path / "train.jsonl"), "--max-tokens", "24",
        "--plot", str(tmp_path / "rel.png")])
    assert args.func(args) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["num_rounds"] > 0 and len(last["temperatures"]) == GAMMA
    assert last["out"] == str(tmp_path / "drafter" / CALIBRATION_NAME)
    assert (tmp_path / "rel.png").stat().st_size > 1000
    spec = SpecConfig(method="dspark", model=str(tmp_path / "drafter"), num_speculative_tokens=GAMMA)
    reloaded = build(spec, target_config=target_config, target_model=target, dtype=torch.float32,
                     device="cpu")
    assert reloaded.confidence_temperatures.tolist() == pytest.approx(last["temperatures"])
    assert reloaded.greedy_confidence_temperatures is reloaded.confidence_temperatures
    # a greedy fit goes to "greedy_temperatures" and keeps the sampling fit beside it
    args = _parse(calibrate_cli.register, [
        "calibrate", "--drafter", str(tmp_path / "drafter"), "--num-speculative-tokens", str(GAMMA),
        "--prompts", str(tmp_path / "train.jsonl"), "--max-tokens", "24", "--temperature", "0"])
    assert args.func(args) == 0
    greedy = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert greedy["regime"] == "greedy" and greedy["num_rounds"] > 0
    saved = json.loads((tmp_path / "drafter" / CALIBRATION_NAME).read_text())
    assert saved["temperatures"] == pytest.approx(last["temperatures"])
    assert saved["greedy_temperatures"] == pytest.approx(greedy["temperatures"])
    both = build(spec, target_config=target_config, target_model=target, dtype=torch.float32, device="cpu")
    assert both.confidence_temperatures.tolist() == pytest.approx(last["temperatures"])
    assert both.greedy_confidence_temperatures.tolist() == pytest.approx(greedy["temperatures"])
    # --fit-bias adds the regime's shifts; refitting undoes the applied ones first
    args = _parse(calibrate_cli.register, [
        "calibrate", "--drafter", str(tmp_path / "drafter"), "--num-speculative-tokens", str(GAMMA),
        "--prompts", str(tmp_path / "train.jsonl"), "--max-tokens", "24", "--temperature", "0", "--fit-bias"])
    assert args.func(args) == 0
    shifted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(shifted["biases"]) == GAMMA
    saved = json.loads((tmp_path / "drafter" / CALIBRATION_NAME).read_text())
    assert saved["greedy_biases"] == pytest.approx(shifted["biases"]) and "biases" not in saved
    assert saved["temperatures"] == pytest.approx(last["temperatures"])
    third = build(spec, target_config=target_config, target_model=target, dtype=torch.float32, device="cpu")
    assert third.greedy_confidence_biases.tolist() == pytest.approx(shifted["biases"])
    assert third.confidence_biases.tolist() == [0.0] * GAMMA


def test_calibration_prompts_refuse_eval_and_read_jsonl(tmp_path, monkeypatch):
    from dspark.train.calibrate_cli import load_calibration_prompts
    monkeypatch.setenv("DSPARK_DATASETS", str(tmp_path / "datasets"))
    (tmp_path / "datasets" / "eval").mkdir(parents=True)
    bad = tmp_path / "datasets" / "eval" / "gsm8k.jsonl"
    bad.write_text('{"turns": ["q"]}\n')
    with pytest.raises(ValueError, match="evaluation prompts"):
        load_calibration_prompts(data=None, prompts=str(bad), num_prompts=None)
    good = tmp_path / "train.jsonl"
    good.write_text('{"turns": ["a", "b"]}\n{"prompt": "c"}\n\n'
                    '{"messages": [{"role": "user", "content": "d"}]}\n')
    out = load_calibration_prompts(data=None, prompts=str(good), num_prompts=2, seed=1)
    assert len(out) == 2 and all(c[0]["content"] in "acd" for c in out)


# -- profile -----------------------------------------------------------------------------------------

def test_profile_writes_valid_cost_table(tmp_path):
    from dspark.speculation.cost_table import CostTable
    from dspark.engine.step_profiler import _split, profile_engine
    assert _split(1, 5) == [1] and _split(16, 5) == [4, 4, 4, 4] and sum(_split(19, 8)) == 19
    engine = tiny_llm().engine
    free_before = engine.block_manager.num_free_blocks
    table = profile_engine(engine, token_counts=[1, 4, 16], draft_num_reqs=[1, 3], context_len=64,
                           repeats=1, warmup=0)
    assert engine.block_manager.num_free_blocks == free_before  # synthetic requests released
    assert table.num_tokens == (1, 4, 16) and all(s > 0 for s in table.steps_per_second)
    assert table.draft_num_reqs == (1, 3) and table.meta["context_len"] == 64
    table.save(tmp_path / "cost.json")
    assert CostTable.load(tmp_path / "cost.json") == table



def test_profile_cli_writes_json(tmp_path, monkeypatch, capsys):
    from dspark import cli_profile as profile_cli
    from dspark.speculation.cost_table import CostTable
    monkeypatch.setattr("dspark.engine.build.build_engine", lambda config: (tiny_llm().engine, None))
    out = tmp_path / "cost_table.json"
    args = _parse(profile_cli.register, [
        "profile", "tiny", "--speculative-config", '{"method": "ngram", "length_policy": "prefix"}',
        "--token-counts", "1,8", "--draft-num-reqs", "1,2", "--context-len", "32", "--repeats", "1",
        "--warmup", "0", "--out", str(out)])
    assert args.func(args) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["out"] == str(out) and CostTable.load(out).num_tokens == (1, 8)


def test_calibrate_recovers_raw_logits_under_applied_temperatures_and_shifts():
    from dspark.train.calibrate_cli import rounds_to_tensors
    from dspark.speculation.acceptance import RoundRecord
    z = torch.tensor([[2.0, -1.0, 0.5], [0.3, 1.2, -2.0]], dtype=torch.float64)
    temps, shifts = [2.0, 0.5, 1.0], [-1.0, 0.5, 0.0]
    conf = torch.sigmoid(z / torch.tensor(temps, dtype=torch.float64) + torch.tensor(shifts, dtype=torch.float64))
    rounds = [RoundRecord(f"r{i}", 3, 1, tuple(conf[i].tolist())) for i in range(2)]
    logits, accepted, verified = rounds_to_tensors(rounds, applied_temperatures=temps, applied_biases=shifts)
    torch.testing.assert_close(logits, z)
    assert accepted.tolist() == [1, 1] and verified.tolist() == [3, 3]


def test_calibrate_reports_out_of_sample_on_held_out_requests():
    from dspark.train.calibrate_cli import calibrate_rounds
    from dspark.speculation.acceptance import RoundRecord
    g = torch.Generator().manual_seed(0)
    rounds = []
    for i in range(400):  # over-confident head: acceptance σ(z − 1)
        z = 1.0 + 2.0 * torch.randn(3, generator=g, dtype=torch.float64)
        accepted = int((torch.rand(3, generator=g, dtype=torch.float64) < torch.sigmoid(z - 1.0)).long().cumprod(0).sum())
        rounds.append(RoundRecord(f"req-{i // 4}", 3, accepted, tuple(torch.sigmoid(z).tolist())))
    sts, report = calibrate_rounds(rounds, holdout=0.5)
    assert report["out_of_sample"] and 100 < report["num_scored_rounds"] < 300
    assert report["num_rounds"] == 400 and len(sts.temperatures) == 3
    full, in_sample = calibrate_rounds(rounds, holdout=0.0)
    assert not in_sample["out_of_sample"] and in_sample["num_scored_rounds"] == 400
    assert full == sts  # the saved fit uses every round either way
