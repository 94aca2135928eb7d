"""Structured output: token masks from a grammar, per request, with rollback (llguidance).

A request's `SamplingParams.structured_outputs` is one of
`{"json": schema}`, `{"json_object": True}`, `{"regex": pattern}`, `{"choice": [strings]}` or
`{"grammar": lark}` (the server maps OpenAI's `response_format` and vLLM's `structured_outputs` /
`guided_*` onto it). llguidance (PyPI `llguidance`: the Rust low-level guidance parser, no Python
dependencies, token masks in ~tens of microseconds, rollback of consumed tokens) compiles it against the
tokenizer's byte vocabulary; JSON is compact (no free whitespace) unless the schema's `x-guidance` says
otherwise.

Under speculation (`verify/sampler.py`): window row j is masked with the grammar state after the
committed output and the drafts d1..dj (consumed, masked, then rolled back), and drafts the grammar
forbids are cut before verification (`valid_prefix`: they could never be accepted). The matcher
advances only by committed tokens (`advance`).

    pytest tests/test_structured.py -q
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

import torch

from dspark.json_schema import BytesVocab, check_pattern, check_schema

_BITS = torch.arange(32, dtype=torch.int32)  # [32]
JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_text(spec: dict[str, Any]) -> str:
    """llguidance grammar for one structured-output spec; ValueError names a malformed one."""
    import llguidance

    kinds = [k for k in ("json", "json_object", "regex", "choice", "grammar") if spec.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                         f"got {sorted(spec)}")
    kind, value = kinds[0], spec[kinds[0]]
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        check_schema(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        check_pattern(value, "regex")
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not value or not all(isinstance(c, str) for c in value):
            raise ValueError("structured_outputs choice must be a non-empty list of strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    return llguidance.LLMatcher.grammar_from_lark(value)


def check_spec(spec: dict[str, Any]) -> None:
    """Compile and validate without a tokenizer (the server's 400 before a request is queued)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(spec))
    if error and not error.startswith("WARNING"):
        raise ValueError(error.strip())


class GrammarCompiler:
    """Compiles specs for one tokenizer; the llguidance tokenizer is built on first use (~1 s)."""

    def __init__(self, make_tokenizer: Callable[[], Any], vocab_size: int):
        self._make_tokenizer = make_tokenizer
        self._tokenizer = None
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)

    @classmethod
    def for_tokenizer(cls, tokenizer, *, vocab_size: int, eos_token_ids: tuple[int, ...]) -> "GrammarCompiler":
        """From anything with a Rust `backend_tokenizer` (transformers' fast tokenizers, FastTokenizer), or with
        `token_bytes()` (tests' tokenizers). llguidance is imported on first use."""

        def make():
            import llguidance
            hf = getattr(tokenizer, "tokenizer", tokenizer)
            if hasattr(hf, "token_bytes"):
                vocab = llguidance.TokenizerWrapper(BytesVocab(hf.token_bytes(), eos_token_ids[0]))
                return llguidance.LLTokenizer(vocab, n_vocab=vocab_size, eos_token=list(eos_token_ids))
            if not hasattr(hf, "backend_tokenizer"):
                raise ValueError(f"structured output needs a fast (Rust-backed) tokenizer, not {type(hf).__name__}")
            backend = copy.copy(hf.backend_tokenizer)  # its JSON, without padding or truncation
            backend.no_padding()
            backend.no_truncation()
            return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        return cls(make, vocab_size)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer()
        return self._tokenizer

    def request_grammar(self, params, prompt_ids: list[int]):
        """A request's grammar: its `structured_outputs`, applied after its reasoning where the request carries
        a reasoning format's tags (`AfterReasoning`)."""
        grammar = self.matcher(params.structured_outputs)
        tags = params.reasoning_tags
        if tags is None:
            return grammar
        return AfterReasoning(grammar, start_ids=tags.start, end_ids=tags.end, prompt_ids=prompt_ids,
                              always_thinks=tags.always_thinks, call_ids=tags.call_start)

    def matcher(self, spec: dict[str, Any]) -> "GrammarMatcher":
        import llguidance

        grammar = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"structured output: {error}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size)


