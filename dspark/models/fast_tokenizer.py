"""FastTokenizer: a converted GGUF tokenizer served straight from its Rust `tokenizers.Tokenizer`, with the part
of transformers' fast-tokenizer interface the engine, the server and the offline API call (encode, decode,
token strings, vocabulary, special tokens, the chat template), without importing transformers (~27 MiB of a
served process: the package's import and the wrapper's Python state).

Only a cache folder whose settings it reproduces exactly loads this way (`FastTokenizer.supports`): a
tokenizer.json, and a tokenizer_config.json naming no more than the special tokens, the length limit, the
padding side and the chat template; anything else goes through transformers (models/tokenizer.py).
`models.tokenizer.as_transformers` builds transformers' own tokenizer from the same folder for callers that
want its whole interface (`LLM.get_tokenizer()`). tests/test_fast_tokenizer.py holds both shipped GGUFs'
tokenizers against AutoTokenizer: encodings, decodings, token strings, vocabulary, special and added tokens,
rendered chats.

The chat template renders in a sandboxed Jinja environment with the conventions Hugging Face chat templates
are written for: trimmed blocks, `tojson` without HTML escaping, `raise_exception`, `strftime_now`, loop
controls, a pass-through `{% generation %}` block, messages without their None-valued keys, the special
tokens' strings as variables, and `continue_final_message`.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, Mapping

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys whose effect FastTokenizer reproduces; the rest of what a converted GGUF tokenizer
# writes says where it came from (backend, is_local, local_files_only) or which class to build
KNOWN_SETTINGS = {*NAMED_TOKENS, "model_max_length", "padding_side", "chat_template", "tokenizer_class",
                  "backend", "is_local", "local_files_only", "clean_up_tokenization_spaces"}
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class FastTokenizer:
    """A `tokenizers.Tokenizer` with its config's special tokens and chat template (see the module docstring)."""

    def __init__(self, folder: Path):
        import tokenizers
        self.name_or_path = str(folder)
        self.backend_tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = self._config = json.loads((folder / "tokenizer_config.json").read_text())
        self._special = {k: config[k] for k in NAMED_TOKENS if isinstance(config.get(k), str)}
        self.model_max_length = config.get("model_max_length")
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = config.get("chat_template") or (
            template.read_text() if template.is_file() else None)

    @staticmethod
    def supports(folder: Path) -> bool:
        """Whether `folder` holds a tokenizer whose behaviour this class reproduces (module docstring)."""
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return False
        return ((folder / "tokenizer.json").is_file() and set(config) <= KNOWN_SETTINGS
                and all(isinstance(config.get(k), (str, type(None))) for k in NAMED_TOKENS)
                and not config.get("clean_up_tokenization_spaces")
                and isinstance(config.get("chat_template"), (str, type(None))))

    # -- ids and text ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else ()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend_tokenizer.get_added_tokens_decoder()

    # -- special tokens -------------------------------------------------------------------------------
    def __getattr__(self, name: str):
        # bos_token, eos_token_id, ...: the config's named special tokens and their ids (None where unset)
        base, is_id = (name[:-3], True) if name.endswith("_id") else (name, False)
        if base not in NAMED_TOKENS:
            raise AttributeError(name)
        token = self.__dict__.get("_special", {}).get(base)
        return self.convert_tokens_to_ids(token) if is_id and token is not None else token

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self._special[k] for k in NAMED_TOKENS if k in self._special))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # -- chat -----------------------------------------------------------------------------------------
    def apply_chat_template(self, conversation: list, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True, **kwargs):
        """One conversation rendered with its template (ids with `tokenize`, else the text), as transformers'
        `apply_chat_template` renders it for these arguments."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template")
        text = render_chat(template, conversation, special=self._special, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- transformers ---------------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path) -> None:
        """tokenizer.json, tokenizer_config.json and chat_template.jinja into `folder`, which transformers'
        AutoTokenizer (and this class) load."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend_tokenizer.save(str(folder / "tokenizer.json"))
        config = {k: v for k, v in self._config.items() if k != "chat_template"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        if self.chat_template is not None:
            (folder / "chat_template.jinja").write_text(self.chat_template)


def _plain(value: Any) -> Any:
    """What a template sees: plain JSON types (pydantic models and dataclasses as dicts, other objects as a
    "<TypeName>" placeholder), so the sandbox never meets an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind, plain in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, kind):  # a subclass (an enum, a numpy float) as its plain value; bool has none
            return plain(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _aliased(message: dict) -> dict:
    """A message's reasoning under every name templates read it by (reasoning_content, thinking)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(chat: list[dict], field: bool | str, template: str) -> tuple[list[dict], str]:
    """The chat with a tag after its final message's text, so the rendering can be cut where that text ends."""
    field = field if isinstance(field, str) else "content"
    last = chat[-1]
    final = last.get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [f for f in REASONING_FIELDS if last.get(f) == final] if field in REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         "chat_template")
    if isinstance(final, (list, tuple)):
        block = next((b for b in reversed(final) if "text" in b), None)
        if block is None:
            raise ValueError("continue_final_message is set but we could not find any text to continue")
        final, block["text"] = block["text"], block["text"] + CONTINUE_TAG
    else:
        for f in fields:
            last[f] = last[f] + CONTINUE_TAG
    return chat, final


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def render_chat(template: str, conversation: list, *, special: Mapping[str, str], tools: list | None = None,
                documents: list | None = None, add_generation_prompt: bool = False,
                continue_final_message: bool | str = False, max_chars: int | None = None, **kwargs) -> str:
    """One conversation rendered with `template` (the special tokens' strings as variables), as transformers'
    `apply_chat_template` renders it; `max_chars`: a ValueError once the text grows past that many characters
    (the rendering stops there instead of building the rest)."""
    if not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    chat = [_aliased({k: v for k, v in m.items() if v is not None}) for m in _plain(list(conversation))]
    final = None
    if continue_final_message:
        chat, final = _tag_final_message(chat, continue_final_message, template)
    parts, size = [], 0
    for part in _compiled(template).generate(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                             add_generation_prompt=add_generation_prompt,
                                             **{**special, **_plain(kwargs)}):
        size += len(part)
        if max_chars is not None and size > max_chars:
            raise ValueError(f"the chat template's text grew past {max_chars} characters")
        parts.append(part)
    text = "".join(parts)
    return text if final is None else _cut_at_tag(text, final)


@cache
def _compiled(template: str):
    """`template` compiled in the sandbox (see the module docstring); compiled once per template text."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}…{% endgeneration %}`: marks an assistant's part for training masks; renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace() without underscore-prefixed attributes (no reach into Python internals)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set the namespace attribute {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=type("TemplateDict", (), {"__call__": lambda self, *a, **k: dict(*a, **k),
                                                      "fromkeys": lambda self, *a, **k: dict.fromkeys(*a, **k)})())
    return env.from_string(template)
