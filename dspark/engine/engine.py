"""Engine: one decode step = schedule → prepare → forward → verify → commit → extend_context → propose
→ choose. The engine sees token ids only; tokenization and stop strings live in `detokenizer.py`.

Plain decoding is the same step with no drafter: every request verifies zero drafts and the one
"bonus" token is an ordinary sample from the target distribution.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dspark.config import EngineConfig
from dspark.drafters.base import ContextSegment, ContextUpdate, Drafter, ProposeBatch, ProposeRequest
from dspark.engine.block_manager import BlockManager
from dspark.engine.faults import checked_proposal, drafter_fault, fail_request, isolate_target_faults
from dspark.engine.metrics import EngineMetrics
from dspark.engine.model_runner import (DTYPES, ModelRunner, StepBatch, allocate_kv_pool,
                                        kv_bytes_per_block, kv_dtype, pool_bytes)
from dspark.engine.scheduler import Scheduler, SchedulerOutput
from dspark.request import PendingContext, Request, SpecStats, check_request
from dspark.engine.sampler import argmax_suffices, sample_step, score_prompts
from dspark.sampling import RowArgmax, SamplingParams, TokenLogprob
from dspark.verify.rejection import VerifyResult

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


class Engine:
    def __init__(self, config: EngineConfig, *, model, model_config, drafter: Drafter | None = None,
                 length_policy=None, cost_table=None, eos_token_ids: tuple[int, ...] = ()):
        self.config = config
        self.model_config = model_config
        self.drafter = drafter
        self.length_policy = length_policy
        self.cost_table = cost_table
        self.eos_token_ids = tuple(eos_token_ids) or tuple(model_config.eos_token_ids)
        self.max_model_len = config.scheduler.max_model_len or model_config.max_position_embeddings
        dtype = DTYPES[config.dtype]
        target_kv_dtype = kv_dtype(config.cache.kv_cache_dtype, dtype)
        layer_specs = [model.kv_spec] * model.num_kv_layers
        draft_specs = drafter.kv_layer_specs() if drafter else []
        kv_block_size = config.cache.kv_block_size
        block_bytes = (kv_bytes_per_block(layer_specs, kv_block_size, target_kv_dtype)
                       + kv_bytes_per_block(draft_specs, kv_block_size, dtype))
        num_kv_blocks = config.cache.num_kv_blocks or max(16, int(pool_bytes(config.cache, config.device)
                                                                  // block_bytes))
        # one block past the block manager's: the padding rows of a replayed CUDA graph store their K/V
        # there (dspark.engine.cuda_graphs), no request ever owns it
        pool = allocate_kv_pool(layer_specs, num_kv_blocks=num_kv_blocks + 1, kv_block_size=kv_block_size,
                                dtype=target_kv_dtype, device=config.device)
        if drafter:
            drafter.bind_kv(allocate_kv_pool(draft_specs, num_kv_blocks=num_kv_blocks + 1,
                                             kv_block_size=kv_block_size, dtype=dtype, device=config.device))
        self.block_manager = BlockManager(num_kv_blocks=num_kv_blocks, kv_block_size=kv_block_size,
                                          enable_prefix_caching=config.cache.enable_prefix_caching)
        gamma = drafter.num_draft_tokens if drafter else 0
        self.scheduler = Scheduler(config.scheduler, self.block_manager, max_model_len=self.max_model_len,
                                   num_lookahead_slots=gamma,
                                   drafter_needs_kv=bool(drafter and drafter.needs_context_kv))
        self.runner = ModelRunner(model, kv_caches=pool[:len(layer_specs)], kv_block_size=kv_block_size,
                                  device=config.device,
                                  tap_layer_ids=drafter.tap_layer_ids if drafter else ())
        self.metrics = EngineMetrics()
        # Called after each verification as f(request_id, draft_confidence, num_verified, num_accepted)
        # for every request that emitted (eval / calibration tools: dspark.verify.acceptance), whatever
        # proposed its drafts; `model_verify_observers` only for rounds the model drafter proposed (their
        # confidences come from its calibrated head: the draft gate and online calibration learn from them)
        self.verify_observers: list = []
        if drafter is not None and drafter.has_free_drafts:  # lookup-first: counts its drafts' outcomes
            self.verify_observers.append(drafter.observe_verify)
        self.model_verify_observers: list = []
        self.draft_gate = None  # cost-aware policies: skip drafting where it cannot pay (spec "draft_gate")
        if (drafter is not None and config.spec is not None and config.spec.draft_gate
                and getattr(length_policy, "needs_cost", False)):
            from dspark.verify.draft_gate import DraftGate
            self.draft_gate = DraftGate()
            self.model_verify_observers.append(self.draft_gate.observe_verify)
            if config.spec.gate_admission:  # requests joining a load where drafting cannot pay: no drafter context
                self.scheduler.admit_model_drafting = self._admit_model_drafting
        self.switch = None  # speculation on/off per load by measured seconds per token (spec "measured_switch")
        if self.draft_gate is not None and config.spec.measured_switch:
            from dspark.verify.switch import MeasuredSwitch
            self.switch = MeasuredSwitch()
        self.upkeep = None  # online cost-table / calibration upkeep (spec "online_upkeep")
        if drafter is not None and config.spec is not None and config.spec.online_upkeep:
            from dspark.verify.upkeep import OnlineUpkeep
            self.upkeep = OnlineUpkeep(drafter=drafter, cost_table=cost_table,
                                       is_greedy=self._is_greedy)
            self.model_verify_observers.append(self.upkeep.observe_verify)
        self.grammar_compiler = None  # structured output (dspark.structured.GrammarCompiler), set by build
        self.requests: dict[str, Request] = {}
        self.failed: dict[str, str] = {}  # request_id → why this engine failed it (take_failed)
        self._ids = itertools.count()

    def _admit_model_drafting(self) -> bool:
        """Asked by the scheduler while it admits a waiting request: the load it prices is every running and
        waiting request (the one being admitted among them) up to max_num_seqs, so the first requests of a
        burst see the burst's load."""
        sched = self.scheduler
        load = min(len(sched.running) + len(sched.waiting), self.config.scheduler.max_num_seqs)
        ok = (self.draft_gate.admits_model_drafting(num_reqs=load, cost=self.cost_table)
              and not (self.switch is not None and self.switch.is_off(num_reqs=load)))
        if not ok:
            self.metrics.num_admitted_without_drafter += 1
        return ok

    def _is_greedy(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        return req is not None and req.params.is_greedy

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_request(prompt_ids, params, max_model_len=self.max_model_len,
                      vocab_size=self.model_config.vocab_size, max_logprobs=self.config.max_logprobs)
        req = Request(request_id, list(prompt_ids), params, eos_token_ids=self.eos_token_ids)
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

    def abort(self, request_id: str, reason: str = "abort") -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self.scheduler.finish_request(req, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        step_start = time.perf_counter()
        sched = self.scheduler.schedule()
        self.metrics.num_preemptions += len(sched.preempted_ids)
        emitted: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        num_proposed = 0
        if sched.scheduled:
            start = time.perf_counter()
            emitting = [s for s in sched.scheduled if s.emits]
            # an all-greedy step reads each row's argmax only: a vocabulary-parallel head gathers no rows
            argmax_only = argmax_suffices(emitting) and not any(s.prompt_positions for s in sched.scheduled)
            batch = self.runner.prepare(sched, argmax_only=argmax_only)
            logits, taps = self.runner.forward(  # taps only where the drafter keeps a context
                batch, with_taps=any(s.request.needs_draft_context for s in sched.scheduled))
            if batch.host.num_prompt_logits:  # the rows that score prompt tokens come after the emitting ones
                score_prompts(sched.scheduled, logits[-batch.host.num_prompt_logits:])
                logits = logits[:-batch.host.num_prompt_logits]
            if argmax_only and not isinstance(logits, RowArgmax):  # one pass over the rows serves the fault
                logits = RowArgmax.of(logits)  # check and the verification (the row maxima show the faults)
            logits, faults = isolate_target_faults(emitting, logits)  # rows, or their RowArgmax
            result = self._verify(sched, logits, faults)  # + requests no token may follow
            if self.upkeep is not None:  # verify synchronised the device: the timing is complete
                self.cost_table = self.upkeep.observe_step(
                    num_tokens=sched.num_batched_tokens, seconds=time.perf_counter() - start)
            emitted = self.scheduler.commit(sched, result.output_ids_by_id, result.num_accepted_by_id)
            for rid in faults:  # nothing sampled from faulty logits leaves the engine
                fail_request(self, rid, faults[rid], emitted)
            self._advance_grammars(emitted)
            logprobs = result.logprobs_by_id
            if self.drafter is not None:
                proposing, model_allowed, next_step = self._proposing_requests(sched)
                self._extend_drafter_context(sched, batch, taps, result,
                                             flush={r.request_id for r, ok in zip(proposing, model_allowed) if ok})
                num_proposed = self._propose_and_choose(proposing, model_allowed, next_step)
            self._record(sched, result)
        outputs = self._outputs(sched, emitted, logprobs)
        if self.draft_gate is not None and sched.scheduled:  # the whole step, as the gate's live cost
            seconds = time.perf_counter() - step_start
            self.draft_gate.observe_step(
                num_tokens=sched.num_batched_tokens, seconds=seconds,
                drafts_verified=any(s.num_drafts for s in sched.scheduled), num_proposed_reqs=num_proposed,
                cost=self.cost_table)
            if self.switch is not None:
                self.switch.observe_step(
                    seconds=seconds, num_emitted=sum(len(ids) for ids in emitted.values()),
                    decode_only=not sched.preempted_ids and all(
                        s.start_pos >= len(s.request.prompt_ids) for s in sched.scheduled))
        return outputs

    # -- phases ----------------------------------------------------------------------------------
    def _verify(self, sched: SchedulerOutput, logits: "torch.Tensor | RowArgmax", faults: dict) -> "StepVerify":
        items = [s for s in sched.scheduled if s.emits]
        if not items:
            return StepVerify({}, {})
        result, logprobs = sample_step(items, logits, eos_token_ids=self.eos_token_ids, faults=faults)
        return self._observed(items, result, logprobs)

    def _observed(self, items: list, result: VerifyResult, logprobs: dict) -> "StepVerify":
        """Hand each request's verification outcome to the observers; the step's results by request."""
        ids = [s.request.request_id for s in items]
        for rid, s, n in zip(ids, items, result.num_accepted):
            for observe in self.verify_observers:
                observe(rid, s.request.draft_confidence, s.num_drafts, n)
            if s.request.draft_from_model:
                for observe in self.model_verify_observers:
                    observe(rid, s.request.draft_confidence, s.num_drafts, n)
        return StepVerify(dict(zip(ids, result.output_ids)), dict(zip(ids, result.num_accepted)), logprobs)

    # Drafter context that may wait (draft gate only): a skipped request's *generated* positions keep
    # their taps and are extended when it next proposes, in one call with that step's positions — a
    # request the gate never lets draft again costs no drafter work at all (its backlog is dropped when
    # it finishes). Prompt positions are extended at once: their drafter K/V make a later prefix hit a
    # draft hit. The kept taps live under one budget for all requests; past it the longest backlogs
    # are extended.
    MAX_DEFERRED_BYTES = 64 * 2**20

    def _extend_drafter_context(self, sched: SchedulerOutput, batch: StepBatch, taps, result, *,
                                flush: set[str]) -> None:
        """Extend the drafter context over this step's committed positions: now for the requests in
        `flush` (they propose next), for prompt positions, and for every position without a draft gate;
        deferred otherwise (within MAX_DEFERRED_BYTES)."""
        parts: list[tuple[Request, PendingContext]] = []  # what is extended now, pending included
        deferring = False
        for item, offset in zip(sched.scheduled, batch.token_offsets):
            req = item.request
            if req.is_finished or not req.needs_draft_context:
                continue
            rejected = item.num_drafts - result.num_accepted_by_id.get(req.request_id, 0)
            count = item.num_new_tokens - rejected if item.emits else item.num_new_tokens
            defer = (self.draft_gate is not None and req.request_id not in flush
                     and item.start_pos >= len(req.prompt_ids))
            rows = None if taps is None else taps[offset:offset + count]  # [count, num_taps * hidden]
            part = PendingContext(start_pos=item.start_pos, token_ids=batch.input_id_list[offset:offset + count],
                                  next_token_id=req.token_at(item.start_pos + count),
                                  taps=rows.clone() if defer and rows is not None else rows)
            if defer:
                req.defer_context(part)
                deferring = True
                continue
            parts.append((req, self._joined(req.take_pending_context() + [part])))
        if deferring:
            parts += self._over_budget(row_bytes=0 if taps is None else taps.shape[1] * taps.element_size())
        if not parts:
            return
        segments, row = [], 0
        for req, part in parts:
            segments.append(ContextSegment(
                request_id=req.request_id, block_table=req.block_table, start_pos=part.start_pos,
                token_ids=part.token_ids, next_token_id=part.next_token_id,
                tap_rows=slice(row, row + len(part.token_ids))))
            row += len(part.token_ids)
        all_taps = None if taps is None else torch.cat([p.taps for _, p in parts])  # [rows, num_taps * hidden]
        try:
            done = self.drafter.extend_context(ContextUpdate(segments=segments, taps=all_taps))
        except Exception:  # the drafter's context for these requests is lost: they decode plainly
            drafter_fault(self, [req for req, _ in parts], "extend_context")
            return
        for seg in segments:
            req = self.requests[seg.request_id]
            req.num_draft_computed = done.get(seg.request_id, seg.start_pos + len(seg.token_ids))
            self.block_manager.commit(req)

    def _over_budget(self, *, row_bytes: int) -> list[tuple[Request, PendingContext]]:
        """Backlogs to extend now because the deferred taps exceed MAX_DEFERRED_BYTES: the longest
        first, until the rest fit in half the budget."""
        live = [r for r in self.requests.values() if not r.is_finished]  # (a finished one's blocks are freed)
        total = row_bytes * sum(r.num_pending_positions for r in live)
        parts: list[tuple[Request, PendingContext]] = []
        if total <= self.MAX_DEFERRED_BYTES:
            return parts
        for req in sorted(live, key=lambda r: -r.num_pending_positions):
            if not req.num_pending_positions or (parts and total <= self.MAX_DEFERRED_BYTES // 2):
                break
            total -= row_bytes * req.num_pending_positions
            parts.append((req, self._joined(req.take_pending_context())))
        return parts

    @staticmethod
    def _joined(pending: list[PendingContext]) -> PendingContext:
        """Contiguous parts of one request's context, as one part."""
        if len(pending) == 1:
            return pending[0]
        ids = [t for p in pending for t in p.token_ids]
        assert all(a.start_pos + len(a.token_ids) == b.start_pos for a, b in zip(pending, pending[1:])), \
            "deferred drafter context is not contiguous"
        last = pending[-1]
        return PendingContext(start_pos=pending[0].start_pos, token_ids=ids, next_token_id=last.next_token_id,
                              taps=None if last.taps is None else torch.cat([p.taps for p in pending]))

    def _proposing_requests(self, sched: SchedulerOutput) -> tuple[list[Request], list[bool], "NextStep"]:
        """The requests that draft for the next step, whether the model drafter may draft for each (the
        draft gate's pick among those that emitted; a drafter with free drafts still proposes for the
        others), and the next step's non-draft token counts. Under a cost-aware policy nothing is
        model-drafted while prompt chunks need the whole next step's budget, nor ever for a request admitted
        without drafter context (`Request.model_drafting`); nothing is proposed at all where the measured
        switch has speculation off at this load, or where the gate finds lookup drafts cannot pay."""
        reqs = [s.request for s in sched.scheduled
                if s.emits and not s.request.is_finished and s.request.uses_speculation]
        if not reqs:
            return [], [], NextStep(0, 0, 0)
        measured_off = self.switch is not None and not self.switch.propose(num_reqs=len(reqs))
        next_step = NextStep(0, 0, 0) if measured_off else self._next_step_tokens()
        if measured_off or (self.draft_gate is not None and not self.draft_gate.proposing_pays(
                num_reqs=len(reqs), num_nondraft_tokens=next_step.num_nondraft,
                num_prompt_tokens=next_step.num_prompt, cost=self.cost_table)):  # lookup cannot pay for itself
            for r in reqs:
                r.clear_drafts()
            with self.metrics.lock:
                self.metrics.num_proposal_skips += 1
                self.metrics.num_measured_off_steps += measured_off
                self.metrics.verify_lens.extend([0] * len(reqs))
            return [], [], next_step
        cost_aware = getattr(self.length_policy, "needs_cost", False)
        if cost_aware and next_step.max_drafts == 0:
            allowed = [False] * len(reqs)  # no draft could be verified: the prompts take the budget
        elif self.draft_gate is not None:
            drafted = set(self.draft_gate.drafted_requests(
                num_reqs=len(reqs), num_nondraft_tokens=next_step.num_nondraft,
                num_prompt_tokens=next_step.num_prompt, cost=self.cost_table,
                backlog=[r.num_pending_positions if r.model_drafting else float("inf") for r in reqs]))
            allowed = [i in drafted and r.model_drafting for i, r in enumerate(reqs)]
            self.metrics.num_draft_skips += allowed.count(False)
        else:
            allowed = [r.model_drafting for r in reqs]
        for r in (r for r, ok in zip(reqs, allowed) if not ok):
            r.clear_drafts()  # plain decoding in the next step for this request (or free drafts)
        if not self.drafter.has_free_drafts:
            reqs = [r for r, ok in zip(reqs, allowed) if ok]
            allowed = [True] * len(reqs)
        return reqs, allowed, next_step

    def _next_step_tokens(self) -> "NextStep":
        """The next step's tokens before drafts (`Scheduler.next_step_demand`: decoding requests, prompt
        chunks of running requests and of the waiting prompts it would admit), clipped to the step's
        budget, and the budget they leave for drafts."""
        decode, prompt = self.scheduler.next_step_demand()
        budget = self.config.scheduler.max_num_batched_tokens
        num_nondraft = min(decode + prompt, budget)
        num_decode = min(decode, num_nondraft)
        return NextStep(num_nondraft=num_nondraft, num_prompt=num_nondraft - num_decode,
                        max_drafts=max(0, budget - decode - prompt))

    def _propose_and_choose(self, reqs: list[Request], model_allowed: list[bool], next_step: "NextStep") -> int:
        """Drafts and verify lengths for the next step; returns the number of requests the model drafter
        proposed for."""
        model_allowed = [ok and r.model_drafting for r, ok in zip(reqs, model_allowed)]  # after a fault
        if not self.drafter.has_free_drafts:
            reqs = [r for r, ok in zip(reqs, model_allowed) if ok]
            model_allowed = [True] * len(reqs)
        if not reqs:
            return 0
        start = time.perf_counter()
        batch = ProposeBatch(
            requests=[ProposeRequest(
                request_id=r.request_id, all_ids=r.all_ids, anchor_pos=r.num_computed_tokens,
                block_table=r.block_table, num_draft_computed=r.num_draft_computed, params=r.params,
                generator=r.generator, allow_model=ok) for r, ok in zip(reqs, model_allowed)],
            kv_block_size=self.block_manager.kv_block_size,
            draft_sample_method=self.config.spec.draft_sample_method if self.config.spec else "greedy")
        proposal, num_valid = checked_proposal(self, reqs, batch)  # drafter faults: plain decoding
        if proposal is None:
            return 0
        from_model = [True] * len(reqs) if proposal.from_model is None else list(proposal.from_model)
        draft_ids = proposal.draft_ids.tolist()  # [num_reqs][γ]
        for i, r in enumerate(reqs):  # drafts a grammar forbids could never be accepted: cut them here
            if r.grammar is not None:
                num_valid[i] = r.grammar.valid_prefix(draft_ids[i][:num_valid[i]])
        if self.length_policy is None:
            verify_lens = list(num_valid)
        else:
            verify_lens = [0] * len(reqs) if not any(num_valid) else list(self.length_policy.choose(
                confidence=proposal.confidence, num_draft_tokens=proposal.draft_ids.shape[1],
                num_nondraft_tokens=next_step.num_nondraft, num_prompt_tokens=next_step.num_prompt,
                num_drafted_reqs=sum(from_model), max_drafts=next_step.max_drafts, cost=self.cost_table,
                num_reqs=len(reqs), num_proposed=num_valid))
            if hasattr(self.length_policy, "observe") and proposal.confidence is not None:
                # after choose: the async policy's capacity reads confidences two steps old
                self.length_policy.observe(proposal.confidence, num_proposed=num_valid)
            rows = [i for i, m in enumerate(from_model) if m]  # the gate learns the model's curve only
            if self.draft_gate is not None and proposal.confidence is not None and rows:
                self.draft_gate.observe(proposal.confidence[rows], num_proposed=[num_valid[i] for i in rows])
        confidence = None if proposal.confidence is None else proposal.confidence.tolist()
        for i, r in enumerate(reqs):
            verify_lens[i] = min(int(verify_lens[i]), num_valid[i])
            r.draft_ids = draft_ids[i][:num_valid[i]]
            r.draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[i]
            r.draft_confidence = None if confidence is None else confidence[i]
            r.draft_from_model = from_model[i]
            r.verify_len = int(verify_lens[i])
        with self.metrics.lock:
            self.metrics.verify_lens.extend(int(v) for v in verify_lens)
            self.metrics.num_lookup_drafts += sum(1 for i in range(len(reqs)) if not from_model[i] and num_valid[i])
        if self.draft_gate is not None and not any(from_model):  # a lookup-only proposal: its cost and worth
            self.draft_gate.observe_proposal(seconds=time.perf_counter() - start, confidence=proposal.confidence,
                                             num_proposed=num_valid)
        return sum(from_model)

    def take_failed(self) -> dict[str, str]:
        """request_id → message for requests this engine failed since the last call (their outputs
        carry finish_reason "abort"; a caller reports them as errors)."""
        failed, self.failed = self.failed, {}
        return failed

    def _record(self, sched: SchedulerOutput, result: "StepVerify") -> None:
        m = self.metrics
        m.num_steps += 1
        for item in sched.scheduled:
            m.num_prompt_tokens += max(0, min(item.start_pos + item.num_new_tokens - item.num_drafts,
                                              len(item.request.prompt_ids)) - item.start_pos)
            if item.num_drafts:
                m.record_verify(item.num_drafts, result.num_accepted_by_id.get(item.request.request_id, 0))

    def _advance_grammars(self, emitted: dict[str, list[int]]) -> None:
        for rid, ids in emitted.items():
            req = self.requests.get(rid)
            if req is not None and req.grammar is not None and ids:
                req.grammar.advance(ids)

    def _outputs(self, sched: SchedulerOutput, emitted: dict[str, list[int]],
                 logprobs: dict[str, list[TokenLogprob]]) -> list[StepOutput]:
        outs = []
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
                prompt_logprobs=req.prompt_logprobs if new_ids and len(req.output_ids) == len(new_ids) else None))
            if req.is_finished:
                self.metrics.record_finished(coalesce_held_steps=req.waiting_steps)
                if self.drafter is not None:
                    self.drafter.release(rid)  # per-request drafter state (aborts included)
                    if req.uses_speculation and rid not in self.failed:
                        self.drafter.observe_finished(req.all_ids, len(req.prompt_ids))  # lookup's cross-request cache
                del self.requests[rid]
        return outs

    # -- introspection (server /metrics) ---------------------------------------------------------
    @property
    def kv_usage(self) -> float:
        return self.block_manager.usage

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)


class NextStep(NamedTuple):
    num_nondraft: int  # tokens of the next step that are not drafts (within the budget)
    num_prompt: int  # of those, prompt-chunk tokens (the rest: one per decoding request)
    max_drafts: int  # budget left after every non-draft token asked for: drafts beyond it would push
    #                  prompt tokens to a later step


@dataclass
class StepVerify:
    output_ids_by_id: dict[str, list[int]]
    num_accepted_by_id: dict[str, int]
    logprobs_by_id: dict[str, list[TokenLogprob]] = field(default_factory=dict)
