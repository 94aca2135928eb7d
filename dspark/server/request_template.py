"""Chat templates that come with a request (`chat_template`, or `chat_template` inside `chat_template_kwargs`).

A template is code: a few bytes of Jinja can expand to gigabytes or loop for hours. So a request's template is
refused (400) unless the operator starts the server with `--trust-request-chat-template` (vLLM's flag), and a
trusted one renders in a child process (forked from a small forkserver, not from the server) under a budget:
`TIME_BUDGET_S` seconds, `MAX_CHARS` characters of text and `MEMORY_BUDGET_BYTES` of address space beyond the
child's own. Past any of them the child is killed and the request gets a 400 naming `chat_template`; the
server's event loop waits on a worker thread meanwhile, and its memory never holds more than the budgeted text.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from functools import cache
from typing import Any

TIME_BUDGET_S = 2.0
MAX_CHARS = 4 << 20  # characters of rendered text (a prompt past the context is refused later anyway)
MEMORY_BUDGET_BYTES = 1 << 30


class TemplateBudgetError(ValueError):
    """A request's template failed or went past its budget; the message says which."""


def render(template: str, messages: list[dict], *, special: dict[str, str], **kwargs: Any) -> str:
    """`messages` rendered with the request's `template` (`fast_tokenizer.render_chat`'s conventions; `special`: the
    tokenizer's special tokens' strings) in a child process under the budget (this module's constants, read at
    each call); blocks (run it off the event loop). TemplateBudgetError for a template that fails, overruns or
    dies."""
    time_budget_s, max_chars, memory_budget = TIME_BUDGET_S, MAX_CHARS, MEMORY_BUDGET_BYTES
    context = _context()
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_render_child, daemon=True,
                            args=(sender, template, messages, special, max_chars, memory_budget, kwargs))
    start = time.monotonic()
    child.start()
    sender.close()
    try:
        if not receiver.poll(max(0.0, time_budget_s - (time.monotonic() - start))):
            raise TemplateBudgetError(f"the chat template took longer than {time_budget_s:g} s to render")
        ok, value = receiver.recv()
    except EOFError:  # killed by its memory limit (or anything else) before it answered
        raise TemplateBudgetError(f"the chat template's rendering died (past {memory_budget >> 20} MiB of memory?)"
                                  ) from None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()
    if not ok:
        raise TemplateBudgetError(value)
    return value


@cache
def _context():
    """A forkserver context whose server process has the renderer imported: children start in milliseconds and
    inherit nothing of the serving process (its threads, its model, its memory)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dspark.server.request_template", "dspark.models.fast_tokenizer", "jinja2.sandbox"])
    return context


def _render_child(sender, template: str, messages: list[dict], special: dict[str, str], max_chars: int,
                  memory_budget: int, kwargs: dict) -> None:
    """The child: limit its own address space, render, send (True, text) or (False, the error's message)."""
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + memory_budget,) * 2)
    except (ImportError, ValueError, OSError):  # no such limit here: the time and size budgets still hold
        pass
    try:
        from dspark.models.fast_tokenizer import render_chat
        sender.send((True, render_chat(template, messages, special=special, max_chars=max_chars, **kwargs)))
    except MemoryError:
        sender.send((False, f"the chat template needed more than {memory_budget >> 20} MiB of memory"))
    except Exception as e:  # a template error, a bad variable, the size budget: the request's 400
        sender.send((False, f"chat template failed on these messages: {type(e).__name__}: {str(e)[:500]}"))
    finally:
        sender.close()


def _address_space() -> int:
    """This process's address space in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
