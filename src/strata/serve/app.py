"""The OpenAI-compatible app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

One engine, one sequence at a time: a single worker thread runs generations in arrival order, so
requests never share cache state. Admission is bounded (429 past --max-queue). A stream whose client
goes away is cancelled and stops within one decode round."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from ..errors import StrataError
from ..engine.decode import Engine, GenerationResult
from ..engine.sampling import SamplingParams
from ..tokenizer import StreamDecoder, Tokenizer
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest, error_body

log = logging.getLogger("strata.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.kind = status, message, param, headers, kind


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop_ids: set[int]
    stop_strings: list[str]
    tokenizer: Tokenizer | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue | None = None  # text deltas for streaming; None at the end
    cancel: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    emitted: int = 0
    stopped_by_string: bool = False
    result: GenerationResult | None = None

    def __post_init__(self):
        self.decoder = StreamDecoder(self.tokenizer) if self.tokenizer else None
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1

    def on_tokens(self, ids: list[int]) -> None:
        if self.stopped_by_string:
            return
        if self.decoder is None:
            self.text += "".join(f" {i}" for i in ids)
        else:
            self.text += self.decoder.push([i for i in ids if i not in self.stop_ids])
        for s in self.stop_strings:
            at = self.text.find(s)
            if at >= 0:
                self.text = self.text[:at]
                self.stopped_by_string = True
                self.cancel.set()
        safe = len(self.text) if self.stopped_by_string else len(self.text) - self.hold
        if self.queue is not None and safe > self.emitted:
            delta = self.text[self.emitted:safe]
            self.emitted = safe
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)

    def finish(self) -> None:
        if self.queue is not None:
            if len(self.text) > self.emitted:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, self.text[self.emitted:])
                self.emitted = len(self.text)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped_by_string else self.result.finish_reason


class Server:
    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, model_name: str, stop_ids: set[int],
                 max_queue: int = 64):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.stop_ids = set(stop_ids)
        self.max_queue = max_queue
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-engine")
        self.admitted = 0
        self.lock = threading.Lock()
        self.metrics = Metrics(engine.window)
        self.created = int(time.time())

    # -- admission
    def admit(self) -> None:
        with self.lock:
            if self.admitted >= self.max_queue:
                raise APIError(429, f"the server is busy: {self.admitted} requests in flight (--max-queue "
                                    f"{self.max_queue}); retry later", headers={"Retry-After": "1"},
                               kind="rate_limit_error")
            self.admitted += 1
            self.metrics.queue.set(self.admitted)

    def release(self) -> None:
        with self.lock:
            self.admitted -= 1
            self.metrics.queue.set(self.admitted)

    # -- request -> job
    def build_job(self, req, prompt_ids: list[int], loop, default_max: int | None) -> Job:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", kind="not_found_error")
        if req.n != 1:
            raise APIError(400, "n must be 1 (several choices per request are not supported)", param="n")
        if req.logprobs or getattr(req, "top_logprobs", None):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        try:
            self.engine.check_prompt(prompt_ids)
            params = SamplingParams(req.temperature, req.top_k, req.top_p, req.seed)
        except StrataError as e:
            raise APIError(400, str(e), param="prompt" if "prompt" in str(e) else None) from None
        max_tokens = req.max_tokens if req.max_tokens is not None else default_max
        room = self.engine.max_len - len(prompt_ids)
        max_tokens = room if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        stop_ids = self.stop_ids | set(req.stop_token_ids or [])
        return Job(prompt_ids, max_tokens, params, stop_ids, stops, self.tokenizer, loop)

    def run(self, job: Job) -> Job:
        try:
            job.result = self.engine.generate(job.prompt_ids, job.max_tokens, job.stop_ids, job.params,
                                              on_tokens=job.on_tokens, should_stop=job.cancel.is_set)
            self.metrics.record_generation(job.result)
        finally:
            job.finish()
        return job

    def submit(self, job: Job) -> asyncio.Future:
        self.admit()
        fut = asyncio.wrap_future(self.worker.submit(self.run, job))
        fut.add_done_callback(lambda _: self.release())
        return fut

    def usage(self, job: Job) -> dict:
        res = job.result
        st = res.stats()
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": res.new_tokens,
                "total_tokens": len(job.prompt_ids) + res.new_tokens}, {
            "drafter": st["drafter"], "window": st["window"], "tau": st["tau"], "rounds": st["rounds"],
            "acceptance_rate": st["acceptance_rate"], "per_position_acceptance": st["per_position_acceptance"]}


async def parse(request: Request, model):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"field '{where}': {err['msg']}", param=where) from None


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="Strata", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.status), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        server.metrics.requests.labels(endpoint=request.url.path, status=str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(server.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "strata", "max_model_len": server.engine.max_len}]}

    def encode(text: str) -> list[int]:
        if server.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids",
                           param="prompt")
        return server.tokenizer.encode(text)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one prompt", param="prompt")
            prompt = prompt[0]
        ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
        job = server.build_job(req, ids, asyncio.get_running_loop(), default_max=16)
        return await respond(request, req, job, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatRequest)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if server.tokenizer is None or not server.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            text = server.tokenizer.apply_chat_template([m.model_dump() for m in req.messages])
        except StrataError as e:
            raise APIError(400, str(e), param="messages") from None
        job = server.build_job(req, encode(text), asyncio.get_running_loop(), default_max=None)
        return await respond(request, req, job, chat=True)

    async def respond(request: Request, req, job: Job, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        t0 = time.perf_counter()
        if not req.stream:
            fut = server.submit(job)
            try:
                await fut
            except asyncio.CancelledError:
                job.cancel.set()
                raise
            server.metrics.latency.observe(time.perf_counter() - t0)
            usage, extra = server.usage(job)
            choice = {"index": 0, "finish_reason": job.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": job.text}
            else:
                choice["text"] = job.text
            return {"id": rid, "object": obj, "created": created, "model": server.model_name, "choices": [choice],
                    "usage": usage, "strata": extra}

        job.queue = asyncio.Queue()
        fut = server.submit(job)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        role_sent = [False]

        def chunk(delta: str | None, finish: str | None, usage=None, extra=None) -> str:
            if chat:
                body = {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": finish,
                        "logprobs": None}
                if delta is not None and not role_sent[0]:
                    body["delta"]["role"] = "assistant"
                    role_sent[0] = True
            else:
                body = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            data = {"id": rid, "object": chunk_obj, "created": created, "model": server.model_name, "choices": [body]}
            if usage is not None:
                data["usage"], data["strata"] = usage, extra
            return f"data: {json.dumps(data)}\n\n"

        async def events():
            try:
                while True:
                    delta = await job.queue.get()
                    if delta is None:
                        break
                    yield chunk(delta, None)
                await fut
                server.metrics.latency.observe(time.perf_counter() - t0)
                usage, extra = server.usage(job)
                yield chunk(None, job.finish_reason, usage, extra)
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - a failed stream ends with an error event, not a crash
                if isinstance(e, asyncio.CancelledError):
                    raise
                log.exception("stream failed")
                yield f"data: {json.dumps(error_body(f'internal error: {type(e).__name__}', 'server_error'))}\n\n"
            finally:
                job.cancel.set()  # a client that went away stops its generation within one round

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve_forever(server: Server, host: str, port: int, shutdown_timeout: float) -> None:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """SIGTERM/SIGINT: stop accepting, let in-flight requests finish, then exit 0 (uvicorn itself
        re-raises the signal after its shutdown, which would end the process with -15)."""

        @contextlib.contextmanager
        def capture_signals(self):
            saved = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(create_app(server), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=shutdown_timeout)
    GracefulServer(config).run()
