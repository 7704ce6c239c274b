"""`strata serve` on a real socket, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import run_cli

PROMPTS = ["def quicksort(arr):", "import os\n\ndef walk(root):\n", "class Node:\n    def __init__(self",
           "for i in range(10):\n", "def add(a, b):\n    return", "x = [", "# utilities\n", "try:\n    import"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    def __init__(self, tmp_path, *extra, api_key: str = "none", env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--port", str(self.port), *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env=None if env is None else {**os.environ, **env})
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
            assert self.proc.poll() is None, self.log_path.read_text()
        else:
            raise AssertionError("server did not start: " + self.log_path.read_text())
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.log.close()

    def text_log(self) -> str:
        return self.log_path.read_text()

    def metric(self, name: str, labels: str = "") -> float:
        body = httpx.get(self.url + "/metrics").text
        m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", body, re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = Live(tmp_path_factory.mktemp("serve"))
    yield server
    server.stop()
    assert server.proc.returncode == 0
    assert "Traceback" not in server.text_log() and " ERROR " not in server.text_log()


def generate_text(prompt, n, chat=False):
    r = run_cli("generate", prompt, "--max-new-tokens", str(n), *(["--chat"] if chat else []))
    assert r.returncode == 0, r.stderr
    return r.stdout[:-1]


def test_completions_equal_generate(live):
    expected = generate_text(PROMPTS[0], 24)
    out = live.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert out.choices[0].text == expected
    assert out.usage.completion_tokens == 24 and out.choices[0].finish_reason == "length"
    assert out.model_extra["strata"]["drafter"] == "dflash" and out.model_extra["strata"]["tau"] >= 1
    stream = live.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_equals_generate_chat(live):
    expected = generate_text("sort a list", 20, chat=True)
    msgs = [{"role": "user", "content": "sort a list"}]
    out = live.client.chat.completions.create(model="strata-demo", messages=msgs, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == expected and out.choices[0].message.role == "assistant"
    stream = live.client.chat.completions.create(model="strata-demo", messages=msgs, max_tokens=20, temperature=0,
                                                 stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_models_stop_and_seed(live):
    assert [m.id for m in live.client.models.list().data] == ["strata-demo"]
    full = live.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    text = full.choices[0].text
    cut = text[5:9]
    stops = live.metric("strata:request_success_total", '{finish_reason="stop"}')
    out = live.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                         stop=[cut])
    assert out.choices[0].text == text[: text.index(cut)] and out.choices[0].finish_reason == "stop"
    assert live.metric("strata:request_success_total", '{finish_reason="stop"}') == stops + 1  # counted as told
    a, b = (live.client.completions.create(model="strata-demo", prompt=PROMPTS[1], max_tokens=16, temperature=0.9,
                                           seed=5).choices[0].text for _ in range(2))
    assert a == b


BAD = [
    ("{not json", 400, "not valid JSON"),
    ('{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    ('{"prompt": ""}', 400, "empty prompt"),
    ('{"prompt": [' + ",".join(["5"] * 2100) + "]}", 400, "does not fit the context of 2048"),
    ('{"prompt": "x", "max_tokens": 0}', 400, "max_tokens must be >= 1"),
    ('{"prompt": "x", "model": "gpt-4"}', 404, "model 'gpt-4' does not exist"),
    ('{"prompt": "x", "n": 2}', 400, "n must be 1"),
    ('{"prompt": "x", "logprobs": 2}', 400, "logprobs are not supported"),
    ('{"prompt": "x", "temperature": -1}', 400, "temperature"),
    ('{"prompt": "x", "top_p": 0}', 400, "top_p"),
    ('[1, 2]', 400, "JSON object"),
    ('{"prompt": [99999]}', 400, "outside the vocabulary"),
    ('{"prompt": "x", "model": "\\ud800"}', 404, "model '\ud800' does not exist"),
    ('{"prompt": "x", "stop_token_ids": [7, 4096]}', 400, "stop token id 4096 outside the vocabulary 0..4095"),
]


@pytest.mark.parametrize("body,status,needle", BAD)
def test_bad_requests(live, body, status, needle):
    r = httpx.post(live.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and "param" in err
    assert httpx.get(live.url + "/health").status_code == 200


def test_bad_chat_requests(live):
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and "messages.0.content" in r.json()["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError, match="tools are not supported"):
        live.client.chat.completions.create(model="strata-demo", messages=[{"role": "user", "content": "hi"}],
                                            tools=tools)
    out = live.client.chat.completions.create(model="strata-demo", messages=[{"role": "user", "content": "hi"}],
                                              tools=tools, tool_choice="none", max_tokens=2)
    assert out.choices[0].message.tool_calls is None and out.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError):
        live.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(live.url + "/health").status_code == 200


def test_disconnect_stops_generation(live):
    aborted = live.metric("strata:request_success_total", '{finish_reason="abort"}')
    with httpx.stream("POST", live.url + "/v1/completions",
                      json={"prompt": PROMPTS[2], "max_tokens": 1500, "temperature": 0, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    t0 = time.time()
    while live.metric("strata:request_success_total", '{finish_reason="abort"}') == aborted:
        assert time.time() - t0 < 10, "the generation did not stop after the client left"
        time.sleep(0.05)
    assert live.metric("strata:num_requests_waiting") == 0


def test_load_16_clients(live):
    expected = {p: live.client.completions.create(model="strata-demo", prompt=p, max_tokens=12,
                                                  temperature=0).choices[0].text for p in PROMPTS}
    before = {n: live.metric(n) for n in ("strata:generation_tokens_total", "strata:spec_decode_num_drafts_total",
                                          "strata:spec_decode_num_draft_tokens_total",
                                          "strata:spec_decode_num_accepted_tokens_total")}
    ok_before = live.metric("strata:requests_total", '{endpoint="/v1/completions",status="200"}')
    aborted = live.metric("strata:request_success_total", '{finish_reason="abort"}')
    gone_before = live.metric("strata:requests_total", '{endpoint="/v1/completions",status="499"}')
    completed, failures = [], []

    def client(k):
        for j in range(5):
            p = PROMPTS[(k + j) % len(PROMPTS)]
            stream = (k + j) % 2 == 0
            try:
                if k < 3 and j == 2:  # three clients walk away mid-stream
                    with httpx.stream("POST", live.url + "/v1/completions", timeout=120,
                                      json={"prompt": p, "max_tokens": 400, "temperature": 0, "stream": True}) as r:
                        for i, _ in enumerate(r.iter_lines()):
                            if i > 2:
                                break
                    continue
                if k in (3, 4) and j == 2:  # two give up on a non-streaming request
                    try:
                        httpx.post(live.url + "/v1/completions", timeout=0.5,
                                   json={"prompt": p, "max_tokens": 400, "temperature": 0})
                    except httpx.TimeoutException:
                        continue
                    failures.append("a vanishing client got its answer within 0.5 s")
                    continue
                if stream:
                    chunks = list(live.client.completions.create(model="strata-demo", prompt=p, max_tokens=12,
                                                                 temperature=0, stream=True))
                    completed.append((p, "".join(c.choices[0].text for c in chunks), 12))
                else:
                    out = live.client.completions.create(model="strata-demo", prompt=p, max_tokens=12, temperature=0)
                    completed.append((p, out.choices[0].text, out.usage.completion_tokens))
            except Exception as e:  # noqa: BLE001
                failures.append(repr(e))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(client, range(16)))
    assert not failures, failures
    assert len(completed) == 16 * 5 - 5
    for p, text, _ in completed:
        assert text == expected[p]
    t0 = time.time()
    while live.metric("strata:num_requests_waiting") != 0:
        assert time.time() - t0 < 20
        time.sleep(0.05)
    after = {n: live.metric(n) for n in before}
    drafts = after["strata:spec_decode_num_drafts_total"] - before["strata:spec_decode_num_drafts_total"]
    draft_tokens = after["strata:spec_decode_num_draft_tokens_total"] - before["strata:spec_decode_num_draft_tokens_total"]
    assert draft_tokens == drafts * 7
    per_pos = sum(live.metric("strata:spec_decode_num_accepted_tokens_per_pos_total", f'{{position="{i}"}}')
                  for i in range(7))
    assert per_pos == live.metric("strata:spec_decode_num_accepted_tokens_total")
    tokens = after["strata:generation_tokens_total"] - before["strata:generation_tokens_total"]
    assert 12 * len(completed) <= tokens < 12 * len(completed) + 5 * 400  # the vanished work stopped early
    t0 = time.time()  # each vanished request ends as an abort (the waiting ones before they start)
    while live.metric("strata:request_success_total", '{finish_reason="abort"}') - aborted < 5:
        assert time.time() - t0 < 20
        time.sleep(0.05)
    assert live.metric("strata:request_success_total", '{finish_reason="abort"}') - aborted == 5
    assert live.metric("strata:requests_total", '{endpoint="/v1/completions",status="200"}') - ok_before == 78
    assert live.metric("strata:requests_total", '{endpoint="/v1/completions",status="499"}') - gone_before == 2


def test_full_queue_gets_429(tmp_path):
    server = Live(tmp_path, "--max-queue", "1")
    try:
        results = []

        def call(_):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 200,
                                                                 "temperature": 0}, timeout=120)
            results.append(r)

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(call, range(3)))
        codes = sorted(r.status_code for r in results)
        assert codes[0] == 200 and 429 in codes
        busy = next(r for r in results if r.status_code == 429)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


def test_shutdown_lets_in_flight_work_finish_then_cuts_the_rest_cleanly(tmp_path):
    """SIGTERM: a request that finishes within --shutdown-timeout completes; past the deadline the one
    running stops within a round and the one waiting never starts, each with an error (503 body; error
    event, then [DONE]); the process exits 0 with no traceback."""
    server = Live(tmp_path, "--shutdown-timeout", "3")
    lines, results = {"short": [], "cut": []}, {}

    def stream(name, tokens):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"prompt": PROMPTS[0], "max_tokens": tokens, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                lines[name].append(line)

    def plain():
        results["plain"] = httpx.post(server.url + "/v1/completions", timeout=120,
                                      json={"prompt": PROMPTS[1], "max_tokens": 1900, "temperature": 0})

    threads = [threading.Thread(target=stream, args=("short", 100))]
    threads[0].start()
    while len(lines["short"]) < 3:
        time.sleep(0.02)
    threads += [threading.Thread(target=stream, args=("cut", 1900)), threading.Thread(target=plain)]
    for t in threads[1:]:
        t.start()
    time.sleep(0.3)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    assert server.proc.wait(timeout=60) == 0
    server.log.close()
    short = [json.loads(ln[6:]) for ln in lines["short"] if ln.startswith("data: {")]
    assert lines["short"][-2:] == ["data: [DONE]", ""] or lines["short"][-1] == "data: [DONE]"
    assert short[-1]["choices"][0]["finish_reason"] == "length" and short[-1]["usage"]["completion_tokens"] == 100
    cut = [json.loads(ln[6:]) for ln in lines["cut"] if ln.startswith("data: {")]
    assert cut[-1]["error"]["code"] == 503 and "shut down" in cut[-1]["error"]["message"]
    assert "data: [DONE]" in lines["cut"]
    assert results["plain"].status_code == 503 and results["plain"].json()["error"]["type"] == "server_error"
    assert "Traceback" not in server.text_log()


# ------------------------------------------------------------------ hardening (a load test and a bad client's tricks)

def test_non_streaming_client_that_leaves_stops_its_generation(live):
    aborted = live.metric("strata:request_success_total", '{finish_reason="abort"}')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 1500, "temperature": 0},
                   timeout=1.5)
    t0 = time.time()
    while live.metric("strata:request_success_total", '{finish_reason="abort"}') == aborted:
        assert time.time() - t0 < 10, "the generation did not stop after the client left"
        time.sleep(0.05)
    assert live.metric("strata:num_requests_running") == 0 and live.metric("strata:num_requests_waiting") == 0


def test_running_and_waiting_are_counted_apart(live):
    done = []
    t = threading.Thread(target=lambda: done.append(httpx.post(
        live.url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 300, "temperature": 0}, timeout=60)))
    t.start()
    t0 = time.time()
    while live.metric("strata:num_requests_running") != 1:
        assert time.time() - t0 < 10 and not done
        time.sleep(0.02)
    assert live.metric("strata:num_requests_waiting") == 0
    t.join()
    assert done[0].status_code == 200


def test_accepted_counter_counts_delivered_tokens_only(live):
    names = ("strata:spec_decode_num_drafts_total", "strata:spec_decode_num_accepted_tokens_total")
    before = [live.metric(n) for n in names]
    out = live.client.completions.create(model="strata-demo", prompt=PROMPTS[4], max_tokens=5, temperature=0)
    drafts, accepted = (live.metric(n) - b for n, b in zip(names, before))
    # every round commits its accepted candidates and a bonus; tokens past max_tokens are not counted
    assert out.usage.completion_tokens - 1 <= drafts + accepted <= out.usage.completion_tokens
    assert out.model_extra["strata"]["tau"] * out.model_extra["strata"]["rounds"] == out.usage.completion_tokens - 1


def test_a_prompt_is_refused_by_its_length_before_it_is_tokenized_whole(live):
    """A 7.5 MB prompt for a 2048-token context: refused without tokenizing, at once, holding no memory."""
    def rss() -> int:
        status = open(f"/proc/{live.proc.pid}/status").read()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) << 10

    before = rss()
    for path, body in (("/v1/completions", {"prompt": "x = compute(y)\n" * 500_000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y = 2 * x\n" * 750_000}]})):
        t0 = time.time()
        r = httpx.post(live.url + path, json=body, timeout=120)
        assert r.status_code == 400 and "characters does not fit the context of 2048" in r.json()["error"]["message"]
        assert time.time() - t0 < 5, "a prompt the context cannot hold was tokenized"
    assert rss() - before < 200 << 20


def test_a_long_text_is_counted_in_pieces_and_refused_as_soon_as_it_passes(monkeypatch):
    from strata import demo
    from strata.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(demo.TARGET)
    text = (Path(__file__).parent / "test_serve.py").read_text()
    whole = tok.encode_prompt(text)
    assert tok.encode_within(text, len(whole), added=True, piece=2000) == whole  # what fits is encoded whole
    assert tok.encode_within(text, len(whole) - 1, added=True, piece=2000) is None
    encoded = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda t, *a, **k: encoded.append(len(t)) or real(t, *a, **k))
    assert tok.encode_within(text * 4, 500, piece=2000) is None  # within the character bound, over the limit
    assert sum(encoded) < 8000, "the pieces went on past the limit"


def test_bodies_are_capped(live):
    big = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
    r = httpx.post(live.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than 8388608 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the cap applies while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * (1 << 20)
        yield b'"}'

    r = httpx.post(live.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(live.url + "/health").status_code == 200


@pytest.mark.parametrize("body,param", [
    ('{"prompt": "bad \\ud800 text"}', "prompt"),
    ('{"prompt": "x", "seed": 1180591620717411303424, "temperature": 1}', "seed"),
    ('{"prompt": "x", "seed": 1180591620717411303424, "temperature": 1, "stream": true}', "seed"),
    ('{"prompt": "x", "max_tokens": true}', "max_tokens"),
    ('{"prompt": "x", "temperature": -1}', "temperature"),
    ('{"prompt": "x", "top_k": -2}', "top_k"),
    ('{"prompt": "x", "max_tokens": 5000}', "max_tokens"),
    ('{"prompt": "x", "temperature": true}', "temperature"),
])
def test_bad_values_are_400_with_their_param_and_counted(live, body, param):
    before = live.metric("strata:requests_total", '{endpoint="/v1/completions",status="400"}')
    r = httpx.post(live.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert live.metric("strata:requests_total", '{endpoint="/v1/completions",status="400"}') == before + 1


def test_deep_json_bad_messages_and_unknown_routes(live):
    deep = '{"prompt": ' + "[" * 10_000 + "]" * 10_000 + "}"
    r = httpx.post(live.url + "/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    for messages, needle in (([{"role": "banana", "content": "hi"}], "messages.0.role"),
                             ([{"role": "user", "content": "bad \ud800"}], "messages")):
        body = json.dumps({"messages": messages})
        r = httpx.post(live.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and needle in (r.json()["error"]["param"] or ""), r.text
    r = httpx.get(live.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(live.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    for i in range(100):
        httpx.get(live.url + f"/random/{i}/{time.time()}")
    body = httpx.get(live.url + "/metrics").text
    assert "/random/" not in body and 'endpoint="unmatched"' in body
    assert len([ln for ln in body.splitlines() if ln.startswith("strata:requests_total{")]) < 30


def test_no_request_body_gets_a_server_error(live):
    """Random request bodies, typed and untyped, to both endpoints: every answer is a 2xx or a 4xx with the
    JSON error body, never a 500."""
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(), st.text(max_size=12))
    value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                                            inner, max_size=3),
                         max_leaves=8)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "banana"]),
                                     "content": st.text(max_size=20) | value})
    fields = st.sampled_from(["prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                              "stop_token_ids", "n", "logprobs", "stream", "echo", "messages", "tools",
                              "max_completion_tokens", "top_logprobs", "tool_choice"])
    bodies = st.dictionaries(fields, value | st.lists(message, max_size=2) | st.lists(st.integers(-3, 5000),
                                                                                       max_size=4), max_size=6)

    @settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(bodies, st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def check(body, path):
        body = {**body, "max_tokens": 2, "max_completion_tokens": 2} if "max_tokens" not in body else body
        r = httpx.post(live.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                       timeout=120)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert r.json()["error"]["message"], (body, r.text)

    check()
    with socket.create_connection(("127.0.0.1", live.port)) as s:  # one h11 cannot parse
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 12x\r\n\r\n{}")
        s.settimeout(10)
        answer = b"".join(iter(lambda: s.recv(65536), b""))  # the server closes the connection after it
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert "malformed HTTP request" in json.loads(body)["error"]["message"]


def test_api_gaps(live):
    out = live.client.chat.completions.create(model="strata-demo", messages=[{"role": "user", "content": "sort"}],
                                              max_completion_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5
    parts = live.client.chat.completions.create(
        model="strata-demo", max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "so"}, {"type": "text", "text": "rt"}]}])
    plain = live.client.chat.completions.create(model="strata-demo", messages=[{"role": "user", "content": "sort"}],
                                                max_tokens=12, temperature=0)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    echo = live.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                          echo=True)
    plain = live.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert echo.choices[0].text == PROMPTS[0] + plain.choices[0].text
    streamed = live.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                              echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echo.choices[0].text


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server with a key (from the environment), short timeouts and greedy requests by default."""
    server = Live(tmp_path_factory.mktemp("guarded"), "--timeout", "1", "--temperature", "0",
                  "--max-body-bytes", "100000", api_key="sesame", env={"STRATA_API_KEY": "sesame"})
    yield server
    server.stop()
    assert "Traceback" not in server.text_log()


