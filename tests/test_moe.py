"""Qwen3-MoE targets: token for token against transformers' own Qwen3MoeForCausalLM on tiny random
checkpoints it writes, eager and in static shapes; DFlash and prompt lookup identical to target-only; the
llama.cpp layout (stacked 3-D experts) decoding like the folder it came from."""

from __future__ import annotations

import re

import pytest
import torch
from gguf import GGMLQuantizationType as T

from strata.dflash.drafter import load_drafter
from strata.engine.decode import Engine
from strata.engine.prompt_lookup import PromptLookupDrafter
from strata.errors import StrataError
from strata.models.loader import load_target

from conftest import write_hf_drafter, write_hf_model
from test_gguf_target import dequantized_folder, qwen2_tokenizer, write_gguf_target

PROMPTS = [[3, 99, 14, 250, 8, 8, 41], [17], [5, 6, 7, 5, 6, 7, 5, 6]]
SHAPES = {  # renormalised top-k, one dense layer / plain top-k, every second layer sparse
    "a": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
              mlp_only_layers=[1]),
    "b": dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False,
              decoder_sparse_step=2),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return {name: write_hf_model(d / name, "qwen3_moe", seed=3 + i, **kw) for i, (name, kw) in enumerate(SHAPES.items())}


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_equals_transformers_eager_and_static(checkpoints, name):
    path, hf = checkpoints[name]
    target = load_target(path)
    sparse = [n for n, layer in enumerate(target.layers) if hasattr(layer.mlp, "gate")]
    assert sparse == ([0, 2] if name == "a" else [1])
    for prompt in PROMPTS:
        want = hf_greedy(hf, prompt, 40)
        assert Engine(target, max_len=128).generate(prompt, 40).output_ids == want, prompt
        assert Engine(target, max_len=128, backend="static").generate(prompt, 40).output_ids == want, prompt


def test_dflash_and_prompt_lookup_equal_target_only(checkpoints, tmp_path):
    path, _ = checkpoints["a"]
    target = load_target(path)
    drafter_dir = write_hf_drafter(tmp_path / "drafter", layers=2, taps=(0, 2), block_size=8, seed=4, scale=0.2)
    for static in (False, True):
        for prompt in PROMPTS:
            base = Engine(target, max_len=128, backend="static" if static else "eager", pad_rows=8).generate(prompt, 48)
            for drafter in (load_drafter(drafter_dir, target, max_len=128), PromptLookupDrafter(3)):
                res = Engine(target, drafter, max_len=128, backend="static" if static else "eager", window=8).generate(prompt, 48)
                assert res.output_ids == base.output_ids, (static, drafter.name, prompt)
    tree = Engine(target, load_drafter(drafter_dir, target, max_len=128), max_len=128, tree=16).generate(PROMPTS[0], 48)
    assert tree.output_ids == Engine(target, max_len=128).generate(PROMPTS[0], 48).output_ids


@pytest.mark.parametrize("matrix_type", [T.F32, T.Q8_0])
def test_llama_cpp_layout_decodes_like_its_folder(tmp_path, matrix_type):
    """llama.cpp's qwen3moe file (router F32, experts stacked as 3-D tensors) against the same values as
    a Hugging Face folder; every layer sparse, as llama.cpp's qwen3moe graph has them."""
    hf, _ = write_hf_model(tmp_path / "hf", "qwen3_moe", seed=7, vocab=320, hidden_size=256, intermediate_size=256,
                           head_dim=64, layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                           norm_topk_prob=True)
    qwen2_tokenizer(hf, 320)
    stored = write_gguf_target(tmp_path / "t.gguf", hf, "qwen3moe", matrix_type)
    folder = dequantized_folder(tmp_path / "deq", hf, stored)
    gguf_target, ref = load_target(tmp_path / "t.gguf"), load_target(folder)
    assert gguf_target.cfg.moe == ref.cfg.moe
    placed = []
    if matrix_type == T.F32:  # every expert in host memory, then one on the device
        from strata.pair import PairSpec, load_pair

        placed = [load_pair(PairSpec(model=str(tmp_path / "t.gguf"), expert_cache=mib), drafter=False).target
                  for mib in (0, 1)]
        assert [t.host_experts for t in placed] == [8, 7]
        import json

        cfg = json.loads((hf / "config.json").read_text())  # llama.cpp's key for top-k beyond its expert count
        (hf / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 5}))
        write_gguf_target(tmp_path / "bad.gguf", hf, "qwen3moe", matrix_type)
        with pytest.raises(StrataError, match="'qwen3moe.expert_used_count' 5 exceeds qwen3moe.expert_count 4"):
            load_target(tmp_path / "bad.gguf")
    for prompt in PROMPTS[:2]:
        want = Engine(ref, max_len=128).generate(prompt, 32).output_ids
        for target in [gguf_target, *placed]:
            assert Engine(target, max_len=128).generate(prompt, 32).output_ids == want


