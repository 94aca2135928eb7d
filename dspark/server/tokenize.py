"""vLLM's /tokenize and /detokenize: the served tokenizer (and chat template) as the engine sees them."""

from __future__ import annotations

from dspark.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from dspark.server.serving import bad_request


def tokenize(req: TokenizeRequest, tokenizer, *, max_model_len: int) -> dict:
    """{"prompt"} (special tokens as `add_special_tokens` says) or {"messages"} (through the chat template,
    as /v1/chat/completions renders them) → token ids."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
    if req.prompt is not None:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        messages = [{"role": m.role, "content": _text(m.content)} for m in req.messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt
                                                and not req.continue_final_message,
                                                continue_final_message=req.continue_final_message or None)
        except Exception as e:  # the template rejects the conversation
            raise bad_request(f"chat template failed on these messages: {e}", param="messages") from None
    ids = [int(t) for t in ids]
    strs = tokenizer.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                            token_strs=strs).model_dump()


def detokenize(req: DetokenizeRequest, tokenizer) -> dict:
    vocab = tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens)).model_dump()


def _text(content) -> str:
    if isinstance(content, list):
        return "\n".join(part.text or "" for part in content)
    return content or ""
