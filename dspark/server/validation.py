"""Request checks that need more than a field's type: list sizes, token ids against the vocabulary,
and prompt + max_tokens against the context (vLLM's 400, with the numbers). Raised as `APIError` (400)
naming the field; the ranges of the sampling fields themselves live in `SamplingParams`.
"""

from __future__ import annotations

from dspark.server.serving import bad_request

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024


def check_fields(body, *, vocab_size: int) -> None:
    stop = body.stop
    if isinstance(stop, list):
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}",
                              param="stop")
    for s in ([stop] if isinstance(stop, str) else stop or ()):
        if len(s) > MAX_STOP_STRING_CHARS:
            raise bad_request(f"stop strings are at most {MAX_STOP_STRING_CHARS} characters, got "
                              f"{len(s)}", param="stop")
    ids = body.stop_token_ids or ()
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}",
                          param="stop_token_ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids: {bad[0]} is outside the vocabulary (size {vocab_size})",
                          param="stop_token_ids")


def check_context(num_prompt_tokens: int, max_tokens: int | None, *, max_model_len: int,
                  vocab_size: int | None = None, prompt_ids: list[int] | None = None) -> None:
    """The prompt must leave room for one token, and prompt + max_tokens must fit the context."""
    if num_prompt_tokens == 0:
        raise bad_request("prompt is empty", param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for the completion (the maximum model "
            f"length is {max_model_len})", param="prompt")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} in the completion). Reduce the prompt or max_tokens.", param="max_tokens")
    if vocab_size is not None and prompt_ids is not None:
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary "
                              f"(size {vocab_size})", param="prompt")
