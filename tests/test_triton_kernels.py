"""Strata's Triton kernels, run by Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET; the GPU
runs the same source), against the torch functions they replace. float32 and float16: the interpreter has
no bfloat16 arithmetic."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

from strata.layers.kernels import EAGER, KernelOptions, Kernels, TritonKernels
from strata.layers.kernels import attention as attn
from strata.layers.kernels import dense, jit_dense, norms, tuning
from strata.layers.ops import attend_grouped, norm_rotate_store, silu_mul
from strata.models.random_init import random_target

from conftest import forward_at

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def close(got: torch.Tensor, want: torch.Tensor, dtype) -> float:
    """Largest error relative to the reference's scale."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
    assert err <= TOL[dtype], err
    return err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_linear_with_ragged_blocks(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 200, generator=gen).to(dtype)
    w = torch.randn(52, 200, generator=gen).to(dtype)  # 52 rows, 200 columns: no block divides either
    b = torch.randn(52, generator=gen).to(dtype)
    config = (8, 64, 2)
    close(dense.gemv(x, w, config=config), F.linear(x, w), dtype)
    close(dense.gemv(x, w, b, config=config), F.linear(x, w, b), dtype)
    close(dense.gemv(x, w, glu=True, config=config), silu_mul(F.linear(x, w)), dtype)
    # the default configurations too, and a weight that is a row block of a larger matrix (a view)
    big = torch.randn(80, 200, generator=gen).to(dtype)
    close(dense.gemv(x, big[16:68]), F.linear(x, big[16:68]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_gemm_matches_linear_for_a_few_rows(dtype):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(52, 200, generator=gen).to(dtype)
    b = torch.randn(52, generator=gen).to(dtype)
    config = (16, 64, 2, 2)
    for rows in (2, 5, 16):
        x = torch.randn(rows, 200, generator=gen).to(dtype)
        close(dense.skinny(x, w, config=config), F.linear(x, w), dtype)
        close(dense.skinny(x, w, b, config=config), F.linear(x, w, b), dtype)
        close(dense.skinny(x, w, glu=True, config=config), silu_mul(F.linear(x, w)), dtype)
    x = torch.randn(8, 200, generator=gen).to(dtype)
    close(dense.skinny(x, w), F.linear(x, w), dtype)  # the default configuration


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_matches_grouped_matmuls(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    t, h, hk, d, cells = 3, 8, 2, 16, 300
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    cache_k = torch.randn(cells + 20, hk, d, generator=gen).to(dtype)
    cache_v = torch.randn(cells + 20, hk, d, generator=gen).to(dtype)
    k, v = cache_k[:cells], cache_v[:cells]  # the first cells of a longer cache, as a static step reads them
    # causal rows ending early: the later splits see nothing and must not disturb the combination
    causal = torch.arange(cells).unsqueeze(0) <= torch.tensor([[40], [41], [42]])
    # a drafter's block mask: one row broadcast to every query (stride 0), a window of cells
    cells_idx = torch.arange(cells)
    block = ((cells_idx >= 100) & (cells_idx < 250)).unsqueeze(0).expand(t, -1)
    for splits in (16, 2):
        monkeypatch.setattr(attn, "ATTENTION_TARGET_SPLITS", splits)
        for mask in (causal, block):
            close(attn.attention(q, k, v, mask)[0], attend_grouped(q, k, v, mask), dtype)
    one = attn.attention(q[:1], k, v, causal[:1])[0]  # the 1-token decode
    close(one, attend_grouped(q[:1], k, v, causal[:1]), dtype)
    # a tree's verify: more query rows (5 rows x 4 heads a group) than a program holds, in blocks of 16
    monkeypatch.setattr(tuning, "ATTENTION_MAX_ROWS", 16)
    tree = torch.randn(5, h, d, generator=gen).to(dtype)
    visible = torch.rand(5, cells, generator=gen) < 0.3
    visible[:, 0] = True
    close(attn.attention(tree, k, v, visible)[0], attend_grouped(tree, k, v, visible), dtype)
    # head dim 256 (Qwen3.5's gated attention): smaller tiles, two row blocks of 32
    monkeypatch.setattr(tuning, "ATTENTION_MAX_ROWS", 64)
    q, kv = torch.randn(16, 4, 256, generator=gen).to(dtype), torch.randn(2, 90, 1, 256, generator=gen).to(dtype)
    late = torch.arange(90).unsqueeze(0) <= torch.arange(60, 76).unsqueeze(1)
    close(attn.attention(q, kv[0], kv[1], late)[0], attend_grouped(q, kv[0], kv[1], late), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norms_match_the_reference(dtype):
    """The one-launch RMSNorm and residual add + RMSNorm against ops: a ragged row (200 columns in a block of
    256), one row and a window of rows, a residual sum bit for bit, a float32 weight over float16 rows; a
    row's columns split over programs (norm_chunk, the last chunk of the ragged row part past it) giving the
    same bits as one program a row, and as its weights read after the PDL wait (pre_wait_loads off)."""
    from strata.layers.ops import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(10)
    for shape in ((1, 200), (2, 5, 200), (3, 1024)):
        x = torch.randn(shape, generator=gen).to(dtype)
        res = torch.randn(shape, generator=gen).to(dtype)
        for w in (torch.rand(shape[-1], generator=gen).to(dtype) + 0.5, torch.rand(shape[-1], generator=gen) + 0.5):
            def norm(options):  # (normed, x + res, normed x + res)
                added = norms.rms_norm(x, w, 1e-6, res, options=options)
                return norms.rms_norm(x, w, 1e-6, options=options)[0], added[2], added[0]

            whole = norm(KernelOptions(norm_chunk=0))
            close(whole[0], rms_norm(x, w, 1e-6), dtype)
            want_total, want_h = add_rms_norm(x, res, w, 1e-6)
            assert whole[1].equal(want_total)
            close(whole[2], want_h, dtype)
            chunked = norm(KernelOptions(norm_chunk=64))
            assert all(a.equal(b) for a, b in zip(chunked, whole, strict=True))
            assert norm(KernelOptions(norm_chunk=64, pre_wait_loads=False))[2].equal(whole[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pre_wait", [True, False])
def test_norm_rotate_store_writes_q_and_the_cache_cells(dtype, pre_wait):
    """Against ops.norm_rotate_store, its weights, cos and sin read before the PDL wait or after it."""
    gen = torch.Generator().manual_seed(3)
    t, h, hk, d = 3, 4, 2, 16
    proj = torch.randn(t, (h + 2 * hk) * d, generator=gen).to(dtype)  # one fused q/k/v projection
    qk, v = proj[:, :(h + hk) * d].view(t, h + hk, d), proj[:, (h + hk) * d:].view(t, hk, d)
    q_w, k_w = (torch.rand(d, generator=gen) + 0.5).to(dtype), (torch.rand(d, generator=gen) + 0.5).to(dtype)
    angle = torch.randn(t, 1, d // 2, generator=gen)
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    positions = torch.tensor([5, 9, 7])
    results = []
    for fn in (functools.partial(norms.norm_rotate_store, prewait=pre_wait), norm_rotate_store):
        kc, vc = torch.zeros(12, hk, d, dtype=dtype), torch.zeros(12, hk, d, dtype=dtype)
        results.append((fn(qk, v, q_w, k_w, cos, sin, 1e-6, h, kc, vc, positions), kc, vc))
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = results
    close(q, q_ref, dtype)
    close(kc, kc_ref, dtype)
    assert vc.equal(vc_ref)
    untouched = [i for i in range(12) if i not in positions.tolist()]
    assert kc[untouched].eq(0).all() and vc[untouched].eq(0).all()


def test_static_forward_with_triton_kernels_matches_the_eager_one(monkeypatch):
    """The target's static step (1-token decode and a 4-row verify window) with the Triton kernels in
    place of cuBLAS projections, grouped attention and the q/k group: same logits, same cache."""
    target = random_target("tiny", seed=4)
    kernels = TritonKernels(compiled=False)
    calls = {"gemv": 0, "skinny": 0, "attention": 0, "norm_rotate_store": 0}
    homes = {"gemv": dense, "skinny": dense, "attention": attn, "norm_rotate_store": norms}

    def counting(name):
        fn = getattr(homes[name], name)

        def counted(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return counted

    for name in calls:
        monkeypatch.setattr(homes[name], name, counting(name))
    prompt = torch.randint(0, target.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    caches = []
    for fns in (Kernels(attention="grouped"), kernels):
        cache = target.make_cache(64)
        forward_at(target, prompt, 0, cache)
        steps = []
        for tokens in (torch.tensor([17]), torch.tensor([3, 99, 250, 7])):
            steps.append(forward_at(target, tokens, 9 + len(steps), cache, [1, 2], kv_len=64, kernels=fns))
        caches.append((steps, cache))
    (want, want_cache), (got, got_cache) = caches
    for a, b in zip(want, got):
        close(b.logits, a.logits, torch.float32)
        close(b.taps, a.taps, torch.float32)
        assert b.logits.argmax(-1).equal(a.logits.argmax(-1))
    for got_kv, want_kv in zip(got_cache.layers, want_cache.layers):
        close(got_kv.k, want_kv.k, torch.float32)
        close(got_kv.v, want_kv.v, torch.float32)
    layers = target.cfg.num_layers
    # qkv, o, gate/up, down per layer and the LM head: by the GEMV in the decode, the skinny GEMM in the window
    assert calls == {"gemv": 4 * layers + 1, "skinny": 4 * layers + 1, "attention": 2 * layers,
                     "norm_rotate_store": 2 * layers}


def test_compiled_triton_set_keeps_its_own_kernels():
    """The compiled set fuses the remaining groups with torch.compile without shadowing the Triton ones."""
    kernels = TritonKernels(compiled=True)
    for name in ("norm_rotate_store", "linear", "gate_up_silu", "attend"):
        assert getattr(kernels, name).__func__ is getattr(TritonKernels, name), name
    assert kernels.groups["add_rms_norm"] is not EAGER.groups["add_rms_norm"]


def test_float32_few_row_products_pipeline_only_what_shared_memory_holds(monkeypatch):
    """The few-row GEMM's stages: float32 (full-precision dots buffer both tiles) at most what fits an H200
    block, whose limit the default 4 passed (compiled offline for sm_90: 245760 bytes, 442368 with gate/up,
    so a float32 model's windows fell back to cuBLAS on the H200); 16-bit products keep the configured 4."""
    stages = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kw: stages.append(kw["num_stages"])

    monkeypatch.setattr(jit_dense, "skinny_kernel", Launcher())
    for dtype in (torch.float32, torch.bfloat16):
        for glu in (False, True):
            dense.skinny(torch.zeros(8, 256, dtype=dtype), torch.zeros(128, 256, dtype=dtype), glu=glu)
    assert stages == [3, 2, tuning.SKINNY_CONFIG[3], tuning.SKINNY_CONFIG[3]]


def test_a_failing_triton_kernel_leaves_the_torch_path_with_one_warning(monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(dense, "gemv", broken)
    monkeypatch.setattr(attn, "attention", broken)
    kernels = TritonKernels(compiled=False)
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(1, 32, generator=gen), torch.randn(24, 32, generator=gen)
    q, k, v = (torch.randn(2, 4, 16, generator=gen), torch.randn(9, 2, 16, generator=gen),
               torch.randn(9, 2, 16, generator=gen))
    mask = torch.arange(9).unsqueeze(0) <= torch.tensor([[6], [7]])
    with pytest.warns(UserWarning, match="Triton kernel gemv failed"):
        assert kernels.linear(x, w).equal(F.linear(x, w))
    with pytest.warns(UserWarning, match="Triton kernel attention failed"):
        assert kernels.attend(q, k, v, mask).equal(attend_grouped(q, k, v, mask))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once failed, the torch path is taken without trying again
        assert kernels.gate_up_silu(x, w).equal(silu_mul(F.linear(x, w)))
        assert kernels.attend(q, k, v, mask).equal(attend_grouped(q, k, v, mask))
    close(kernels.linear(x.repeat(3, 1), w), F.linear(x.repeat(3, 1), w), torch.float32)  # skinny still runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter rounds bfloat16 to zero
def test_expert_gemvs_match_the_routed_experts(dtype, monkeypatch):
    """The per-assignment expert GEMVs (decode, a verify window) against ops.experts_routed: ragged blocks
    (24 intermediate, 72 hidden: no block divides them), experts repeated across rows; a row's outputs summed
    by the down GEMVs exactly as ops.sum_slots sums them after the unsummed GEMVs, at top-k 2 and 3 (slots
    padded to a power of two), in whole and ragged blocks."""
    from strata.layers.ops import experts_routed, route, sum_slots

    gen = torch.Generator().manual_seed(8)
    e, inter, hidden = 5, 24, 72
    gate_up = (torch.randn(2, e, inter, hidden, generator=gen) * 0.1).to(dtype)
    down = (torch.randn(e, hidden, inter, generator=gen) * 0.1).to(dtype)
    router = torch.randn(e, hidden, generator=gen).to(dtype)
    for rows, top_k in ((1, 2), (3, 2), (2, 3)):
        h = torch.randn(rows, hidden, generator=gen).to(dtype)
        weights, experts = route(h, router, top_k, True)
        want = experts_routed(h, gate_up, down, weights, experts)
        for grouped in (False, True):  # per assignment, and each expert once for all its rows
            close(dense.experts(h, gate_up, down, weights, experts, grouped=grouped), want, dtype)
        for block_n, block_k, warps in ((8, 128, 1), (16, 16, 2)) if top_k == 3 else ():
            monkeypatch.setattr(dense, "EXPERT_DOWN_SUM_CONFIG", (block_n, block_k, warps))
            monkeypatch.setattr(dense, "EXPERT_DOWN_CONFIG", (4, block_k, 1))  # the same K steps, unsummed
            slots = []
            unsummed = dense.experts(h, gate_up, down, weights, experts, grouped=False,
                                     reduce=lambda y, w, t: slots.append(y) or sum_slots(y, w, t))
            assert slots[0].shape == (rows, top_k, hidden)
            assert dense.experts(h, gate_up, down, weights, experts, grouped=False).equal(unsummed)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_kernel_matches_the_routing(renormalize):
    """The one-launch routing against ops.route: the same experts in ascending order, weights to rounding;
    128 experts (a 30B-A3B layer's) and 6 (a tiny checkpoint's, the block padded)."""
    from strata.layers.ops import route

    gen = torch.Generator().manual_seed(9)
    for e, k in ((128, 8), (6, 2)):
        h = torch.randn(5, 32, generator=gen)
        router = torch.randn(e, 32, generator=gen)
        want_w, want_e = route(h, router, k, renormalize)
        got_w, got_e = dense.route_topk(F.linear(h, router), k, renormalize)
        assert got_e.equal(want_e) and bool((got_e.diff(dim=-1) > 0).all())
        close(got_w, want_w, torch.float32)


def test_a_moe_step_runs_the_expert_gemvs(monkeypatch):
    """A tiny MoE target's static verify step through TritonKernels takes the expert GEMVs in every sparse
    layer and keeps the eager step's logits."""
    target = random_target("tiny-moe", seed=2, num_hidden_layers=2)
    calls = []
    real = dense.experts
    monkeypatch.setattr(dense, "experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompt = torch.randint(0, target.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    outs = []
    for fns in (Kernels(attention="grouped", static=True), TritonKernels(compiled=False)):
        cache = target.make_cache(64)
        forward_at(target, prompt, 0, cache)
        outs.append(forward_at(target, torch.tensor([3, 99, 250, 7]), 9, cache, kv_len=64, kernels=fns))
    close(outs[1].logits, outs[0].logits, torch.float32)
    assert outs[1].logits.argmax(-1).equal(outs[0].logits.argmax(-1))
    assert len(calls) == len(target.cfg.moe.layers) == 2


def test_experts_in_host_memory_run_in_static_shapes():
    """A MoE target with most experts in host memory (an expert cache): its static 12-row step, through the
    torch set and through TritonKernels (the per-assignment GEMVs: the stand-ins for the host's experts
    repeat within a row, which the grouped kernel does not serve), keeps the eager step's logits; while a
    step is captured each sparse layer hands its host work over (graph_breaks) instead of running it."""
    from strata.layers import graph_breaks
    from strata.models.placement import sparse_layers

    target = random_target("tiny-moe", seed=2, num_hidden_layers=2)
    prompt = torch.randint(0, target.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    window = torch.randint(0, target.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(6))

    def step(kernels):
        cache = target.make_cache(64)
        forward_at(target, prompt, 0, cache)
        return forward_at(target, window, 9, cache, kv_len=64, kernels=kernels)

    want = step(EAGER)
    moes = sparse_layers(target)
    for moe in moes:
        moe.place([0, 3])
    for kernels in (Kernels(attention="grouped", static=True), TritonKernels(compiled=False)):
        got = step(kernels)
        close(got.logits, want.logits, torch.float32)
        assert got.logits.argmax(-1).equal(want.logits.argmax(-1))
    assert all(moe.timing["host_experts"] > 0 for moe in moes)
    fills = []
    cache = target.make_cache(64)
    forward_at(target, prompt, 0, cache)
    for moe in moes:
        moe.timing.clear()
    with graph_breaks.splitting(fills.append):
        forward_at(target, window, 9, cache, kv_len=64, kernels=Kernels(attention="grouped", static=True))
    assert len(fills) == len(moes) == 2 and not any(moe.timing for moe in moes)
