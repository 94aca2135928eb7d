"""Engine: one decode step = schedule → prepare → forward → sample / verify → commit → speculation → outputs.
The engine sees token ids only; tokenization and stop strings live in `detokenizer.py`.

Plain decoding is the same step with no drafter: every request verifies zero drafts and the one "bonus" token
is an ordinary sample from the target distribution. Whether and how much to draft is the speculation
controller's (`dspark.speculation.controller`): the engine hands it the committed step (verification outcomes,
the target's seconds, the next step's demand) and gets back each request's `Drafts` with its verification
length, which it hands to the scheduler; after the outputs it reports the step's seconds and the requests that
ended. Drafts travel as values: held by the scheduler, carried by the scheduled windows, never on `Request`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dspark.config import EngineConfig
from dspark.drafters.base import Drafter
from dspark.engine.block_manager import BlockManager
from dspark.engine.faults import isolate_target_faults
from dspark.engine.metrics import EngineMetrics, EngineStats, engine_stats
from dspark.worker.model_runner import ModelRunner, allocate_caches
from dspark.engine.scheduler import Scheduler, SchedulerOutput
from dspark.request import Request, SpecStats, check_request
from dspark.sampling import RowArgmax, SamplingParams, TokenLogprob
from dspark.speculation.controller import build_controller
from dspark.verify.sampler import argmax_suffices, sample_step, score_prompts

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    spec: SpecStats
    coalesce_held_steps: int = 0  # steps the prompt was held back by coalescing before admission
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    # with the request's first new tokens, when it asked for them: [None, one per prompt token after the first]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # why the engine failed this request (non-finite target logits, or no token may follow: a `RequestError`,
    # whose cause is the request); finish_reason is then "abort" and nothing it committed in the step is emitted
    error: str | None = None


@dataclass
class StepVerify:
    """A step's verification, by request."""

    output_ids_by_id: dict[str, list[int]] = field(default_factory=dict)
    num_accepted_by_id: dict[str, int] = field(default_factory=dict)
    logprobs_by_id: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    faults: dict[str, str] = field(default_factory=dict)  # request_id → why its logits failed it
    target_seconds: float = 0.0  # prepare, forward and verification, timed