def test_api_key_content_type_and_host(guarded):
    url = guarded.url + "/v1/completions"
    body = {"prompt": "x", "max_tokens": 2}
    r = httpx.post(url, json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    key = {"Authorization": "Bearer sesame"}
    assert httpx.post(url, json=body, headers=key).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200
    r = httpx.post(url, content=json.dumps(body), headers={**key, "content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = httpx.post(url, json=body, headers={**key, "host": "attacker.example"})
    assert r.status_code == 403 and "Host header" in r.json()["error"]["message"]
    assert httpx.post(url, json=body, headers={**key, "host": f"localhost:{guarded.port}"}).status_code == 200
    out = guarded.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=12)
    assert out.choices[0].text == generate_text(PROMPTS[0], 12)  # --temperature 0: requests without one are greedy


def _closed_within(sock, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except OSError:
        return False


def test_slow_and_idle_connections_are_closed(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:  # headers that never finish
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert _closed_within(s, 5)
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:  # a body that never finishes
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sesame\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 408")
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:  # idle after a request
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within(s, 5)
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_a_tree_server_answers_greedy_and_refuses_sampling(tmp_path):
    server = Live(tmp_path, "--tree", "16")
    try:
        got = server.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=24)
        assert got.choices[0].text == generate_text(PROMPTS[0], 24)  # requests without temperature: greedy
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=4, temperature=0.8)
        assert e.value.body["param"] == "temperature" and "--tree" in e.value.body["message"]
    finally:
        server.stop()
    assert server.proc.returncode == 0 and "Traceback" not in server.text_log()
