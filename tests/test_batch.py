"""Continuous batching (engine/batch.py): each request's tokens the same alone or beside others, greedy and
sampled, with requests joining mid-batch."""

from __future__ import annotations

import pytest

from strata.engine.batch import BatchEngine, Sequence
from strata.engine.decode import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import SettingError
from strata.models.loader import load_target

PROMPTS = [[3, 4, 5, 6, 7], [9, 8], [100, 101, 102], [7, 7, 7, 7, 7, 7, 7], [1], [50, 60, 70, 80]]


def requests(sampled: bool) -> list[Sequence]:
    return [Sequence(list(p), 6 + 3 * i, SamplingParams(0.9, 0, 1.0, 10 + i) if sampled and i % 2 else
                     SamplingParams()) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_requests_decode_as_alone(qwen3_dir, sampled):
    """Six requests through four slots (two wait, then join as others finish) give each the tokens it gets alone
    in the same engine; greedy ones also equal the single-sequence engine's."""
    target = load_target(qwen3_dir)
    alone = [BatchEngine(target, 4, 64).run([seq])[0].output_ids for seq in requests(sampled)]
    together = [seq.output_ids for seq in BatchEngine(target, 4, 64).run(requests(sampled))]
    assert together == alone
    for seq, out in zip(requests(sampled), together):
        assert len(out) == seq.max_new_tokens
        if seq.params.greedy:
            assert out == Engine(target, max_len=64).generate(seq.prompt_ids, seq.max_new_tokens).output_ids


def test_batching_refuses_what_it_does_not_run(tmp_path):
    """Batching runs target-only decoding of dense attention-only targets so far: a drafter, a hybrid or MoE
    target, and more sequences than the device can hold the KV cache of are refused, by serve before anything
    loads (one line with the numbers, exit code 2)."""
    from conftest import run_cli, write_hf_model

    folder, _ = write_hf_model(tmp_path / "h", "qwen3_5", seed=1, layers=4)
    with pytest.raises(SettingError, match="runs dense attention-only targets so far; the target is a qwen3_5 model"):
        BatchEngine(load_target(folder), 4, 64)
    for args, needle in ((("--model", folder), "runs dense attention-only targets so far"),
                         ((), "runs target-only so far; add --no-dflash"),
                         (("--no-dflash", "--max-num-seqs", "100000"), "x --max-model-len 2048: their KV cache needs")):
        r = run_cli("serve", "--max-num-seqs", "4", *args)
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_server_batches_eight_clients_each_as_alone(tmp_path):
    """`strata serve --max-num-seqs 4` with the openai client: eight concurrent requests (greedy and seeded
    sampled, four waiting for a slot) each get the text they get alone; a streaming client that goes away mid-batch
    leaves the others intact; /metrics counts the steps' batch sizes."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import PROMPTS, Live

    server = Live(tmp_path, "--no-dflash", "--max-num-seqs", "4")
    try:
        def ask(i):
            sampled = dict(temperature=0.8, seed=100 + i) if i % 2 else dict(temperature=0)
            return server.client.completions.create(model="strata-demo", prompt=PROMPTS[i], max_tokens=12 + i,
                                                    **sampled).choices[0].text

        alone = [ask(i) for i in range(8)]
        gone = server.client.completions.create(model="strata-demo", prompt=PROMPTS[0], max_tokens=200, stream=True)
        next(iter(gone))
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(ask, range(8)))
            gone.close()
        assert together == alone
        assert server.metric("strata:batch_size_sum") > server.metric("strata:batch_size_count") > 0
    finally:
        server.stop()
    assert server.proc.returncode == 0 and "Traceback" not in server.text_log()