class Engine:
    def __init__(self, config: EngineConfig, *, model, model_config, drafter: Drafter | None = None,
                 length_policy=None, cost_table=None, eos_token_ids: tuple[int, ...] = (),
                 wrap_runner: Callable | None = None, workers=None, grammar_compiler=None):
        """`wrap_runner`: wraps the engine's `ModelRunner` (the tensor-parallel driver, CUDA graphs); `workers`:
        the tensor-parallel worker processes it drives (closed by their owner); `grammar_compiler`: structured
        output (`dspark.structured.GrammarCompiler`), None without a tokenizer."""
        self.config, self.model_config, self.drafter = config, model_config, drafter
        # drafts with a distribution verified as one block (verify/block.py) rather than token by token
        self._block_verification = config.spec is not None and config.spec.rejection_sample_method == "block"
        self.eos_token_ids = tuple(eos_token_ids) or tuple(model_config.eos_token_ids)
        self.max_model_len = config.scheduler.max_model_len or model_config.max_position_embeddings
        caches = allocate_caches(model, drafter, config)
        hybrid = bool(caches.state_bytes)
        if hybrid and config.cache.enable_prefix_caching and not caches.num_state_snapshots:
            log.info("prefix caching is off for %s: a cached block needs the recurrent state at its boundary, and "
                     "max_state_snapshots is 0", model_config.architecture)
        self.block_manager = BlockManager(
            num_kv_blocks=caches.num_kv_blocks, kv_block_size=config.cache.kv_block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching and (not hybrid or caches.num_state_snapshots > 0),
            num_state_slots=config.scheduler.max_num_seqs if hybrid else 0,
            num_state_snapshots=caches.num_state_snapshots, snapshot_interval=config.cache.state_snapshot_interval)
        self.metrics = EngineMetrics()
        self.requests: dict[str, Request] = {}
        runner = ModelRunner(model, kv_caches=caches.kv_caches, kv_block_size=config.cache.kv_block_size,
                             device=config.device, tap_layer_ids=drafter.tap_layer_ids if drafter else ())
        self.runner = wrap_runner(runner) if wrap_runner is not None else runner
        self._with_taps = bool(drafter and drafter.tap_layer_ids)  # the target's forward may return taps
        self.workers, self.grammar_compiler = workers, grammar_compiler
        self._ids = itertools.count()
        if config.spec is not None and config.spec.cost_table == "auto" and drafter is not None:
            from dspark.engine.step_profiler import profile_engine
            log.info("profiling the step-cost table at startup (cost_table='auto')")
            cost_table = profile_engine(self, repeats=3, warmup=1)
        self.spec = build_controller(config, drafter=drafter, length_policy=length_policy, cost_table=cost_table,
                                     metrics=self.metrics, vocab_size=model_config.vocab_size)
        keeps_context = bool(drafter and drafter.needs_context_kv)  # drafter K/V in the pool: prefix hits need it
        self.scheduler = Scheduler(config.scheduler, self.block_manager, max_model_len=self.max_model_len,
                                   num_lookahead_slots=drafter.num_draft_tokens if drafter else 0,
                                   drafter_needs_kv=keeps_context,
                                   model_drafting=self.spec.admit if keeps_context else None)

    @property
    def cost_table(self):
        return self.spec.cost_table

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, *, client: str | None = None) -> str:
        """Queue a request; `client` groups the requests that take admission turns together (`Scheduler.add`)."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_ids, params)
        req = Request(request_id, list(prompt_ids), params, eos_token_ids=self.eos_token_ids, client=client)
        if params.seed is None:
            req.sample_seed = hash((self.config.seed, request_id)) % 2**63
            req.generator = torch.Generator().manual_seed(req.sample_seed)
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise ValueError("structured output needs the tokenizer (the engine was built without one)")
            req.grammar = self.grammar_compiler.request_grammar(params, prompt_ids)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def check_request(self, prompt_ids: list[int], params: SamplingParams, *, max_tokens_fit: bool = False) -> None:
        """`request.check_request` with this engine's limits (InvalidRequest naming the field)."""
        check_request(prompt_ids, params, max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
                      max_logprobs=self.config.max_logprobs, max_tokens_fit=max_tokens_fit)

    def abort(self, request_id: str, reason: str = "abort") -> StepOutput | None:
        """End a request now, between steps: its KV blocks and state slot go back to the pool and the drafter drops
        what it keeps for it. No step reports it: its final output (no new tokens) is returned instead; None for a
        request that has already finished or is unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish_request(req, reason)
        finished = self.scheduler.finished
        if finished and finished[-1] is req:  # ended here: not one of the next step's finished outputs
            finished.pop()
        self.metrics.record_finished(coalesce_held_steps=req.waiting_steps)
        self.spec.release([(req, False)])
        return StepOutput(request_id=request_id, new_token_ids=[], finished=True, finish_reason=req.finish_reason,
                          num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids),
                          num_cached_tokens=req.num_cached_tokens, spec=req.spec, coalesce_held_steps=req.waiting_steps)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        batch, taps, verified = self._run_target(sched) if sched.scheduled else (None, None, StepVerify())
        emitted = self._commit(sched, verified)
        after = self.spec.after_commit(sched, batch, taps, verified.num_accepted_by_id,
                                       target_seconds=verified.target_seconds,
                                       demand=self.scheduler.next_step_demand())
        self.scheduler.hold_drafts(after.drafts, context_extended=after.context_extended)
        outputs, ended = self._outputs(emitted, verified)
        self.spec.observe_step(sched, emitted, seconds=time.perf_counter() - start, finished=ended)
        return outputs

    # -- phases ----------------------------------------------------------------------------------
    def _run_target(self, sched: SchedulerOutput):
        """Prepare, forward, score prompts, isolate faulty rows, sample / verify → (batch, taps, StepVerify)."""
        start = time.perf_counter()
        emitting = [s for s in sched.scheduled if s.emits]
        # an all-greedy step reads each row's argmax only: a vocabulary-parallel head gathers no rows
        argmax_only = argmax_suffices(emitting) and not any(s.prompt_positions for s in sched.scheduled)
        batch = self.runner.prepare(sched, argmax_only=argmax_only)
        with_taps = self._with_taps and any(s.request.needs_draft_context for s in sched.scheduled)
        logits, taps = self.runner.forward(batch, with_taps=with_taps)
        if batch.host.num_prompt_logits:  # the rows that score prompt tokens come after the emitting ones
            score_prompts(sched.scheduled, logits[-batch.host.num_prompt_logits:])
            logits = logits[:-batch.host.num_prompt_logits]
        if argmax_only and not isinstance(logits, RowArgmax):  # one pass over the rows serves the fault
            logits = RowArgmax.of(logits)  # check and the verification (the row maxima show the faults)
        logits, faults = isolate_target_faults(emitting, logits)  # rows, or their RowArgmax
        verified = StepVerify(faults=faults)
        if emitting:  # + requests no token may follow (faults)
            result, verified.logprobs_by_id = sample_step(emitting, logits, eos_token_ids=self.eos_token_ids,
                                                          faults=faults, block=self._block_verification)
            ids = [s.request.request_id for s in emitting]
            verified.output_ids_by_id = dict(zip(ids, result.output_ids))
            verified.num_accepted_by_id = dict(zip(ids, result.num_accepted))
        verified.target_seconds = time.perf_counter() - start  # verification synchronised the device
        return batch, taps, verified

    def _commit(self, sched: SchedulerOutput, verified: StepVerify) -> dict[str, list[int]]:
        """Verified tokens into the requests (stop conditions cut them); faulty requests fail; grammars advance."""
        self.metrics.num_preemptions += len(sched.preempted_ids)
        if not sched.scheduled:
            return {}
        emitted = self.scheduler.commit(sched, verified.output_ids_by_id, verified.num_accepted_by_id)
        for rid, message in verified.faults.items():  # nothing sampled from faulty logits leaves the engine
            self._fail(rid, message, emitted)
        for rid, ids in emitted.items():
            req = self.requests.get(rid)
            if req is not None and req.grammar is not None and ids:
                req.grammar.advance(ids)
        m = self.metrics
        m.num_steps += 1
        for item in sched.scheduled:
            m.num_prompt_tokens += max(0, min(item.start_pos + item.num_new_tokens - item.num_drafts,
                                              len(item.request.prompt_ids)) - item.start_pos)
            if item.num_drafts:
                m.record_verify(item.num_drafts, verified.num_accepted_by_id.get(item.request.request_id, 0))
        return emitted

    def _fail(self, request_id: str, message: str, emitted: dict[str, list[int]]) -> None:
        """End a request whose target logits were faulty (or that no token may follow); what it committed this
        step is not emitted."""
        req = self.requests[request_id]
        emitted.pop(request_id, None)
        if req.is_finished:  # it finished in this very commit (length, eos): still a failure
            req.finish_reason = "abort"
        else:
            self.scheduler.finish_request(req, "abort")
        self.metrics.num_failed_requests += 1

    def _outputs(self, emitted: dict[str, list[int]], verified: StepVerify
                 ) -> tuple[list[StepOutput], list[tuple[Request, bool]]]:
        """A `StepOutput` per request that emitted or finished (a failed one carries its `error`); the requests
        that ended, with whether they failed, leave the engine."""
        outs, ended, logprobs = [], [], verified.logprobs_by_id
        finished = {r.request_id: r for r in self.scheduler.take_finished()}
        for rid in list(emitted) + [rid for rid in finished if rid not in emitted]:
            req = self.requests[rid]
            new_ids = emitted.get(rid, [])
            self.metrics.num_generation_tokens += len(new_ids)
            outs.append(StepOutput(
                request_id=rid, new_token_ids=new_ids, finished=req.is_finished,
                finish_reason=req.finish_reason, num_prompt_tokens=len(req.prompt_ids),
                num_output_tokens=len(req.output_ids), num_cached_tokens=req.num_cached_tokens,
                spec=req.spec, coalesce_held_steps=req.waiting_steps,
                logprobs=logprobs[rid][:len(new_ids)] if rid in logprobs else None,
                prompt_logprobs=req.prompt_logprobs if new_ids and len(req.output_ids) == len(new_ids) else None,
                error=verified.faults.get(rid)))
            if req.is_finished:
                self.metrics.record_finished(coalesce_held_steps=req.waiting_steps)
                ended.append((req, rid in verified.faults))
                del self.requests[rid]
        return outs, ended

    # -- introspection (server /metrics, /health, the stats line) ------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the counters and gauges (plain reads: safe from another thread while the engine steps)."""
        return engine_stats(self.metrics, scheduler=self.scheduler, block_manager=self.block_manager,
                            num_draft_positions=self.drafter.num_draft_tokens if self.drafter else 0,
                            cost_table=self.cost_table, switch=getattr(self.spec, "switch", None))
