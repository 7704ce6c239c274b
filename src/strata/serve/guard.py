"""What every request passes before the app sees it, and how every response is counted: the API key,
the Host header of a loopback-bound server, the JSON content type, the declared body size; then the
request counter, labelled by route (never by the raw path)."""

from __future__ import annotations

import hmac
import json

from .protocol import error_body

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.kind = status, message, param, headers, kind


def host_name(host: str) -> str:
    """The name in a Host header, without its port."""
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """An ASGI middleware (pure, so streaming and disconnects pass through untouched)."""

    def __init__(self, app, metrics, api_key: str | None, max_body_bytes: int, loopback: bool):
        self.app, self.metrics, self.api_key = app, metrics, api_key
        self.max_body_bytes, self.loopback = max_body_bytes, loopback

    def check(self, scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if self.loopback and host_name(headers.get("host", "localhost")).lower() not in LOOPBACK_NAMES:
            return APIError(403, f"Host header {headers.get('host')!r} is not allowed: this server is bound to a "
                                 f"loopback address", kind="permission_error")
        if self.api_key is not None and path.startswith("/v1"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return APIError(401, "a valid API key is required: 'Authorization: Bearer KEY'",
                                kind="authentication_error")
        if method == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes "
                                     f"(--max-body-bytes)")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        error = self.check(scope)
        try:
            if error is None:
                await self.app(scope, receive, counted_send)
            else:
                body = json.dumps(error_body(error.message, error.kind, error.param, error.status)).encode()
                await counted_send({"type": "http.response.start", "status": error.status,
                                    "headers": [(b"content-type", b"application/json"),
                                                (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(endpoint=getattr(route, "path", "unmatched"), status=str(status[0])).inc()