class GrammarMatcher:
    """One request's grammar state over its committed output."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size

    def advance(self, token_ids: list[int]) -> None:
        """Consume committed tokens (they were sampled under this grammar's masks)."""
        if not self._m.is_stopped():
            self._m.consume_tokens(list(token_ids))

    def _consume(self, after: list[int]) -> bool:
        """Consume `after` tentatively (the caller rolls it back); False (nothing consumed) where the grammar
        does not take all of it."""
        if not after:
            return True
        n = 0 if self._m.is_stopped() else self._m.try_consume_tokens(list(after))
        if n < len(after):
            if n:
                self._m.rollback(n)
            return False
        return True

    def valid_prefix(self, draft_ids: list[int], *, after: list[int] = ()) -> int:
        """How many of the drafts the grammar allows in a row (the state is left unchanged), after the
        tokens `after` (0 where the grammar does not take those)."""
        if not draft_ids or not self._consume(after):
            return 0
        n = 0 if self._m.is_stopped() else self._m.try_consume_tokens(list(draft_ids))
        if n + len(after):
            self._m.rollback(n + len(after))
        return n

    def window_masks(self, draft_ids: list[int], *, after: list[int] = ()) -> torch.Tensor:
        """Allowed tokens at each row of a verify window ([len(draft_ids) + 1, vocab_size] bool): row j after
        the drafts d1..dj (a row past a draft the grammar forbids repeats the last valid row's mask: it can
        never emit), all after the tokens `after` (every row empty where the grammar does not take those)."""
        import llguidance.torch

        rows = len(draft_ids) + 1
        if not self._consume(after):
            return torch.zeros(rows, self.vocab_size, dtype=torch.bool)
        bitmask = llguidance.torch.allocate_token_bitmask(rows, self.vocab_size)  # [rows, ceil(V / 32)]
        consumed = 0
        for j in range(rows):
            if j > 0 and (consumed < j - 1 or self._m.is_stopped()
                          or not self._m.try_consume_tokens([draft_ids[j - 1]])):
                bitmask[j] = bitmask[j - 1]
                continue
            consumed += j > 0
            llguidance.torch.fill_next_token_bitmask(self._m, bitmask, j)
        if consumed + len(after):
            self._m.rollback(consumed + len(after))
        bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [rows, ceil(V / 32), 32]
        return bits.view(rows, -1)[:, :self.vocab_size].bool()

    @property
    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and its end (EOS) consumed: nothing more may follow."""
        return self._m.is_stopped()


def _ends_with(ids: list[int], tail: tuple[int, ...]) -> bool:
    return len(ids) >= len(tail) and tuple(ids[len(ids) - len(tail):]) == tail


class AfterReasoning:
    """A grammar applied to the answer only (`SamplingParams.reasoning_tags`, from `--reasoning-parser`): tokens
    are free while the output reasons and the grammar starts after the end tag's tokens, so drafts inside
    the thoughts are never cut by the answer's grammar. The phase the output starts in is read off the prompt
    ids as the server's parser reads its text (`dspark.chat.reasoning.Phase`): thinking inside a block the
    prompt opened (or always, for a model that always reasons first), the grammar after a block it closed;
    otherwise the output either opens a block (the start tag's tokens, one by one) or begins the answer. While
    the output is a proper prefix of the start tag both stay possible: a row allows the tag's next token and
    what the grammar allows after that prefix as the answer's beginning, so an answer whose first tokens are
    the tag's (`<` of `<think>`) is still held to the grammar, from its first token."""

    OPEN, THINKING, ANSWER = "open", "thinking", "answer"

    def __init__(self, grammar: GrammarMatcher, *, start_ids: tuple[int, ...], end_ids: tuple[int, ...],
                 prompt_ids: list[int], always_thinks: bool = False, call_ids: tuple[int, ...] = ()):
        self.grammar, self.start_ids, self.end_ids = grammar, tuple(start_ids), tuple(end_ids)
        self.call_ids = tuple(call_ids)  # a tool call's marker written while thinking ends the thoughts too
        self._window = max(len(self.end_ids), len(self.call_ids))
        self.vocab_size = grammar.vocab_size
        s, e = _rfind(prompt_ids, self.start_ids), _rfind(prompt_ids, self.end_ids)
        self.phase = (self.THINKING if s > e else self.ANSWER if e >= 0
                      else self.THINKING if always_thinks else self.OPEN)
        self.pending: list[int] = []  # OPEN: the output so far, a proper prefix of the start tag
        self.recent: list[int] = []  # THINKING: the output's last tokens (to find the end tag)

    def _scan(self, ids: list[int], phase: str, pending: list[int], recent: list[int]
              ) -> tuple[str, list[int], list[int], int]:
        """(phase, lead, recent, k) after `ids` from the state (phase, pending, recent). In the answer, the
        answer's tokens so far are lead + ids[k:] (lead: a start-tag prefix that turned out to be the answer's
        beginning); otherwise lead is the new pending prefix."""
        pending, recent = list(pending), list(recent)
        for i, t in enumerate(ids):
            if phase == self.OPEN:
                if t != self.start_ids[len(pending)]:
                    return self.ANSWER, pending, [], i
                pending.append(t)
                if len(pending) == len(self.start_ids):
                    phase, pending = self.THINKING, []
                continue
            recent = (recent + [t])[-self._window:]
            if _ends_with(recent, self.end_ids) or (self.call_ids and _ends_with(recent, self.call_ids)):
                return self.ANSWER, [], [], i + 1
        return phase, pending, recent, len(ids)

    def advance(self, token_ids: list[int]) -> None:
        if self.phase != self.ANSWER:
            self.phase, lead, self.recent, k = self._scan(token_ids, self.phase, self.pending, self.recent)
            self.pending, token_ids = ([], lead + token_ids[k:]) if self.phase == self.ANSWER else (lead, [])
        if self.phase == self.ANSWER and token_ids:
            self.grammar.advance(token_ids)

    def valid_prefix(self, draft_ids: list[int]) -> int:
        if self.phase == self.ANSWER:
            return self.grammar.valid_prefix(draft_ids)
        phase, lead, _, k = self._scan(draft_ids, self.phase, self.pending, self.recent)
        if phase != self.ANSWER:
            return len(draft_ids)
        return k + self.grammar.valid_prefix(draft_ids[k:], after=lead)

    def window_masks(self, draft_ids: list[int]) -> torch.Tensor:  # [len(draft_ids) + 1, vocab_size] bool
        if self.phase == self.ANSWER:
            return self.grammar.window_masks(draft_ids)
        masks = torch.ones(len(draft_ids) + 1, self.vocab_size, dtype=torch.bool)
        phase, pending, recent = self.phase, self.pending, self.recent
        for j in range(len(draft_ids) + 1):
            if phase == self.OPEN:  # the tag's next token, or the answer's beginning
                masks[j] = self.grammar.window_masks([], after=pending)[0]
                masks[j, self.start_ids[len(pending)]] = True
            if j == len(draft_ids):
                break
            phase, lead, recent, k = self._scan(draft_ids[j:j + 1], phase, pending, recent)
            if phase == self.ANSWER:
                masks[j + 1:] = self.grammar.window_masks(draft_ids[j + 1:], after=lead + draft_ids[j:j + 1][k:])
                break
            pending = lead
        return masks

    @property
    def is_accepting(self) -> bool:
        return self.phase == self.ANSWER and self.grammar.is_accepting

    @property
    def is_stopped(self) -> bool:
        return self.phase == self.ANSWER and self.grammar.is_stopped


def _rfind(ids: list[int], tag: tuple[int, ...]) -> int:
    """Start of the last occurrence of `tag` in `ids`, -1 where there is none."""
    n = len(tag)
    return next((i for i in range(len(ids) - n, -1, -1) if tuple(ids[i:i + n]) == tag), -1)
