"""Logprobs in OpenAI's two shapes, from the engine's `TokenLogprob` entries.

* chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`
* completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`

A token's string is its own decoding (`tokenizer.decode([id])`); the logprobs are the engine's: the
processed target distribution of the emitted token (`verify/sampler.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.sampling import TokenLogprob


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


@dataclass
class LogprobFormatter:
    """Formats successive chunks of one request's logprobs (completions' text offsets run on)."""

    tokenizer: object  # anything with decode(ids)
    chat: bool
    text_offset: int = 0  # characters before the next token (the echoed prompt included)
    top_k: int | None = None  # alternatives shown per token (the engine's may be more); None: all
    _cache: dict[int, str] = field(default_factory=dict)

    def token(self, token_id: int) -> str:
        if token_id not in self._cache:
            self._cache[token_id] = self.tokenizer.decode([token_id])
        return self._cache[token_id]

    def _top(self, e: TokenLogprob) -> list[tuple[int, float]]:
        return e.top if self.top_k is None else e.top[:self.top_k]

    def format(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [dict(_entry(self.token(e.token_id), e.logprob),
                                     top_logprobs=[_entry(self.token(t), lp) for t, lp in self._top(e)])
                                for e in entries]}
        tokens = [self.token(e.token_id) for e in entries]
        offsets = []
        for tok in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token(t): lp for t, lp in self._top(e)} for e in entries],
                "text_offset": offsets}

    def format_prompt(self, first_token_id: int, entries: list[TokenLogprob | None]) -> dict:
        """The prompt's tokens in the completions shape (echo): the first has no logprob (null, as
        OpenAI's legacy API and vLLM give it), each other its own and its position's top k."""
        token = self.token(first_token_id)
        head = {"tokens": [token], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self.text_offset]}
        self.text_offset += len(token)
        return self.merge([head, self.format(entries[1:])])

    def vllm_entries(self, entries: list[TokenLogprob | None]) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}}
        for the token itself and its position's top k."""
        out: list[dict | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            ranked = {e.token_id: (e.logprob, e.rank)}
            for r, (t, lp) in enumerate(self._top(e), start=1):
                ranked.setdefault(t, (lp, r))
            out.append({str(t): {"logprob": lp, "rank": r, "decoded_token": self.token(t)}
                        for t, (lp, r) in ranked.items()})
        return out

    @staticmethod
    def merge(parts: list[dict | None]) -> dict | None:
        """The whole response's logprobs from its chunks'."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return {key: [x for p in parts for x in p[key]] for key in parts[0]}
