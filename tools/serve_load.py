"""A bounded load on `strata serve` (the demo pair): 16 clients x 5 requests, streaming and not, three
streams and two non-streaming clients vanishing mid-request. Prints latency percentiles and throughput,
checks every delivered output against the server's own answer to the same request alone, and reads
the server's counters for the vanished work.

usage: python tools/serve_load.py [--out bench/results/serve-load-cpu.json] [--max-tokens 48]"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

PROMPTS = ["def quicksort(arr):", "import os\n\ndef walk(root):\n", "class Node:\n    def __init__(self",
           "for i in range(10):\n", "def add(a, b):\n    return", "x = [", "# utilities\n", "try:\n    import"]


def metric(url: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        n = args.max_tokens
        body = lambda p, stream: {"prompt": p, "max_tokens": n, "temperature": 0, "stream": stream}  # noqa: E731
        expected = {p: httpx.post(url + "/v1/completions", json=body(p, False), timeout=120).json()["choices"][0]["text"]
                    for p in PROMPTS}
        tokens_before = metric(url, "strata:generation_tokens_total")
        aborts_before = metric(url, "strata:request_success_total", '{finish_reason="abort"}')
        latencies, wrong, failures = [], [], []

        def client(k: int) -> None:
            for j in range(5):
                p = PROMPTS[(k + j) % len(PROMPTS)]
                t0 = time.perf_counter()
                try:
                    if k < 3 and j == 2:  # walks away mid-stream
                        with httpx.stream("POST", url + "/v1/completions", json=body(p, True) | {"max_tokens": 1500},
                                          timeout=120) as r:
                            for i, _ in enumerate(r.iter_lines()):
                                if i > 2:
                                    break
                        continue
                    if k in (3, 4) and j == 2:  # gives up waiting
                        try:
                            httpx.post(url + "/v1/completions", json=body(p, False) | {"max_tokens": 1500}, timeout=0.5)
                        except httpx.TimeoutException:
                            continue
                    if (k + j) % 2:
                        text = httpx.post(url + "/v1/completions", json=body(p, False),
                                          timeout=120).json()["choices"][0]["text"]
                    else:
                        with httpx.stream("POST", url + "/v1/completions", json=body(p, True), timeout=120) as r:
                            text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in r.iter_lines()
                                           if ln.startswith("data: {"))
                    latencies.append(time.perf_counter() - t0)
                    if text != expected[p]:
                        wrong.append(p)
                except Exception as e:  # noqa: BLE001
                    failures.append(repr(e))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(client, range(16)))
        wall = time.perf_counter() - t0
        while metric(url, "strata:num_requests_running") or metric(url, "strata:num_requests_waiting"):
            time.sleep(0.05)
        generated = metric(url, "strata:generation_tokens_total") - tokens_before
        delivered = n * len(latencies)
        q = statistics.quantiles(latencies, n=20)
        result = {
            "what": "tools/serve_load.py: strata serve (demo pair, CPU), 16 clients x 5 requests, 3 streams and 2 "
                    "non-streaming clients vanishing mid-request",
            "max_tokens": n, "requests_completed": len(latencies), "lost_or_failed": len(failures),
            "different_outputs": len(wrong), "wall_s": round(wall, 2),
            "latency_p50_s": round(statistics.median(latencies), 3), "latency_p95_s": round(q[18], 3),
            "delivered_tok_s": round(delivered / wall, 1),
            "vanished_requests_aborted": metric(url, "strata:request_success_total", '{finish_reason="abort"}')
            - aborts_before,
            "tokens_generated_for_vanished_requests": generated - delivered,
        }
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
