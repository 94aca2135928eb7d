"""Edge guards, as plain ASGI middleware (not BaseHTTPMiddleware, which would wrap streaming bodies):
every check here runs before a route reads a byte of the body, and every refusal is OpenAI's error
body with a 4xx.

- `APIKeyGuard`: every route that serves or reveals data needs `Authorization: Bearer KEY` (compared
  in constant time, `hmac.compare_digest`): all but `PUBLIC_PATHS` (/health, /version, the OpenAPI
  schema) and /metrics unless asked.
- `BodyGuard` (POST bodies): at most `max_body_bytes` (413, from Content-Length before reading, or
  while reading), `Content-Type: application/json` (415), UTF-8 (400), JSON with no NaN / Infinity
  literals, nested at most `MAX_JSON_DEPTH` deep (400), and no lone surrogate (`"\\ud800"`) in any
  string (400): the tokenizer never sees text it cannot encode. The body it read is replayed to the
  route, which parses it again (cheap beside a step).
"""

from __future__ import annotations

import hmac
import json

from fastapi.responses import JSONResponse

PUBLIC_PATHS = frozenset({"/health", "/version", "/openapi.json"})
MAX_JSON_DEPTH = 32  # OpenAI bodies nest 5 deep (messages[i].content[j].text); tools schemas more


def _error(status: int, message: str, type: str = "invalid_request_error",
           headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class APIKeyGuard:
    """`Authorization: Bearer KEY` on every route but PUBLIC_PATHS (and /metrics without
    `protect_metrics`); checked before the body is read, so a bad key is always a 401."""

    def __init__(self, app, *, api_key: str | tuple[str, ...], protect_metrics: bool = False):
        self.app = app
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key)
        self.api_keys = [k.encode() for k in keys]  # any of them opens the routes
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        if path == "/metrics":
            return self.protect_metrics
        return path.rstrip("/") not in PUBLIC_PATHS

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self._protected(scope["path"]):
            headers = dict(scope.get("headers") or ())
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            token = token.strip()
            ok = any([hmac.compare_digest(token, key) for key in self.api_keys])  # each constant time, all compared
            if scheme.lower() != b"bearer" or not ok:
                err = _error(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                             type="authentication_error")
                await err(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Refused(Exception):
    def __init__(self, response: JSONResponse):
        self.response = response


class BodyGuard:
    """Size, content type and JSON sanity of POST bodies (see the module docstring)."""

    def __init__(self, app, *, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
        except _Refused as r:
            await r.response(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the disconnect, when the client goes away

        await self.app(scope, replay, send)

    async def _read(self, scope, receive) -> bytes:
        headers = dict(scope.get("headers") or ())
        limit = self.max_body_bytes
        too_big = _error(413, f"request body exceeds the server's limit of {limit} bytes "
                              f"(--max-request-body-bytes)")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            if not length.isdigit():
                raise _Refused(_error(400, f"invalid Content-Length {length[:32]!r}"))
            raise _Refused(too_big)
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if kind != b"application/json":
            shown = kind.decode("latin-1")[:64] or "none"
            raise _Refused(_error(415, f"Content-Type must be application/json, got {shown}"))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refused(_error(400, "client disconnected while sending the body"))
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Refused(too_big)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = json_problem(body)
        if problem is not None:
            raise _Refused(_error(400, problem))
        return body


def json_problem(body: bytes) -> str | None:
    """Why this body is not JSON the routes may see, or None."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"request body is not valid UTF-8 (byte {e.start}: {body[e.start:e.start + 1]!r})"
    if not text.strip():
        return "request body is empty; send a JSON object"
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        return f"malformed JSON body: {e}"
    except RecursionError:
        return f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    return _value_problem(value)


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _value_problem(value) -> str | None:
    """Depth and lone surrogates, by an explicit stack (no recursion on hostile input)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if _has_surrogate(node):
                return "a string in the body holds a lone UTF-16 surrogate (invalid Unicode)"
            continue
        if isinstance(node, dict):
            children = list(node.keys()) + list(node.values())
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            return f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        stack.extend((child, depth + 1) for child in children)
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
