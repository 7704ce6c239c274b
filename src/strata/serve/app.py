"""The OpenAI-compatible app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

One engine, one sequence at a time: a single worker thread runs generations in arrival order, so
requests never share cache state. Admission is bounded (429 past --max-queue). A client that goes
away, streaming or not, has its generation stopped within one decode round. Bodies are capped and
read under a deadline; parsing and tokenizing run off the event loop, so a huge request never
stalls the others or /health, and a prompt the context cannot hold is refused by its length, or
after as many tokens as the context holds, whatever its size. Every error is a JSON body."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.decode import Engine, GenerationResult
from ..engine.sampling import SamplingParams
from ..errors import SettingError, StrataError
from ..tokenizer import StreamDecoder, Tokenizer
from .guard import APIError, Guard
from .intake import decode_request, encode, encode_chat, read_body
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest, error_body

log = logging.getLogger("strata.serve")

#: OpenAI's defaults for sampling fields a request leaves out (the server's own defaults come first)
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None}


@dataclass
class ServerConfig:
    model_name: str
    stop_ids: set[int] = field(default_factory=set)
    max_queue: int = 64
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    timeout: float = 30.0  # to send a request's head and body
    loopback: bool = True  # bound to a loopback address: Host headers must name it
    defaults: dict = field(default_factory=dict)  # sampling defaults of requests that omit them
    setting_names: dict = field(default_factory=dict)  # the server's settings as its operator named them


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop_ids: set[int]
    stop_strings: list[str]
    tokenizer: Tokenizer | None
    loop: asyncio.AbstractEventLoop
    echo: str = ""  # the prompt's text, ahead of the completion (echo)
    queue: asyncio.Queue | None = None  # text deltas for streaming; None at the end
    cancel: threading.Event = field(default_factory=threading.Event)
    cut: bool = False  # stopped by the server's shutdown, not by the client
    stopped_by_string: bool = False
    result: GenerationResult | None = None

    def __post_init__(self):
        self.decoder = StreamDecoder(self.tokenizer) if self.tokenizer else None
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.text, self.emitted = self.echo, 0

    def on_tokens(self, ids: list[int]) -> None:
        if self.stopped_by_string:
            return
        if self.decoder is None:
            self.text += "".join(f" {i}" for i in ids)
        else:
            self.text += self.decoder.push([i for i in ids if i not in self.stop_ids])
        for s in self.stop_strings:
            at = self.text.find(s, len(self.echo))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped_by_string = True
                self.cancel.set()
        safe = len(self.text) if self.stopped_by_string else len(self.text) - self.hold
        self.send(safe)

    def send(self, upto: int) -> None:
        if self.queue is not None and upto > self.emitted:
            delta = self.text[self.emitted:upto]
            self.emitted = upto
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)

    def finish(self) -> None:
        if self.decoder is not None and not self.stopped_by_string:
            self.text += self.decoder.finish()
        self.send(len(self.text))
        if self.queue is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped_by_string else self.result.finish_reason


class Server:
    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, config: ServerConfig, batch=None):
        """batch: a BatchEngine over the engine's target (--max-num-seqs > 1): requests decode together."""
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.model_name = config.model_name
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-engine")
        self.jobs: set[Job] = set()
        self.running = 0
        self.lock = threading.Lock()
        self.metrics = Metrics(engine.window)
        self.created = int(time.time())
        self.draining = False  # SIGTERM: no new requests
        self.cutting = False  # the shutdown deadline passed: in-flight work is stopped
        self.batch_worker = None
        if batch is not None:
            from .batch_worker import BatchWorker

            self.batch_worker = BatchWorker(batch, self)

    # -- admission
    def admit(self, job: Job) -> None:
        with self.lock:
            if self.draining:
                raise APIError(503, "the server is shutting down", kind="server_error")
            if len(self.jobs) >= self.config.max_queue:
                raise APIError(429, f"the server is busy: {len(self.jobs)} requests in flight (--max-queue "
                                    f"{self.config.max_queue}); retry later", headers={"Retry-After": "1"},
                               kind="rate_limit_error")
            self.jobs.add(job)
            self._gauges()

    def release(self, job: Job) -> None:
        with self.lock:
            self.jobs.discard(job)
            self._gauges()

    def set_running(self, n: int) -> None:
        with self.lock:
            self.running = n
            self._gauges()

    def _gauges(self) -> None:
        self.metrics.running.set(self.running)
        self.metrics.waiting.set(len(self.jobs) - self.running)

    def cut_all(self) -> None:
        """The shutdown deadline: every admitted request stops within a round and says why."""
        with self.lock:
            self.cutting = True
            for job in self.jobs:
                job.cut = True
                job.cancel.set()

    # -- request -> job
    def check_request(self, req, max_tokens: int | None) -> SamplingParams:
        """Everything of a request but its prompt, before the prompt is tokenized: its sampling parameters."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", kind="not_found_error")
        if req.n != 1:
            raise APIError(400, "n must be 1 (several choices per request are not supported)", param="n")
        if req.logprobs or getattr(req, "top_logprobs", None):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        if max_tokens is not None and max_tokens >= self.engine.max_len:
            raise APIError(400, f"this model's context is {self.engine.max_len} tokens; max_tokens asks for "
                                f"{max_tokens}", param="max_tokens")
        if any(not s for s in ([req.stop] if isinstance(req.stop, str) else req.stop or [])):
            raise APIError(400, "stop strings must not be empty", param="stop")
        vocab = self.engine.target.cfg.vocab_size
        bad = [i for i in req.stop_token_ids or [] if not 0 <= i < vocab]
        if bad:
            raise APIError(400, f"stop token id {bad[0]} outside the vocabulary 0..{vocab - 1}", param="stop_token_ids")

        def pick(key: str):
            """The request's value, else the server's default, else OpenAI's."""
            for value in (getattr(req, key), self.config.defaults.get(key)):
                if value is not None:
                    return value
            return OPENAI_DEFAULTS[key]

        try:
            params = SamplingParams(pick("temperature"), pick("top_k"), pick("top_p"), pick("seed"))
            self.engine.config.check_sampling(params)
        except SettingError as e:
            raise APIError(400, e.named(self.config.setting_names), param=e.param) from None
        except StrataError as e:
            raise APIError(400, str(e), param=e.param) from None
        return params

    def prompt_limit(self, max_tokens: int | None) -> int:
        """The most tokens a prompt may have: the context less the tokens asked for (one at least)."""
        return self.engine.max_len - max(max_tokens or 1, 1)

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """A prompt's ids against the vocabulary and the context: the tokens left after it."""
        try:
            self.engine.check_prompt(prompt_ids)
        except StrataError as e:
            raise APIError(400, str(e), param="prompt") from None
        room = self.engine.max_len - len(prompt_ids)
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"this model's context is {self.engine.max_len} tokens; the prompt has "
                                f"{len(prompt_ids)} and max_tokens asks for {max_tokens} more", param="max_tokens")
        return room

    def build_job(self, req, params: SamplingParams, prompt_ids: list[int], loop, max_tokens: int,
                  echo: str = "") -> Job:
        """The job of a request whose prompt check_prompt passed, generating up to max_tokens tokens."""
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = self.config.stop_ids | set(req.stop_token_ids or [])
        return Job(prompt_ids, max_tokens, params, stop_ids, stops, self.tokenizer, loop, echo)

    def run(self, job: Job) -> Job:
        with self.lock:
            self.running += 1
            self._gauges()
        try:
            if job.cancel.is_set():  # gone (or cut) while it waited
                job.result = GenerationResult(job.prompt_ids, finish_reason="abort")
            else:
                job.result = self.engine.generate(job.prompt_ids, job.max_tokens, job.stop_ids, job.params,
                                                  on_tokens=job.on_tokens, should_stop=job.cancel.is_set)
            self.metrics.record_generation(job.result, job.finish_reason)
        finally:
            with self.lock:
                self.running -= 1
                self._gauges()
            job.finish()
        return job

    def submit(self, job: Job) -> asyncio.Future:
        self.admit(job)
        inner = self.batch_worker.submit(job) if self.batch_worker else self.worker.submit(self.run, job)
        fut = asyncio.wrap_future(inner)
        fut.add_done_callback(lambda _: self.release(job))
        return fut

    def usage(self, job: Job) -> tuple[dict, dict]:
        res = job.result
        acc = res.acceptance
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": res.new_tokens,
                "total_tokens": len(job.prompt_ids) + res.new_tokens}, {
            "drafter": res.drafter, "window": res.window, "tau": acc.tau, "rounds": acc.rounds,
            "acceptance_rate": acc.acceptance_rate, "per_position_acceptance": acc.per_position}


