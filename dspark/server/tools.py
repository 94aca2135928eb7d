"""Tool calls: `tools` + `tool_choice` "required" or a named function, constrained by a grammar.

The output is generated under a JSON-schema grammar (dspark/structured.py), so it always parses:
* a named function (`{"type": "function", "function": {"name": F}}`): the schema is F's `parameters`;
  the whole output is F's arguments;
* "required": `{"name": <one of the tools>, "arguments": <that tool's parameters>}` (anyOf over the
  tools); the output names the function and carries its arguments.
The response carries `message.tool_calls` (content null) and `finish_reason: "tool_calls"`. "auto" (and
tools without tool_choice, OpenAI's default "auto") generates freely and parses the model's own tool-call
format (`--enable-auto-tool-choice --tool-call-parser NAME`, dspark/chat/tool_parsers.py); without
those flags it is refused with a 400 that says so, as vLLM does. "none" ignores the tools. The tools are
handed to the chat template either way.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from dspark.json_schema import check_schema, matches, rebase

ANY_OBJECT = {"type": "object"}
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolMode:
    """How the constrained output becomes a tool call."""

    name: str | None  # the named function; None: the output names it ("required")

    def calls(self, text: str) -> list[dict] | None:
        """[one OpenAI tool call] from the grammar-constrained output; None where it does not parse as one (JSON
        nested past what Python's parser takes)."""
        try:
            value = json.loads(text)
            name, arguments = (self.name, value) if self.name is not None else (value["name"], value["arguments"])
            return [openai_tool_call(name, json.dumps(arguments))]
        except (ValueError, RecursionError, TypeError, KeyError):
            return None


def openai_tool_call(name: str, arguments: str) -> dict:
    """One entry of a response's `message.tool_calls`: a fresh call id, the function's name and its arguments
    as JSON text."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_constraint(req, bad_request, *, auto_tools: bool = False) -> tuple[dict, ToolMode] | None:
    """(structured-output spec, ToolMode) for a chat request that must call a tool; None without tools,
    with tool_choice "none", or with "auto" where the server parses the model's calls (`auto_tools`); a 400
    (via `bad_request(message, param)`) for what is not supported."""
    choice = req.tool_choice
    if not req.tools:
        return None
    tools = checked_tools(req, bad_request)  # with "none" too: the template still renders them
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if auto_tools:
            return None
        raise bad_request("tools with tool_choice 'auto' (the default) need the server started with "
                          "--enable-auto-tool-choice --tool-call-parser NAME (the model's tool-call format); "
                          "or send tool_choice 'required' or a named function", "tool_choice")
    if choice == "required":
        # each tool's parameters under $defs, their own references rebased there (a tool's "#/$defs/X" or "#"
        # would otherwise resolve against the wrapper)
        homes = {name: f"t{i}" for i, name in enumerate(tools)}
        return {"json": {"$defs": {homes[name]: rebase(params, f"#/$defs/{homes[name]}")
                                   for name, params in tools.items()},
                         "anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                                    "properties": {"name": {"const": name},
                                                   "arguments": {"$ref": f"#/$defs/{homes[name]}"}}}
                                   for name in tools]}}, ToolMode(None)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in tools:
            raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
        return {"json": tools[name]}, ToolMode(name)
    raise bad_request(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function",
                      "tool_choice")


def checked_tools(req, bad_request) -> dict[str, dict]:
    """name -> parameters schema of the request's tools; a 400 (via `bad_request(message, param)`) naming the tool
    whose name breaks OpenAI's rule or repeats another's, or whose parameters cannot be served (nested too deep,
    a reference outside the schema or to nothing, a part that admits no value: `json_schema.check_schema`)."""
    tools: dict[str, dict] = {}
    for i, tool in enumerate(req.tools or []):
        name, params = tool.function.name, tool.function.parameters or ANY_OBJECT
        if not TOOL_NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name {name[:80]!r} must be 1 to 64 letters, digits, _ or -",
                              f"tools[{i}].function.name")
        if name in tools:
            raise bad_request(f"tools[{i}].function.name {name!r} names another tool too", f"tools[{i}].function.name")
        try:
            check_schema(params)
        except ValueError as e:
            raise bad_request(f"tools[{i}].function.parameters ({name}): {e}",
                              f"tools[{i}].function.parameters") from None
        tools[name] = params
    return tools


def tool_schemas(req) -> dict[str, dict] | None:
    """name -> parameters schema of the request's tools, as `checked_tools` reads them (the sampling parameters
    checked them already); None without tools. What the tool parser types the values of text formats with."""
    return {t.function.name: t.function.parameters or ANY_OBJECT for t in req.tools} if req.tools else None


def strict_check(req):
    """For tool_choice "auto" with `strict` tools: ParsedCall -> is it a call the response may carry (a
    strict tool's arguments valid under its `parameters`; with any strict tool, only the request's tools)?
    None where no tool is strict. A call it refuses comes back as content."""
    if not req.tools or not any(t.function.strict for t in req.tools):
        return None
    tools = {t.function.name: t.function for t in req.tools}

    def accept(call) -> bool:
        tool = tools.get(call.name)
        if tool is None:
            return False
        if not tool.strict:
            return True
        try:  # llguidance's matcher: linear in the arguments' length whatever the schema's patterns
            return matches(tool.parameters or ANY_OBJECT, call.arguments)
        except ValueError:
            return False
    return accept


def template_tools(req) -> list[dict] | None:
    """The tools as the chat template takes them (None when there are none)."""
    return [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