def test_bad_moe_configs_are_one_line_errors(checkpoints, tmp_path):
    import json
    import shutil

    path, _ = checkpoints["b"]
    for field, value, needle in (("num_experts_per_tok", 7, "exceeds num_experts 6"),
                                 ("moe_intermediate_size", None, "missing field 'moe_intermediate_size'"),
                                 ("decoder_sparse_step", 0, "'decoder_sparse_step' must be a positive integer"),
                                 ("mlp_only_layers", "1", "'mlp_only_layers' must be a list of layer indices"),
                                 ("norm_topk_prob", "yes", "'norm_topk_prob' must be true or false")):
        bad = tmp_path / field
        shutil.copytree(path, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg[field] = value
        if value is None:
            del cfg[field]
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(StrataError, match=needle):
            load_target(bad)


def test_bench_moe_shape_counts_the_experts_a_token_reads(tmp_path):
    from conftest import bench_tiny_shape
    from strata.bench.run import bytes_per_token
    from strata.models.random_init import random_target

    for dense in ([], [1]):  # a dense layer among sparse ones reads its whole MLP
        target = random_target("tiny-moe", mlp_only_layers=dense)
        moe, cfg = target.cfg.moe, target.cfg
        experts = sum(p.numel() * 4 for n in moe.layers for p in (target.layers[n].mlp.gate_up_proj,
                                                                  target.layers[n].mlp.down_proj))
        table = cfg.vocab_size * cfg.hidden_size * 4
        total = sum(p.numel() * 4 for p in target.parameters())
        kv = 2 * cfg.num_layers * 10 * cfg.num_kv_heads * cfg.head_dim * 4
        assert moe.layers == [n for n in range(cfg.num_layers) if n not in dense]
        assert bytes_per_token(target, 10) == \
            total - experts * (1 - moe.top_k / moe.experts) - table + table // cfg.vocab_size + kv
    result = bench_tiny_shape(tmp_path, "tiny-moe")
    assert result["hf"]["eager"]["identical_to_strata"] and result["dflash_oracle"]["identical_to_target_only"]
    from strata.bench.run import hf_generate
    from strata.models.placement import place_experts

    place_experts(target, "cpu", 0, 64)  # transformers' model would lack the experts in host memory
    assert "experts in host memory" in hf_generate(target, [1, 2], 2, ["eager"], 1)["skipped"]


def test_expert_cache_never_changes_the_output(tmp_path, capsys):
    """Every budget the CPU can exercise (none, part, all of the experts on the device) decodes exactly as
    transformers does, eager and static, with and without a drafter; generate reports the placement."""
    from strata.cli import main
    from strata.pair import PairSpec, load_pair

    path, hf = write_hf_model(tmp_path / "big", "qwen3_moe", seed=5, hidden_size=128, intermediate_size=256,
                              layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1024,
                              norm_topk_prob=True)  # experts of 1.5 MiB: 8 in all
    drafter_dir = write_hf_drafter(tmp_path / "drafter", hidden=128, layers=1, taps=(0, 1), block_size=8, seed=4,
                                   num_target_layers=2,
                                   scale=0.2)
    want = {tuple(p): hf_greedy(hf, p, 24) for p in PROMPTS[:2]}
    logits = Engine(load_target(path), max_len=64).runner.prefill(PROMPTS[0]).logits
    for mib, resident in ((0, [0, 0]), (3, [1, 1]), (5, [2, 1]), (12, [4, 4]), (None, [4, 4])):
        pair = load_pair(PairSpec(model=str(path), dflash=str(drafter_dir), expert_cache=mib))
        target = pair.target
        assert target.expert_plan.resident == resident and target.host_experts == 8 - sum(resident)
        assert torch.equal(Engine(target, max_len=64).runner.prefill(PROMPTS[0]).logits, logits)  # bit for bit
        for prompt, ids in want.items():
            for static in (False, True):
                assert Engine(target, max_len=64, backend="static" if static else "eager").generate(list(prompt), 24).output_ids == ids
            assert Engine(target, pair.drafter, max_len=64, window=8).generate(list(prompt), 24).output_ids == ids
    assert main(["generate", "--model", str(path), "--expert-cache", "3", "--prompt-ids", "3,99,14", "--max-new-tokens", "8",
                 "--ids"]) == 0
    out, err = capsys.readouterr()
    assert "2 sparse layers x 4 experts x 1.50 MiB" in err and "on the device (cpu): 2 (25%" in err
    assert "in host memory, run by the CPU" in err and "(25%, 3.0 MiB)" in err and ": 6 (9.0 MiB)" in err
    assert main(["generate", "--model", str(path), "--expert-cache", "-1", "--prompt-ids", "3", "--ids"]) == 2
    assert "--expert-cache must be >= 0 MiB, got -1" in capsys.readouterr().err


def test_placement_by_prefill_routing(tmp_path, capsys):
    """--expert-placement prefill: the first prefill's routing decides which experts each layer keeps on the
    device (the most chosen; ties: those already there, then lower ids), every expert's matrices move with
    it (rebuilt from device and host stacks they equal the checkpoint's), later prefills move nothing, and
    the tokens stay transformers', eager and static, with DFlash too."""
    from strata.cli import main
    from strata.pair import PairSpec, load_pair
    from strata.models.placement import sparse_layers

    path, hf = write_hf_model(tmp_path / "big", "qwen3_moe", seed=5, hidden_size=128, intermediate_size=256,
                              layers=2, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=1024,
                              norm_topk_prob=True)
    drafter_dir = write_hf_drafter(tmp_path / "drafter", hidden=128, layers=1, taps=(0, 1), block_size=8, seed=4,
                                   num_target_layers=2, scale=0.2)
    full = [(moe.gate_up_proj.detach().clone(), moe.down_proj.detach().clone())
            for moe in sparse_layers(load_target(path))]
    prompt = [3, 99, 14, 250, 8, 8, 41, 17, 5, 6, 7, 5, 6, 7, 5]
    pair = load_pair(PairSpec(model=str(path), dflash=str(drafter_dir), expert_cache=3, expert_placement="prefill"))
    target, plan = pair.target, pair.target.expert_plan
    assert plan.resident == [1, 1] and plan.moved is None
    Engine(target, max_len=64).runner.prefill(prompt)
    counts = [moe.counts.clone() for moe in sparse_layers(target)]
    assert [int(c.sum()) for c in counts] == [len(prompt)] * 2
    kept = [[e for e in range(4) if moe.slot[e] >= 0] for moe in sparse_layers(target)]
    assert kept == [[max(range(4), key=lambda e: (int(c[e]), e == 0, -e))] for c in counts]
    assert plan.moved == sum(k != [0] for k in kept) > 0
    for moe, (gate_up, down) in zip(sparse_layers(target), full):
        for e, s in enumerate(moe.slot):
            src_gate_up, src_down, i = (moe.gate_up_proj, moe.down_proj, s) if s >= 0 else \
                (moe.host_gate_up, moe.host_down, -1 - s)
            assert src_gate_up[:, i].equal(gate_up[:, e]) and src_down[i].equal(down[e])
        assert moe.stand_in.tolist() == [max(s, 0) for s in moe.slot]
    Engine(target, max_len=64).runner.prefill(prompt[::-1])
    assert [[e for e in range(4) if moe.slot[e] >= 0] for moe in sparse_layers(target)] == kept
    assert all(moe.counts.equal(c) for moe, c in zip(sparse_layers(target), counts))  # counted once, then not
    want = hf_greedy(hf, prompt, 24)
    for static in (False, True):
        assert Engine(target, max_len=64, backend="static" if static else "eager").generate(prompt, 24).output_ids == want
        assert Engine(target, pair.drafter, max_len=64, backend="static" if static else "eager", window=8).generate(prompt, 24).output_ids == want
    assert main(["generate", "--model", str(path), "--expert-cache", "3", "--expert-placement", "prefill",
                 "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "4", "--ids"]) == 0
    err = capsys.readouterr().err
    assert "which: those each layer's rows choose most in the first prompt's prefill" in err
    assert re.search(r"experts: the prompt's prefill moved \d+ onto the device", err)
    with pytest.raises(StrataError, match="--expert-placement must be one of static, prefill, got 'often'"):
        PairSpec(model=str(path), expert_placement="often")
    assert main(["generate", "--model", str(path), "--expert-placement", "often", "--prompt-ids", "1"]) == 2
    assert capsys.readouterr().err.strip().endswith("--expert-placement must be one of static, prefill, got 'often'")


def test_a_step_with_host_work_is_captured_in_segments(monkeypatch):
    """CudaGraphs' bookkeeping, the GPU's capture replaced by fakes that record: a step handing two pieces of
    host work to graph_breaks runs them at once in its warm-up, is captured as three graphs in one pool with
    none of the host work run meanwhile, and each replay runs graph, work, graph, work, graph in order, its
    host work in inference mode whoever replays it."""
    import contextlib

    from strata.engine.runner import CudaGraphs
    from strata.layers import graph_breaks

    log = []

    class Graph:
        made = 0

        def __init__(self):
            Graph.made += 1
            self.id = Graph.made

        def capture_begin(self, pool=None):
            log.append(("begin", self.id, pool))

        def capture_end(self):
            log.append(("end", self.id))

        def replay(self):
            log.append(("replay", self.id))

    class Stream:
        def wait_stream(self, other):
            pass

    for name, value in (("CUDAGraph", Graph), ("graph_pool_handle", lambda: "pool"), ("Stream", Stream),
                        ("stream", lambda s: contextlib.nullcontext()), ("current_stream", Stream),
                        ("synchronize", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)

    def step():
        log.append("kernels")
        graph_breaks.on_host(lambda: log.append("host 1"))
        log.append("kernels")
        graph_breaks.on_host(lambda: log.append("host 2"))
        return "out"

    graphs = CudaGraphs("cuda")
    assert graphs.run("step", step) == "out"
    replay = [("replay", 1), "host 1", ("replay", 2), "host 2", ("replay", 3)]
    assert log == ["kernels", "host 1", "kernels", "host 2",  # the warm-up
                   ("begin", 1, "pool"), "kernels", ("end", 1), ("begin", 2, "pool"), "kernels", ("end", 2),
                   ("begin", 3, "pool"), ("end", 3), *replay]
    log.clear()
    assert graphs.run("step", step) == "out" and log == replay
    with torch.inference_mode():  # as the engine captures: host work writes into tensors made then
        made = torch.zeros(1)
    graphs.graphs["write"] = ([lambda: made.add_(1)], None)
    graphs.replay("write")  # from outside inference mode too (bench's --profile replays each step)
    assert made.item() == 1