async def failed_as_api_error(fut: asyncio.Future) -> None:
    """A generation's end; one the model stopped with a StrataError (non-finite logits) becomes a 500 that
    says why."""
    try:
        await fut
    except StrataError as e:
        raise APIError(500, str(e), kind="server_error") from None


def off_loop(fn, *args):
    """CPU work (JSON parsing, validation, tokenizing) on a helper thread, so the event loop keeps serving."""
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


class ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped, so that any string a client sent can be echoed back (a
    lone surrogate is valid JSON but cannot be encoded as UTF-8)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="Strata", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=ASCIIJSONResponse)
    app.state.server = server
    cfg = server.config
    app.add_middleware(Guard, metrics=server.metrics, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       loopback=cfg.loopback)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return ASCIIJSONResponse(error_body(exc.message, exc.kind, exc.param, exc.status), status_code=exc.status,
                                 headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return ASCIIJSONResponse(error_body(str(exc.detail), "not_found_error" if exc.status_code == 404 else
                                            "invalid_request_error", None, exc.status_code),
                                 status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        log.error("internal error: %s: %s", type(exc).__name__, exc)
        return ASCIIJSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None, 500),
                                 status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "draining" if server.draining else "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(server.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "strata", "max_model_len": server.engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await off_loop(decode_request, await read_body(request, cfg.max_body_bytes, cfg.timeout),
                             CompletionRequest)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one prompt", param="prompt")
            prompt = prompt[0]
        params = server.check_request(req, req.max_tokens)
        if isinstance(prompt, str):
            ids = await off_loop(encode, server.tokenizer, prompt, "prompt", server.prompt_limit(req.max_tokens),
                                 server.engine.max_len)
        else:
            ids = list(prompt)
        room = server.check_prompt(ids, req.max_tokens)  # before decoding an echo
        echo = ""
        if req.echo and isinstance(prompt, str):
            echo = prompt
        elif req.echo and server.tokenizer is not None:
            echo = await off_loop(server.tokenizer.decode, ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else min(16, room)
        job = server.build_job(req, params, ids, asyncio.get_running_loop(), max_tokens, echo)
        return await respond(request, req, job, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await off_loop(decode_request, await read_body(request, cfg.max_body_bytes, cfg.timeout), ChatRequest)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if req.tools and req.tool_choice != "none":  # as vLLM without a tool-call parser
            raise APIError(400, "tools are not supported: this server does not parse tool calls (send no tools, or "
                                "tool_choice 'none')", param="tools")
        if server.tokenizer is None or not server.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = server.check_request(req, max_tokens)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = await off_loop(encode_chat, server.tokenizer, messages, server.prompt_limit(max_tokens),
                             server.engine.max_len)
        room = server.check_prompt(ids, max_tokens)
        job = server.build_job(req, params, ids, asyncio.get_running_loop(), max_tokens or room)
        return await respond(request, req, job, chat=True)

    async def respond(request: Request, req, job: Job, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        t0 = time.perf_counter()
        cut_message = "the server shut down before this request finished"
        if not req.stream:
            fut = server.submit(job)
            gone = False
            while not fut.done():  # a client that goes away stops its generation within a round
                await asyncio.wait({fut}, timeout=0.05)
                if not fut.done() and await request.is_disconnected():
                    gone = True
                    job.cancel.set()
            await failed_as_api_error(fut)
            if gone:  # nobody to answer: counted as nginx's "client closed request"
                return Response(status_code=499)
            if job.cut:
                raise APIError(503, cut_message, kind="server_error")
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
                await failed_as_api_error(fut)
                if job.cut:
                    yield f"data: {json.dumps(error_body(cut_message, 'server_error', None, 503))}\n\n"
                else:
                    server.metrics.latency.observe(time.perf_counter() - t0)
                    usage, extra = server.usage(job)
                    yield chunk(None, job.finish_reason, usage, extra)
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                raise
            except APIError as e:  # the model failed this request (NaN logits): said, not a crash
                log.error("generation failed: %s", e.message)
                yield f"data: {json.dumps(error_body(e.message, e.kind, None, e.status))}\n\n"
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - a failed stream ends with an error event, not a crash
                log.error("stream failed: %s: %s", type(e).__name__, e)
                yield f"data: {json.dumps(error_body(f'internal error: {type(e).__name__}', 'server_error'))}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()  # a client that went away stops its generation within one round

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
