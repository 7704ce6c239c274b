"""Tree verification: the device-side tree is the best-first search's, greedy output equals target-only
whatever the tree holds (acceptance down non-first branches forced), sampling is refused clearly."""

from __future__ import annotations

import heapq

import pytest
import torch

from strata.dflash.drafter import load_drafter
from strata.engine.decode import Engine
from strata.engine.drafter import Drafter, Proposal
from strata.engine.sampling import SamplingParams
from strata.engine.tree import DEPTH_PENALTY, TOP_K, build
from strata.errors import StrataError

from conftest import run_cli, small_pair


def best_first(logq: torch.Tensor, budget: int) -> set:
    """The paper's search, on the host: pop the best node, push its next sibling and its first child."""
    top = torch.topk(logq, TOP_K, dim=-1)
    depths = logq.shape[0]
    heap = [(-(top.values[0, 0].item() - DEPTH_PENALTY), 0, 0, ())]
    nodes = set()
    while heap and len(nodes) < budget:
        neg, d, r, path = heapq.heappop(heap)
        node = path + (r,)
        nodes.add(tuple(top.indices[i, node[i]].item() for i in range(len(node))))
        if r + 1 < TOP_K:
            heapq.heappush(heap, (neg + top.values[d, r].item() - top.values[d, r + 1].item(), d, r + 1, path))
        if d + 1 < depths:
            heapq.heappush(heap, (neg - top.values[d + 1, 0].item() + DEPTH_PENALTY, d + 1, 0, node))
    return nodes


def tree_paths(tree, budget: int) -> set:
    """Every node's path of tokens from the anchor, checking the tree's structure on the way."""
    assert tree.tokens[0] == 7 and tree.depth[0] == 0 and tree.parent[0] == 0 and tree.ancestors[0].sum() == 1
    paths = set()
    for i in range(1, budget + 1):
        path, r = [], i
        while r != 0:
            path.append(tree.tokens[r].item())
            r = tree.parent[r].item()
        assert len(path) == tree.depth[i].item() and tree.parent[i] < i  # parents come first
        assert {j for j in range(budget + 1) if tree.ancestors[i, j]} == \
            {i} | {j for j in range(budget + 1) if tree.ancestors[tree.parent[i], j]}
        paths.add(tuple(reversed(path)))
    return paths


@pytest.mark.parametrize("fused", [False, True])
def test_the_device_tree_is_the_best_first_search(fused):
    """torch's build, and the GPU's single Triton launch (here in the interpreter)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(40 if not fused else 15):
        depths, budget = 2 + trial % 6, [4, 9, 16, 33, 64][trial % 5]
        logits = torch.randn(depths, 60, generator=gen) * (0.5 + trial % 4)
        tree = build(torch.tensor([7]), logits, budget, fused=fused)
        assert tree_paths(tree, budget) == best_first(torch.log_softmax(logits, -1), budget), trial


class RankedOracle(Drafter):
    """Knows the continuation and scores it at a chosen rank at each depth: rank 0 is the chain's pick,
    so ranks above 0 can only be accepted by a tree. Keeps each round's truth and logits."""

    name = "ranked"
    gives_logits = True

    def __init__(self, sequence, window: int, ranks, vocab: int):
        self.sequence, self.max_window, self.ranks, self.vocab = list(sequence), window, ranks, vocab
        self.rounds = []

    def propose(self, req):
        logits = torch.zeros(req.n, self.vocab)
        truths = []
        for i in range(req.n):
            truth = (self.sequence[req.pos + 1 + i: req.pos + 2 + i] or [0])[0]
            rank = self.ranks[(len(self.rounds) + i) % len(self.ranks)]
            logits[i, truth] = 10.0
            for j in range(rank):  # `rank` wrong tokens above it
                logits[i, (truth + 1 + j) % self.vocab] = 10.0 + 0.5 * (rank - j)
            truths.append(truth)
        self.rounds.append((truths, logits))
        return Proposal(logits.argmax(-1), logits)


def expected_lengths(oracle: RankedOracle, budget: int) -> list[int]:
    """Tokens each round commits if the tree is the best-first search's: the truth's longest prefix in
    it, plus the target's own token."""
    lengths = []
    for truths, logits in oracle.rounds:
        nodes = best_first(torch.log_softmax(logits, -1), budget)
        depth = 0
        while depth < len(truths) and tuple(truths[:depth + 1]) in nodes:
            depth += 1
        lengths.append(depth + 1)
    return lengths


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir, target = small_pair(tmp_path_factory.mktemp("tree"))
    prompt = [3, 99, 14, 250, 8, 8, 41]
    base = Engine(target, max_len=256).generate(prompt, 48).output_ids
    return target_dir, drafter_dir, target, prompt, base


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_greedy_identity_with_a_real_drafter_in_both_layouts(pair, budget):
    _, drafter_dir, target, prompt, base = pair
    for static in (False, True):
        res = Engine(target, load_drafter(drafter_dir, target, max_len=256), max_len=256, tree=budget,
                     backend="static" if static else "eager").generate(prompt, 48)
        assert res.output_ids == base, (budget, static)
        assert res.stats()["nodes_verified"] == res.stats()["rounds"] * (budget + 1)


