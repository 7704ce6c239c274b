"""`strata serve` on a real socket, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import run_cli

PROMPTS = ["def quicksort(arr):", "import os\n\ndef walk(root):\n", "class Node:\n    def __init__(self",
           "for i in range(10):\n", "def add(a, b):\n    return", "x = [", "# utilities\n", "try:\n    import"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    def __init__(self, tmp_path, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--port", str(self.port), *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT)
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
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

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
    out = live.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                         stop=[cut])
    assert out.choices[0].text == text[: text.index(cut)] and out.choices[0].finish_reason == "stop"
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
    assert len(completed) == 16 * 5 - 3
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
    assert 12 * len(completed) <= tokens <= 12 * len(completed) + 3 * 400
    assert live.metric("strata:requests_total", '{endpoint="/v1/completions",status="200"}') - ok_before == 80


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


def test_sigterm_lets_the_stream_finish(tmp_path):
    server = Live(tmp_path)
    lines = []

    def read():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                lines.append(line)

    t = threading.Thread(target=read)
    t.start()
    while len(lines) < 3:
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    t.join(timeout=120)
    assert server.proc.wait(timeout=60) == 0
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    final = json.loads([l for l in lines if l.startswith("data: {")][-1][6:])
    assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 300
    server.log.close()