@pytest.mark.parametrize("ranks,budget,static", [([1, 0, 2], 48, False), ([2], 64, True), ([1], 16, "fused")])
def test_acceptance_down_non_first_branches(pair, ranks, budget, static, monkeypatch):
    """static="fused": static steps with the GPU's one-launch build (in the interpreter)."""
    _, _, target, prompt, base = pair
    built = []
    if static == "fused":
        from strata.engine import runner, tree as tree_module
        from strata.layers.kernels import Kernels

        monkeypatch.setattr(runner, "TritonKernels", Kernels)  # the CPU's static kernel set takes it
        fused = tree_module._build_fused
        monkeypatch.setattr(tree_module, "_build_fused", lambda *a: built.append(1) or fused(*a))
    seq = prompt + base
    chain = Engine(target, RankedOracle(seq, 8, ranks, 256), max_len=256).generate(prompt, 48)
    oracle = RankedOracle(seq, 8, ranks, 256)
    tree = Engine(target, oracle, max_len=256, tree=budget, backend="static" if static else "eager").generate(prompt, 48)
    assert chain.output_ids == tree.output_ids == base
    want = expected_lengths(oracle, budget)
    assert tree.accept_lengths[:-1] == want[:len(tree.accept_lengths) - 1]  # the last round may be cut
    assert tree.accept_lengths[-1] <= want[len(tree.accept_lengths) - 1]
    # the chain stops at the first truth not ranked first; the tree follows it down other branches
    assert tree.acceptance.tau > 1.5 * chain.acceptance.tau and max(tree.accept_lengths) >= 3
    assert len(built) == (tree.acceptance.rounds if static == "fused" else 0)


def test_what_a_tree_refuses(pair):
    _, drafter_dir, target, prompt, _ = pair
    engine = Engine(target, load_drafter(drafter_dir, target, max_len=256), max_len=256, tree=8)
    with pytest.raises(StrataError, match="not supported with tree"):
        engine.generate(prompt, 4, params=SamplingParams(0.8))
    from strata.engine.prompt_lookup import PromptLookupDrafter

    with pytest.raises(StrataError, match="tree needs a drafter that scores its candidates"):
        Engine(target, PromptLookupDrafter(3), max_len=256, tree=8)
    with pytest.raises(StrataError, match="a tree of depth 1 holds at most 8 nodes"):
        Engine(target, load_drafter(drafter_dir, target, max_len=256), max_len=256, tree=9, window=2)
    with pytest.raises(StrataError, match="tree needs a drafter"):
        Engine(target, max_len=256, tree=8)


def test_cli_generate_gate_and_their_refusals(tmp_path):
    """The demo pair: `generate --tree` prints what the chain prints, `gate --tree` passes and reports the
    budget, and what a tree cannot do is one line, exit 2, before any work."""
    prompt = "def quicksort(arr):"
    chain = run_cli("generate", prompt, "--max-new-tokens", "40", "--ids")
    tree = run_cli("generate", prompt, "--max-new-tokens", "40", "--ids", "--tree", "16")
    assert chain.returncode == tree.returncode == 0, tree.stderr
    assert tree.stdout == chain.stdout and "tree of 16 nodes" in tree.stderr
    prompts = tmp_path / "p.json"
    prompts.write_text('["class Stack:", "import os\\n"]')
    stats = tmp_path / "gate.json"
    gate = run_cli("gate", "--tree", "32", "--prompts", prompts, "--max-new-tokens", "24", "--stats-json", stats)
    assert gate.returncode == 0 and "gate: PASS (2/2 identical)" in gate.stdout, gate.stdout + gate.stderr
    assert "tree of 32 nodes" in gate.stdout and '"tree": 32' in stats.read_text()
    for args, needle in ((["--temperature", "0.7"], "not supported with --tree"),
                         (["--prompt-lookup", "3", "--no-dflash"], "--tree needs a drafter that scores"),
                         (["--spec", "2", "--tree", "9"], "a tree of depth 1 holds at most 8 nodes")):
        r = run_cli("generate", prompt, "--tree", "8", *args)
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


def test_bench_sweeps_budgets_against_the_chain(tmp_path):
    import json

    prompts = tmp_path / "p.json"
    prompts.write_text('["def fibonacci(n):", "class Stack:"]')
    out = tmp_path / "tree.json"
    r = run_cli("bench", "--tree", "4", "32", "--prompts", prompts, "--new-tokens", "24", "--runs", "1",
                "--prompt-len", "16", "--hf", "none", "--out", out)
    assert r.returncode == 0, r.stderr
    sweep = json.loads(out.read_text())["tree_sweep"]
    assert sweep["prompts"] == 2 and set(sweep["budgets"]) == {"4", "32"} and sweep["chain"]["nodes"] == 7
    for n, row in sweep["budgets"].items():
        assert row["identical_to_chain"] and row["verify_rows"] == int(n) + 1 and row["tok_s"] > 0
    assert sweep["budgets"]["32"]["tau"] > sweep["chain"]["tau"]
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert run_cli("bench", "--tree", "4", "--no-dflash").returncode == 2
