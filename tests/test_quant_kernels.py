"""The kernels over GGUF blocks (layers/kernels/quantized.py and its jit modules), run by Triton's interpreter on the CPU (the GPU
runs the same source): dequantization bit for bit as gguf.quants.dequantize, for every type on valid
blocks; the 1-row GEMV, the few-row GEMM, their gate/up variant and the embedding gather against torch
on those values; and a GGUF target kept quantized decoding like the same file dequantized at load."""

from __future__ import annotations

import inspect

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from strata.layers.kernels import KernelOptions, jit_common, jit_q4, x8  # jit_*: the test kernel's globals
from strata.layers.kernels import host_blocks
from strata.layers.kernels import quantized as qk
from strata.layers.ops import silu_mul
from strata.layers.quant import QuantExperts, QuantWeight, Segment, weight_bytes

from conftest import write_hf_drafter
from test_interop import random_blocks

T = gguf.GGMLQuantizationType
TYPES = [T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.Q3_K, T.IQ3_XXS]


def blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    gen = np.random.default_rng(seed)
    if qtype in (T.Q8_0, T.Q4_0):  # the reference quantizer exists for these: real blocks of real values
        return quants.quantize(gen.standard_normal((rows, cols), dtype=np.float32), qtype)
    return random_blocks(qtype, rows, cols, gen)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-9)).item()


def int8_twin(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_x in torch: per 32 values q = x * 127 / max |x| rounded to nearest even, d = max |x| / 127."""
    b = x.float().reshape(-1, 32)
    amax = b.abs().amax(1, keepdim=True)
    return torch.round(b * torch.where(amax > 0, 127.0 / amax, 0.0)), amax / 127.0


def as_computed(x: torch.Tensor, qtype, cols: int) -> torch.Tensor:
    """x as the product computes with it: d * q (float64) where it takes int8 x, else x."""
    if not qk.int8_x(int(qtype), x.shape[0], cols):
        return x.double()
    q, d = int8_twin(x)
    return (q.double() * d.double()).reshape(x.shape)


def test_quantize_x_blocks_of_32():
    """int8 x for the 1-row GEMVs: the values, scales and 16-value sums of the torch twin, bit for bit, a
    block of zeros and one of large values among them."""
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(3))
    x[0, 32:64] = 0
    x[0, 64:96] *= 1e4
    q, d, s = x8.quantize_x(x)
    tq, td = int8_twin(x)
    assert q.dtype == torch.int8 and q.shape == (1024 + 32 * 34,)
    assert torch.equal(q[:1024].float(), tq.flatten()) and torch.equal(d, td.flatten())
    assert torch.equal(s, tq.reshape(-1, 16).sum(1) * td.repeat_interleave(2, 0).flatten())
    assert q.abs().max() == 127 and not q[32:64].any()
    # then the same values as a Q8_0 row lays out its blocks' (gemv_q8_0c's x): two zero bytes for each d
    rows = q[1024:].reshape(32, 34)
    assert not rows[:, :2].any() and torch.equal(rows[:, 2:].flatten(), q[:1024])
    # a few rows: X_ROWS of them, zeros past the third; each block's d and sum side by side
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(4))
    q, ds = x8.quantize_x(x)
    tq, td = int8_twin(x)
    assert q.shape == (x8.X_ROWS * (1024 + 32 * 34),) and ds.shape == (32, x8.X_ROWS, 2)
    rows, tails = q[:x8.X_ROWS * 1024].view(x8.X_ROWS, 1024), q[x8.X_ROWS * 1024:].view(x8.X_ROWS, 32, 34)
    assert torch.equal(rows[:3].float(), tq.reshape(3, 1024)) and not rows[3:].any() and not ds[:, 3:].any()
    assert not tails[:, :, :2].any() and torch.equal(tails[:, :, 2:].reshape(x8.X_ROWS, 1024), rows)
    assert torch.equal(ds[:, :3, 0], td.reshape(3, 32).T)
    assert torch.equal(ds[:, :3, 1], (tq.sum(1, keepdim=True) * td).reshape(3, 32).T)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_exact_and_products_match(qtype):
    raw = blocks(qtype, 6, 512, qtype.value)
    ref = quants.dequantize(raw, qtype).astype(np.float32)
    data = torch.from_numpy(raw.copy())
    got = qk.dequantize(data, int(qtype), 512).numpy()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    w = torch.from_numpy(ref)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 16):
        x = torch.randn(rows, 512, generator=gen)
        want = as_computed(x, qtype, 512) @ w.double().T
        assert rel(qk.matmul(x, data, int(qtype), 6).double(), want) <= 1e-5
        assert rel(qk.matmul(x, data, int(qtype), 3, glu=True).double(), silu_mul(want)) <= 1e-5
    tokens = torch.tensor([[5, 0], [2, 2]])
    assert torch.equal(qk.gather(data, int(qtype), 512, tokens, torch.float32), w[tokens])


def test_iq4_levels_by_prmt_as_looked_up():
    """IQ4_XS's word kernels take a nibble's level with PTX prmts on the device (three per 4 nibbles; two
    more put them in weight order for the GEMM, or put the GEMV's x in their order): those prmts, spelled
    out in the interpreter, give the levels of gguf's table for every nibble value at every position, as
    the interpreter's lookup does, and x's bytes in the order of the levels; so do they with the table's
    words made at run time (_iq4_registers, as the kernels make them before their K loops)."""
    import triton
    import triton.language as tl

    @triton.jit
    def levels(q_ptr, out_ptr, K, LOOKUP: tl.constexpr):
        q = tl.load(q_ptr + tl.arange(0, 64))
        a, b = jit_q4._iq4_pairs(q, False, LOOKUP)
        lo, hi = jit_q4._iq4_levels(q, False, LOOKUP, jit_q4._iq4_registers(K))
        at = out_ptr + 6 * tl.arange(0, 64)
        tl.store(at, a)
        tl.store(at + 1, b)
        tl.store(at + 2, lo)
        tl.store(at + 3, hi)
        tl.store(at + 4, jit_common._prmt(q, q >> 8, q * 0 + 0x5140, False))
        tl.store(at + 5, jit_common._prmt(q, q >> 8, q * 0 + 0x7362, False))

    q = torch.from_numpy(np.random.default_rng(5).integers(0, 2 ** 32, 64, dtype=np.uint32).view(np.int32))
    q[:16] = torch.tensor([0x01234567 * i for i in range(16)], dtype=torch.int64).to(torch.int32)
    got = {}
    for lookup in (True, False):
        out = torch.empty(64, 6, dtype=torch.int32)
        levels[(1,)](q, out, 4096, lookup)
        got[lookup] = out.numpy().view(np.int8).reshape(64, 6, 4)
    assert np.array_equal(got[True][:, :4], got[False][:, :4])
    nib = (q.numpy().view(np.uint32)[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    want = np.array(quants.IQ4_NL.kvalues, dtype=np.int8)[nib]  # nibbles 0, 1, ..., 7 of each word
    assert np.array_equal(got[False][:, 0], want[:, :4]) and np.array_equal(got[False][:, 1], want[:, 4:])
    assert np.array_equal(got[False][:, 2], want[:, 0::2]) and np.array_equal(got[False][:, 3], want[:, 1::2])
    # x's words a and b = a >> 8 (bytes a0..a3, a1..a3 0|sign): interleaved as the levels are
    a = q.numpy().view(np.uint8).reshape(64, 4).view(np.int8)
    b = (q.numpy() >> 8).view(np.uint8).reshape(64, 4).view(np.int8)
    assert np.array_equal(got[False][:, 4], np.stack([a[:, 0], b[:, 0], a[:, 1], b[:, 1]], 1))
    assert np.array_equal(got[False][:, 5], np.stack([a[:, 2], b[:, 2], a[:, 3], b[:, 3]], 1))


@pytest.mark.parametrize("qtype,rows", [(T.Q4_K, 1), (T.Q4_K, 5), (T.Q5_K, 1), (T.Q5_K, 5), (T.Q6_K, 1), (T.Q6_K, 5),
                                       (T.Q8_0, 1), (T.Q8_0, 5), (T.IQ4_XS, 1), (T.IQ4_XS, 5),
                                       (T.Q4_0, 1), (T.Q4_0, 5)],
                         ids=lambda v: getattr(v, "name", f"rows {v}"))
def test_word_kernels_match_the_reference_dequantization(qtype, rows, monkeypatch):
    """The GEMV (1 row) and the few-row GEMM on 32-bit words: 2048 columns put Q6_K's superblocks at every
    offset from a 16-byte boundary (the GEMV's last one reads a chunk past the matrix, which must stay
    masked; the GEMM assembles odd ones' words from two) and Q8_0's blocks at each of their 4 offsets from
    an 8-byte one (both its kernels on int8 x; its GEMV's 16-byte chunks meet a d at each even byte; its
    GEMM's steps of 16 blocks, 17 chunks of 32 bytes, put a block boundary at each even byte of a chunk),
    float32 x to 1e-6 and half-precision x as rounded; rows of W not a multiple of a program's, gate/up
    fused, K slices past the last (Q8_0's gate/up)."""
    raw = blocks(qtype, 10, 2048, 40 + qtype.value)
    if qtype not in (T.Q8_0, T.Q4_0):  # each superblock's d its own (random blocks share one): a kernel reading
        size = gguf.GGML_QUANT_SIZES[qtype][1]  # another block's d must fail
        at = {T.Q6_K: size - 2}.get(qtype, 0)
        d = raw.reshape(10, -1, size)[..., at:at + 2].copy().view(np.float16)
        d *= np.float16(2.0) ** np.random.default_rng(7).integers(-2, 3, d.shape).astype(np.float16)
        raw.reshape(10, -1, size)[..., at:at + 2] = d.view(np.uint8)
    w = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32)).double()
    data = torch.from_numpy(raw.copy())
    assert qk.word_kernel(int(qtype), rows, 2048)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 2048, generator=gen)
    want = as_computed(x, qtype, 2048) @ w.T
    if rows == 1:  # int8 x: exact on d * q, and within its rounding of x
        assert qk.int8_x(int(qtype), rows, 2048)
        assert 1e-4 < rel(qk.matmul(x, data, int(qtype), 9).double(), x.double() @ w[:9].T) <= 2e-2
    # two blocks of rows, the second part empty; the GEMM's K in 3 slices (Q6_K's last empty), then 2
    configs = [(1, 2, 4, 1), (2, 4, 1, 2)] if rows == 1 else [(8, 4, 1, 3), (8, 4, 1, 2)]
    # lanes along K: 16 superblocks a step (8 past K), then 4 with two warps taking a row's in turns; Q8_0's
    # 136 16-byte chunks a row take 128, then 32 (the last step 8: each of a block's 4 offsets from a chunk, the
    # d of a block past the row)
    first = qk.matmul(x, data, int(qtype), 9, config=configs[0])
    assert rel(first.double(), want[:, :9]) <= 1e-6
    if rows > 1:  # the split counts of another lane (a product beside another on a second stream): the same sums
        assert torch.equal(qk.matmul(x, data, int(qtype), 9, config=configs[0], lane=1), first)
        lanes = qk.counters(x.device), qk.counters(x.device, 1)
        assert not lanes[1].any() and lanes[1].data_ptr() != lanes[0].data_ptr()
    got = qk.matmul(x, data, int(qtype), 5, glu=True, config=configs[1]).double()
    assert rel(got, torch.nn.functional.silu(want[:, :5]) * want[:, 5:]) <= 1e-6
    if rows > 1 and qtype != T.Q6_K:  # 32-row blocks: gate and up stacked into one 64-row tile, the same
        stacked = qk.matmul(x, data, int(qtype), 5, glu=True, config=(32, 4, 1, 2))  # sums as two tiles of 32
        assert rel(stacked.double(), torch.nn.functional.silu(want[:, :5]) * want[:, 5:]) <= 1e-6
        unstacked = qk.matmul(x, data, int(qtype), 5, glu=True, config=(32, 4, 1, 2),
                              options=KernelOptions(glu_stack_rows=0))
        assert torch.equal(unstacked, stacked)
    assert not qk.counters(x.device).any()  # the split products left their counts at zero
    # half-precision x (bfloat16 for the GEMV, float16 for the GEMM), the output rounded to it
    half = x.bfloat16() if rows == 1 else x.half()
    got = qk.matmul(half, data, int(qtype), 10).double()
    assert rel(got, as_computed(half, qtype, 2048) @ w.T) <= 2 ** -7


def test_q8_0_gemm_of_blocks_in_fours_where_512_does_not_divide_k():
    """K = 1280 (10 steps of 4 blocks; Qwen2.5-1.5B's down has 8960 columns): Q8_0's few-row GEMM falls back
    from 16 blocks a step to 4, on the same int8 x; K slices (3, then 2 uneven) and gate/up fused, to 1e-6."""
    raw = blocks(T.Q8_0, 10, 1280, 61)
    w = torch.from_numpy(quants.dequantize(raw, T.Q8_0).astype(np.float32)).double()
    data = torch.from_numpy(raw.copy())
    assert qk.word_kernel(int(T.Q8_0), 5, 1280) == "skinny_q8_0" and qk.word_kernel(int(T.Q8_0), 5, 2048) == \
        "skinny_q8_0w"
    x = torch.randn(5, 1280, generator=torch.Generator().manual_seed(6))
    want = as_computed(x, T.Q8_0, 1280) @ w.T
    assert rel(qk.matmul(x, data, int(T.Q8_0), 9, config=(8, 4, 1, 3)).double(), want[:, :9]) <= 1e-6
    got = qk.matmul(x, data, int(T.Q8_0), 5, glu=True, config=(8, 4, 1, 2)).double()
    assert rel(got, torch.nn.functional.silu(want[:, :5]) * want[:, 5:]) <= 1e-6
    assert not qk.counters(x.device).any()


def test_quant_weight_segments_slices_and_bytes():
    """A fused q/k/v of two types (as Q4_K_M makes), sliced by rows as a drafter's context path does."""
    a, b = blocks(T.Q4_K, 4, 256, 1), blocks(T.Q6_K, 2, 256, 2)
    w = QuantWeight([Segment(int(T.Q4_K), torch.from_numpy(a.copy())), Segment(int(T.Q6_K), torch.from_numpy(b.copy()))],
                    256, torch.float32)
    full = torch.cat([torch.from_numpy(quants.dequantize(a, T.Q4_K)), torch.from_numpy(quants.dequantize(b, T.Q6_K))])
    assert w.shape == (6, 256) and w.nbytes == a.nbytes + b.nbytes
    assert torch.equal(w.dequantize(), full)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    # the Q4_K rows on int8 x (one quantize_x shared by both segments), the Q6_K rows on x
    want = torch.cat([as_computed(x, T.Q4_K, 256) @ full[:4].double().T, x.double() @ full[4:].double().T], dim=1)
    assert qk.int8_x(int(T.Q4_K), 2, 256) and not qk.int8_x(int(T.Q6_K), 2, 256)
    assert rel(w.matmul(x).double(), want) <= 2e-6
    assert rel(w[3:5].matmul(x).double(), want[:, 3:5]) <= 2e-6
    assert w.gate_up_silu(x) is None  # gate and up of different types take the two-step path
    assert rel(w.matmul(torch.randn(40, 256)), torch.randn(40, 256) @ full.T) > 0  # prefill-sized: dequantized


def test_a_quantized_target_decodes_like_it_dequantized(tmp_path, monkeypatch):
    """Target-only and DFlash (static steps) over Q4_K blocks; the interpreter runs a program per block of
    rows, so the GEMV and the GEMM take wide blocks here (the result does not depend on them)."""
    from strata.dflash.drafter import load_drafter
    from strata.engine.decode import Engine
    from strata.models.loader import load_target

    from conftest import write_hf_model
    from test_gguf_target import qwen2_tokenizer, write_gguf_target

    monkeypatch.setattr(qk, "GEMV_CONFIGS", [(128, 4, 4)])
    monkeypatch.setattr(qk, "SKINNY_CONFIGS", [(128, 4, 4)])
    monkeypatch.setattr(qk, "LANE_K_CONFIGS", [(1, 256, 4, 1)])
    monkeypatch.setattr(qk, "WORD_SKINNY_CONFIGS", [(256, 4, 1, 1)])
    hf, _ = write_hf_model(tmp_path / "hf", "qwen3", seed=4, vocab=320, hidden_size=256, intermediate_size=256,
                           head_dim=64, layers=2)
    qwen2_tokenizer(hf, 320)
    path = tmp_path / "t.gguf"
    write_gguf_target(path, hf, "qwen3", T.Q4_K, seed=7)
    plain = load_target(path)
    kept = load_target(path, quantized=True)
    assert isinstance(kept.layers[0].self_attn.qkv_proj.weight, QuantWeight)
    assert isinstance(kept.embed_tokens.weight, QuantWeight)
    assert weight_bytes(kept) < weight_bytes(plain) / 3
    prompt = [5, 17, 200, 31, 7, 99]
    want = Engine(plain, max_len=64).generate(prompt, 8).output_ids
    assert Engine(kept, max_len=64).generate(prompt, 8).output_ids == want
    drafter = write_hf_drafter(tmp_path / "d", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64,
                               intermediate=256, taps=(0, 1), num_target_layers=2, vocab=320, mask_token_id=319)
    spec = Engine(kept, load_drafter(drafter, kept, max_len=64), max_len=64, backend="static", window=4)
    assert spec.generate(prompt, 8).output_ids == Engine(kept, max_len=64, backend="static", pad_rows=4).generate(
        prompt, 8).output_ids


def test_random_quantized_targets_follow_the_file_type_and_the_floor_counts_their_bytes():
    """`strata bench --quant` builds these: Q4_K_M gives the LM head and the 'more bits' layers' v and down
    Q6_K (llama.cpp's rule), the rest Q4_K; a token reads the blocks of every matrix but one embedding row.
    On the CPU they are dequantized at build, as a GGUF file is at load."""
    from strata.bench.run import bytes_per_token
    from strata.layers.quant import use_more_bits
    from strata.models.random_init import random_target

    shape = dict(hidden_size=256, intermediate_size=256, head_dim=64, vocab_size=512, num_hidden_layers=8)
    t = random_target("tiny", quant="Q4_K_M", quantized=True, **shape)
    assert [s.qtype for s in t.lm_head.weight.segments] == [int(T.Q6_K)]
    for i, layer in enumerate(t.layers):
        more = use_more_bits(i, 8)
        assert [s.qtype for s in layer.self_attn.qkv_proj.weight.segments] == \
            ([int(T.Q4_K), int(T.Q6_K)] if more else [int(T.Q4_K)])
        assert [s.qtype for s in layer.mlp.down_proj.weight.segments] == [int(T.Q6_K if more else T.Q4_K)]
    assert [use_more_bits(i, 8) for i in range(8)] == [True, False, False, True, False, False, True, True]
    blocks = weight_bytes(t)
    emb = t.embed_tokens.weight.nbytes
    kv = 2 * 8 * 100 * 2 * 64 * 4
    assert bytes_per_token(t, 100) == blocks - emb + emb // 512 + kv
    assert t.embed_tokens.weight.nbytes == 512 * 256 // 256 * 144
    # the CPU's default, as a GGUF file's: the same blocks dequantized by gguf's reference, plain parameters
    plain = random_target("tiny", quant="Q4_K_M", **shape)
    assert not any(isinstance(v, QuantWeight) for m in plain.modules() for v in vars(m).values())
    for name in ("lm_head", "embed_tokens", "layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj"):
        assert torch.equal(plain.get_submodule(name).weight, t.get_submodule(name).weight.dequantize()), name
    assert plain.forward_batch(torch.tensor([[5, 17, 200]])).logits.isfinite().all()


def drafter_target(tmp_path, monkeypatch):
    """A 256-wide qwen3 target (with a tokenizer) for the quantized drafters, and one kernel configuration each."""
    from conftest import write_hf_model
    from test_gguf_target import qwen2_tokenizer

    monkeypatch.setattr(qk, "GEMV_CONFIGS", [(128, 4, 4)])
    monkeypatch.setattr(qk, "SKINNY_CONFIGS", [(128, 4, 4)])
    monkeypatch.setattr(qk, "LANE_K_CONFIGS", [(1, 256, 4, 1)])
    monkeypatch.setattr(qk, "WORD_SKINNY_CONFIGS", [(256, 4, 1, 1)])
    target_dir, _ = write_hf_model(tmp_path / "t", "qwen3", seed=3, vocab=320, hidden_size=256, intermediate_size=256,
                                   head_dim=64, layers=2)
    qwen2_tokenizer(target_dir, 320)
    return target_dir


def proposals_plain_and_kept(art, target_dir):
    """The drafter dequantized and kept in its blocks, each proposing after the same context: (both drafters,
    the dequantized one's proposal, the kept one's)."""
    from strata.dflash.drafter import DFlashDrafter
    from strata.models.loader import load_target

    from conftest import forward_at, observe, propose

    target = load_target(target_dir)
    plain, kept = DFlashDrafter(art, target, max_len=64), DFlashDrafter(art, target, max_len=64, quantized=True)
    ids = torch.tensor([5, 17, 200, 31, 7, 99, 3])
    taps = forward_at(target, ids, 0, target.make_cache(64), [0, 1]).taps
    for d in (plain, kept):
        observe(d, ids.tolist(), 0, taps)
    return (plain, kept), propose(plain, 12, 7, 4), propose(kept, 12, 7, 4)


def test_a_quantized_drafter_kept_in_its_blocks_proposes_what_its_dequantization_does(tmp_path, monkeypatch):
    from strata.dflash.artifact import load_artifact
    from test_interop import write_lcpp_gguf

    target_dir = drafter_target(tmp_path, monkeypatch)
    src = write_hf_drafter(tmp_path / "d", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256,
                           taps=(0, 1), num_target_layers=2, vocab=320, mask_token_id=319, tokenizer=False)
    path = tmp_path / "d.gguf"
    write_lcpp_gguf(path, src, target_dir, matrix_type=T.Q4_K)
    (plain, kept), want, got = proposals_plain_and_kept(load_artifact(path), target_dir)
    assert isinstance(kept.model.layers[0].self_attn.qkv_proj.weight, QuantWeight)
    assert isinstance(kept.model.fc.weight, QuantWeight) and not isinstance(plain.model.fc.weight, QuantWeight)
    assert got.tokens.tolist() == want.tokens.tolist()
    # its Q4_K products take x rounded to int8 per 32 values (quantize_x), as llama.cpp's do
    assert 1e-5 < rel(got.logits, want.logits) <= 2e-3


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 0), (torch.float16, 0), (torch.float16, 128)])
def test_a_norm_quantizes_its_rows_for_the_product_after_it_bit_for_bit(dtype, chunk):
    """rms_norm(quantize=True) returns quantize_x's exact result of its normed rows beside them (one row: the
    GEMVs' layout; a few: the padded rows of the GEMMs'), and the same normed rows as without; also with a
    row's columns split over programs (norm_chunk)."""
    from strata.layers.kernels import norms

    options = KernelOptions(norm_chunk=chunk)
    gen = torch.Generator().manual_seed(12)
    for rows in (1, 5):
        x = torch.randn(rows, 512, generator=gen).to(dtype)
        res = torch.randn(rows, 512, generator=gen).to(dtype)
        w = (torch.rand(512, generator=gen) + 0.5).to(dtype)
        h, got, total = norms.rms_norm(x, w, 1e-6, res, quantize=True, options=options)
        plain_h, none, plain_total = norms.rms_norm(x, w, 1e-6, res, options=options)
        assert none is None and total.equal(plain_total) and h.equal(plain_h)
        want = x8.quantize_x(h)
        assert len(got) == len(want) == (3 if rows == 1 else 2)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype and a.equal(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_quantizes_its_rows_for_the_product_after_it_bit_for_bit(dtype, monkeypatch):
    """attention(quantize_rows) of one query row returns quantize_x's exact result of its output beside it (8
    heads of 64 over 2 K/V heads: each program's head is two blocks of 32); a window of rows quantizes only
    within quantize_rows (at 1 it does not; at 16, the default, it leaves the few-row GEMMs' x, its padding
    rows zeros, written by programs past the window's rows, here over a buffer full of garbage)."""
    from strata.layers.kernels import attention as attn

    gen = torch.Generator().manual_seed(13)
    k, v = torch.randn(2, 90, 2, 64, generator=gen).to(dtype)
    mask = torch.ones(1, 90, dtype=torch.bool)
    q = torch.randn(1, 8, 64, generator=gen).to(dtype)
    out, got = attn.attention(q, k, v, mask, quantize_rows=16)
    assert got is not None and out.equal(attn.attention(q, k, v, mask)[0])
    for a, b in zip(got, x8.quantize_x(out), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and a.equal(b)
    window = torch.randn(5, 8, 64, generator=gen).to(dtype)
    late = torch.arange(90).unsqueeze(0) <= torch.arange(80, 85).unsqueeze(1)
    five, none = attn.attention(window, k, v, late, quantize_rows=1)
    assert none is None
    garbage = [torch.full_like(b, 7) for b in x8.x8_buffers(5, 512, five.device)[0]]
    monkeypatch.setattr(attn, "x8_buffers", lambda rows, k, device: (garbage, 16, 32))
    again, got = attn.attention(window, k, v, late, quantize_rows=16)
    assert got is not None and again.equal(five)
    monkeypatch.undo()
    for a, b in zip(got, x8.quantize_x(five), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and a.equal(b)


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
def test_a_quantized_step_with_norms_quantizing_keeps_its_logits(monkeypatch, shape):
    """A Q4_K_M layer's 1-row and 4-row static steps through the Triton set: with the norms quantizing the
    rows that go into q/k/v, gate/up and the head (where those take int8 x; a MoE layer's experts: one
    row) and attention its rows for o, quantize_x's kernel runs that many times less, as many products are
    handed an int8 x, and every logit is the same as with it run for every product."""
    from strata.layers.kernels import TritonKernels, jit_x8
    from strata.models.random_init import random_target

    from conftest import forward_at

    for name, shapes in (("GEMV_CONFIGS", [(128, 4, 4)]), ("SKINNY_CONFIGS", [(128, 4, 4)]),
                         ("LANE_K_CONFIGS", [(1, 256, 4, 1)]), ("WORD_SKINNY_CONFIGS", [(256, 4, 1, 1)])):
        monkeypatch.setattr(qk, name, shapes)  # wide blocks: few interpreted programs
    moe = dict(moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2) if shape == "tiny-moe" else {}
    target = random_target(shape, quant="Q4_K_M", quantized=True, hidden_size=256, intermediate_size=512,
                           head_dim=64, vocab_size=256, num_hidden_layers=1, **moe)
    launches, handed = [], []

    class Counted:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append(1) or self.kernel[grid](*a, **kw)

    monkeypatch.setattr(jit_x8, "quantize_x_kernel", Counted(jit_x8.quantize_x_kernel))
    for cls, name in ((QuantWeight, "matmul"), (QuantWeight, "gate_up_silu"), (QuantExperts, "assignments")):
        real = getattr(cls, name)

        def counted(self, *a, real=real, **kw):  # whether the product was handed the rows' int8 copy
            handed.append(inspect.signature(real).bind(self, *a, **kw).arguments.get("x8") is not None)
            return real(self, *a, **kw)

        monkeypatch.setattr(cls, name, counted)
    for tokens in (torch.tensor([11]), torch.tensor([11, 200, 3, 97])):
        outs, counts = [], []
        for fused in (False, True):
            launches.clear()
            handed.clear()
            kernels = TritonKernels(compiled=False, options=KernelOptions(quantize_rows=16 if fused else 0))
            outs.append(forward_at(target, tokens, 0, target.make_cache(16), kv_len=16, kernels=kernels).logits)
            counts.append((len(launches), sum(handed)))
        assert outs[1].equal(outs[0])
        # one row: the norms' for q/k/v, gate/up (or the experts') and the head, attention's for o; four rows:
        # the norms' for the few-row GEMMs that take int8 x (q/k/v, the dense gate/up), attention's for o
        fewer = 4 if len(tokens) == 1 else 2 if moe else 3
        assert counts[0][1] == 0 and counts[1][1] == fewer and counts[1][0] == counts[0][0] - fewer, counts


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_expert_gemvs_over_quantized_experts(qtype):
    """expert_matmul: each (row, expert) assignment a GEMV over its own expert's blocks (repeats included),
    the gate/up variant with a row shared by its k assignments, against torch on gguf's dequantization;
    the types with a word GEMV (all six here) run it on each row's int8 x, exactly as on the x
    that int8 x stands for; Q6_K's with its rows at 4-byte (512 columns), 16-byte (2048) and 2-byte (768,
    dense) offsets."""
    e, n, k = 3, 24, 512
    raw = np.stack([blocks(qtype, 2 * n, k, qtype.value + i) for i in range(e)])
    values = torch.from_numpy(np.stack([quants.dequantize(r, qtype) for r in raw]).astype(np.float64))
    data = torch.from_numpy(raw.copy())
    ids = torch.tensor([2, 0, 2, 2])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, k, generator=gen)
    assert qk.int8_x(int(qtype), 1, k) == (qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_XS, T.Q4_0))
    computed = [as_computed(row[None], qtype, k)[0] for row in x]
    want = torch.stack([computed[a // 2] @ values[i].T for a, i in enumerate(ids.tolist())])
    # few programs for the interpreter (the result does not depend on the block shape)
    wide = (2, 4, 1, 1) if qk.int8_x(int(qtype), 1, k) else (16, 4, 1)
    assert rel(qk.expert_matmul(x, data, int(qtype), n, ids, share=2, glu=True, config=wide).double(),
               silu_mul(want)) <= 1e-6
    h = torch.randn(4, k, generator=gen)
    want = torch.stack([as_computed(h[a][None], qtype, k)[0] @ values[i].T for a, i in enumerate(ids.tolist())])
    assert rel(qk.expert_matmul(h, data, int(qtype), 2 * n, ids, config=wide).double(), want) <= 1e-6
    if qtype == T.Q6_K:  # its word GEMV: 2048 columns, superblocks at every offset from a 16-byte boundary
        raw = np.stack([blocks(qtype, 6, 2048, 60 + i) for i in range(2)])
        values = torch.from_numpy(np.stack([quants.dequantize(r, qtype) for r in raw]).astype(np.float64))
        x = torch.randn(2, 2048, generator=gen)
        computed = [as_computed(row[None], qtype, 2048)[0] for row in x]
        want = torch.stack([computed[a // 2] @ values[i].T for a, i in enumerate([1, 0, 1, 1])])
        got = qk.expert_matmul(x, torch.from_numpy(raw.copy()), int(qtype), 3, torch.tensor([1, 0, 1, 1]), share=2,
                               glu=True, config=(1, 2, 4, 1))
        assert qk.int8_x(int(qtype), 1, 2048) and rel(got.double(), silu_mul(want)) <= 1e-6
        raw = blocks(qtype, 5, 768, 70)  # 630-byte rows
        x = torch.randn(1, 768, generator=gen)
        want = as_computed(x, qtype, 768) @ torch.from_numpy(quants.dequantize(raw, qtype)).double().T
        got = qk.matmul(x, torch.from_numpy(raw.copy()), int(qtype), 5, config=(1, 2, 1, 1)).double()
        assert raw.shape == (5, 630) and rel(got, want) <= 1e-6


@pytest.fixture(scope="module")
def q8_moe_file(tmp_path_factory):
    """A qwen3moe GGUF file of Q8_0 experts (2 layers of 4, experts of 0.2 MiB in blocks, 0.75 as values)."""
    from conftest import write_hf_model
    from test_gguf_target import qwen2_tokenizer, write_gguf_target

    d = tmp_path_factory.mktemp("q8-moe")
    hf, _ = write_hf_model(d / "hf", "qwen3_moe", seed=7, vocab=320, hidden_size=256, intermediate_size=256,
                           head_dim=64, layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                           norm_topk_prob=True)
    qwen2_tokenizer(hf, 320)
    write_gguf_target(d / "t.gguf", hf, "qwen3moe", T.Q8_0)
    return d / "t.gguf"


def wide_blocks(monkeypatch) -> None:
    """Few programs for the interpreter (the results do not depend on the block shapes)."""
    monkeypatch.setattr(qk, "GEMV_CONFIGS", [(128, 4, 4)])
    monkeypatch.setattr(qk, "SKINNY_CONFIGS", [(128, 4, 4)])
    monkeypatch.setattr(qk, "LANE_K_CONFIGS", [(1, 256, 4, 1)])
    monkeypatch.setattr(qk, "WORD_SKINNY_CONFIGS", [(256, 4, 1, 1)])


def test_quantized_experts_stay_in_their_blocks(q8_moe_file, monkeypatch):
    """A qwen3moe file's Q8_0 experts kept quantized (QuantExperts): an eager forward (each expert hit
    dequantized for its rows) chooses as the file dequantized at load does, and static decoding (one
    quantized GEMV per assignment) gives its greedy tokens; under an expert cache the device's experts and
    the host's stay in blocks (the host's run by the CPU's kernels), and it still chooses alike, eagerly and
    in static shapes."""
    from strata.engine.decode import Engine
    from strata.layers.kernels import EAGER, Kernels
    from strata.layers.ops import experts_routed, route
    from strata.layers.quant import QuantExperts
    from strata.models.loader import load_target
    from strata.models.placement import place_experts, sparse_layers

    from conftest import forward_at

    wide_blocks(monkeypatch)
    path = q8_moe_file
    plain = load_target(path)
    kept = load_target(path, quantized=True)
    for moe in sparse_layers(kept):
        assert isinstance(moe.gate_up_proj, QuantExperts) and moe.gate_up_proj.qtype == int(T.Q8_0)
        assert moe.gate_up_proj.shape == (4, 512, 256) and moe.down_proj.shape == (4, 256, 256)
    assert weight_bytes(kept) < weight_bytes(plain) / 3
    h = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    ours, theirs = sparse_layers(kept)[1], sparse_layers(plain)[1]
    weights, experts = route(h, theirs.gate.weight, 2, True)
    want = experts_routed(h, theirs.gate_up_proj, theirs.down_proj, weights, experts)
    # eager: each expert dequantized for its rows
    assert rel(EAGER.experts(h, ours.gate_up_proj, ours.down_proj, weights, experts), want) <= 1e-5

    def int8_expert(x, e):  # static: Q8_0's word GEMV per assignment, on int8 x (each row, and its activations)
        gate_up = as_computed(x[None], T.Q8_0, 256) @ theirs.gate_up_proj[:, e].reshape(512, 256).double().T
        return as_computed(silu_mul(gate_up).float(), T.Q8_0, 256) @ theirs.down_proj[e].double().T

    want = torch.stack([sum(w * int8_expert(x, e)[0] for w, e in zip(ws.double(), es.tolist()))
                        for x, ws, es in zip(h, weights, experts)])
    assert rel(Kernels(static=True).experts(h, ours.gate_up_proj, ours.down_proj, weights, experts).double(),
               want) <= 1e-5
    prompt = torch.tensor([5, 17, 200, 31, 7, 99])

    def choices(target):
        logits = forward_at(target, prompt, 0, target.make_cache(64)).logits
        return logits.argmax(-1), logits

    want, logits = choices(plain)
    tokens = Engine(plain, max_len=64).generate(prompt.tolist(), 4).output_ids
    assert len(set(tokens)) > 1 and Engine(kept, max_len=64, backend="static").generate(prompt.tolist(), 4).output_ids == tokens
    for mib, device in ((None, 8), (2, 8), (1, 5), (0, 0)):  # 8 experts of 0.2 MiB in Q8_0
        target = kept if mib is None else load_target(path, quantized=True,
                                                      place=lambda m: place_experts(m, "cpu", mib, 64))
        moes = sparse_layers(target)
        assert all(moe.quantized for moe in moes) and sum(moe.device_experts for moe in moes) == device
        if mib is not None:
            report = target.expert_plan.report()
            assert target.expert_plan.on_device == device and "(in their GGUF blocks)" in report
            assert f"{8 - device} ({(8 - device) * 3 * 256 * 256 * 34 / 32 / 2 ** 20:.1f} MiB, in their GGUF blocks)" \
                in report
        assert all(moe.gate_up_proj.takes_int8(1) == (moe.device_experts > 0) for moe in moes)  # Q8_0: int8 x
        if mib == 1:  # layer 0 keeps experts 0-2 on the device, its expert 3 in host memory (blocks both)
            assert [moe.device_experts for moe in moes] == [3, 2]
            host = host_blocks.dequantize(moes[0].host_down.data[0], T.Q8_0, 256)
            assert torch.equal(host, sparse_layers(plain)[0].down_proj[3])
            assert Engine(target, max_len=64, backend="static").generate(prompt.tolist(), 2).output_ids == tokens[:2]
        if mib != 2:
            got, got_logits = choices(target)
            assert got.equal(want) and rel(got_logits, logits) <= 0.05


def test_quantized_experts_move_by_prefill_and_a_mixed_layer_stays_values(q8_moe_file, monkeypatch):
    """--expert-placement prefill over quantized experts: the first prefill swaps blocks between the device
    and host memory (both equal the file's), and static decoding keeps the tokens; a layer whose down
    experts the kernels cannot take keeps none in blocks."""
    import strata.models.loader as loader
    from strata.engine.decode import Engine
    from strata.models.loader import load_target
    from strata.models.placement import place_experts, sparse_layers

    wide_blocks(monkeypatch)
    path = q8_moe_file
    plain, kept = load_target(path), load_target(path, quantized=True)
    prompt = [5, 17, 200, 31, 7, 99]
    tokens = Engine(plain, max_len=64).generate(prompt, 2).output_ids
    target = load_target(path, quantized=True, place=lambda m: place_experts(m, "cpu", 1, 64, by="prefill"))
    Engine(target, max_len=64).runner.prefill(prompt)  # blocks move on, the leaving experts' blocks off
    assert target.expert_plan.moved > 0
    assert Engine(target, max_len=64, backend="static").generate(prompt, 2).output_ids == tokens
    with monkeypatch.context() as m:  # without a C compiler the host keeps values and a copy of their blocks
        m.setattr(host_blocks, "library", lambda: None)
        values = load_target(path, quantized=True, place=lambda m: place_experts(m, "cpu", 1, 64, by="prefill"))
        assert "MiB, dequantized)" in values.expert_plan.report()
        Engine(values, max_len=64).runner.prefill(prompt)  # blocks move on, the leaving experts' values off
        assert values.expert_plan.moved > 0 and all(moe.host_blocks is None for moe in sparse_layers(values))
        assert Engine(values, max_len=64, backend="static").generate(prompt, 2).output_ids == tokens
    blocks = [(moe.gate_up_proj.data.clone(), moe.down_proj.data.clone()) for moe in sparse_layers(kept)]
    real = loader.experts_in_blocks  # down experts of a type the kernels lack (a Q3_K_M file's gate/up): none kept
    monkeypatch.setattr(loader, "experts_in_blocks", lambda src, *a: "down" not in src[0][0] and real(src, *a))
    built = []  # and none built only to be let go
    monkeypatch.setattr(loader, "quantized_experts", lambda *a: built.append(a) or None)
    for moe, ref in zip(sparse_layers(load_target(path, quantized=True)), sparse_layers(plain)):
        assert not moe.quantized and moe.gate_up_proj.equal(ref.gate_up_proj) and moe.down_proj.equal(ref.down_proj)
    assert not built
    for moe, ref, (gate_up, down) in zip(sparse_layers(target), sparse_layers(plain), blocks):
        for e, s in enumerate(moe.slot):
            if s >= 0:
                assert moe.gate_up_proj.data[s].equal(gate_up[e]) and moe.down_proj.data[s].equal(down[e])
            else:
                assert moe.host_gate_up.data[-1 - s].equal(gate_up[e]) and moe.host_down.data[-1 - s].equal(down[e])


def test_random_quantized_moe_targets_keep_their_experts_in_blocks():
    """`strata bench --shape qwen3-30b-a3b --quant Q4_K_M` builds these: experts as QuantExperts (gate/up
    Q4_K, down Q6_K in the 'more bits' layers, as llama.cpp types ffn_*_exps), the router a plain matrix;
    a token reads top-k experts' blocks; on the CPU the same blocks dequantized by gguf's reference."""
    from strata.bench.run import bytes_per_token
    from strata.layers.quant import QuantExperts, use_more_bits
    from strata.models.placement import sparse_layers
    from strata.models.random_init import random_target

    shape = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64, vocab_size=512,
                 num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)
    t = random_target("tiny-moe", quant="Q4_K_M", quantized=True, **shape)
    moes = sparse_layers(t)
    for i, moe in enumerate(moes):
        assert isinstance(moe.gate_up_proj, QuantExperts) and isinstance(moe.gate.weight, torch.nn.Parameter)
        assert moe.gate_up_proj.qtype == int(T.Q4_K)
        assert moe.down_proj.qtype == int(T.Q6_K if use_more_bits(i, 2) else T.Q4_K)
    assert [moe.down_proj.qtype for moe in moes] == [int(T.Q4_K), int(T.Q6_K)]
    expert = [(moe.gate_up_proj.nbytes + moe.down_proj.nbytes) // 4 for moe in moes]
    assert [moe.expert_bytes for moe in moes] == expert == [2 * 256 * 144 + 256 * 144, 2 * 256 * 144 + 256 * 210]
    emb = t.embed_tokens.weight.nbytes
    assert bytes_per_token(t, 0) == weight_bytes(t) - emb + emb // 512 - 4 * sum(expert) + 2 * sum(expert)
    plain = random_target("tiny-moe", quant="Q4_K_M", **shape)
    for ours, kept in zip(sparse_layers(plain), moes):
        gate_up, down = (torch.from_numpy(quants.dequantize(q.data.numpy(), q.qtype).copy())
                         for q in (kept.gate_up_proj, kept.down_proj))
        assert torch.equal(ours.gate_up_proj, gate_up.view(4, 2, 256, 256).transpose(0, 1))
        assert torch.equal(ours.down_proj, down)


def test_the_autotuners_keep_their_measurements_on_disk():
    """Built outside the interpreter (in a process of its own; building needs no GPU), every autotuned kernel
    keeps what it measured in Triton's cache directory (cache_results), so that a restarted server does not
    tune again. The lanes-along-K GEMVs' tuners key by LANE_K_TUNE_KEY, each name a parameter of their kernel
    (_word_gemv keys the shapes they chose without prefetching by it); every tuner whose kernel serves
    several types keys by QTYPE, so that no type takes a shape another chose (in a process, or from the
    disk: a Q4_0 bench's choices for skinny_q4k8 once made the next run's Q4_K_M GEMMs 38% slower, its
    verify 21%), and by STACK_ROWS where it takes it (an A/B of glu_stack_rows)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys; sys.path.insert(0, sys.argv[1]); from strata.layers.kernels import quantized as qk; "
              "k = qk.kernels(); tuned = [n for n in k if n.endswith('_tuned')]; "
              "lanes = [k[n + '_tuned'] for n in set(qk.INT8_GEMVS.values())]; "
              "print(len(tuned), all(k[n].cache_results for n in tuned), len(lanes), "
              "all(t.keys == list(qk.LANE_K_TUNE_KEY) and set(t.keys) <= set(t.fn.arg_names) for t in lanes), "
              "[(n, a) for n in tuned for a in ('QTYPE', 'STACK_ROWS') if a in k[n].fn.arg_names "
              "and a not in k[n].keys])")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).resolve().parents[1] / "src")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["9", "True", "3", "True", "[]"], out.stdout


def test_the_gemvs_block_shape_is_chosen_without_prefetching(monkeypatch):
    """Where the device tunes the 1-row GEMVs (stood in for by the interpreted kernel at one shape), a shape's
    first product launches once without prefetching (the tuner chooses there) and then with gemv_prefetch;
    later products of that shape launch with it only, and a product without the setting never prefetches.
    The results are the same (a prefetch only asks lines into L2: the interpreter skips it)."""
    raw = blocks(T.Q4_K, 64, 256, 81)
    data = torch.from_numpy(raw.copy())
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    want = qk.matmul(x, data, int(T.Q4_K), 32, glu=True)
    kernel, launches = qk.kernels()["gemv_q4k8c"], []

    class Tuned:
        def __getitem__(self, grid):
            meta = {"RT": 4, "WARPS": 2, "KU": 1, "KS": 1}

            def launch(*args, **kw):
                launches.append(kw["PREFETCH"])
                kernel[grid(meta)](*args, **meta, **kw)
            return launch

    monkeypatch.setitem(qk.kernels(), "gemv_q4k8c_tuned", Tuned())
    for _ in range(2):
        assert qk.matmul(x, data, int(T.Q4_K), 32, glu=True, options=KernelOptions(gemv_prefetch=2 ** 21)).equal(want)
    assert launches == [0, 2 ** 21, 2 ** 21]
    without = KernelOptions(gemv_prefetch=0)
    assert qk.matmul(x, data, int(T.Q4_K), 16, options=without).equal(
        qk.matmul(x, data, int(T.Q4_K), 16, config=(4, 2, 1, 1)))
    assert launches == [0, 2 ** 21, 2 ** 21, 0]


def test_the_bench_checks_each_quantized_type_against_its_blocks_dequantized(monkeypatch):
    """strata bench first runs one product of each type the model holds (a fused matrix's segments
    included) at each row count it will time, through the kernels the decode runs, against the blocks
    dequantized; a kernel whose products are off stops it, naming the type and the row count."""
    from strata.bench import run

    model = torch.nn.Module()
    model.device, model.dtype = torch.device("cpu"), torch.float32
    model.qkv = QuantWeight([Segment(int(T.Q4_0), torch.from_numpy(blocks(T.Q4_0, 6, 512, 1))),
                             Segment(int(T.IQ4_XS), torch.from_numpy(blocks(T.IQ4_XS, 4, 512, 2)))], 512, torch.float32)
    errors = run.product_check(model, (1, 3))
    assert list(errors) == ["Q4_0-1", "Q4_0-3", "IQ4_XS-1", "IQ4_XS-3"]
    assert all(1e-4 < e <= 2e-2 for e in errors.values())  # int8 x's rounding, nothing more
    matmul = qk.matmul
    monkeypatch.setattr(qk, "matmul", lambda x, data, qtype, n, **kw: matmul(x, data, qtype, n, **kw) *
                        (1.5 if qtype == int(T.IQ4_XS) and x.shape[0] > 1 else 1.0))
    with pytest.raises(RuntimeError, match=r"IQ4_XS-3 rows: 5\.0\de-01"):
        run.product_check(model, (1, 3))


def test_a_quantized_dflash2_drafter_keeps_its_matrices_in_blocks(tmp_path, monkeypatch):
    """A Q8_0 DFlash2 drafter (what llama-quantize makes of one: its matrices in blocks, its convolutions' kernel
    projections among them) kept in its blocks drafts what its dequantization does: the same walk, close logits
    and confidences; the selector's codebooks, read by rows, are dequantized."""
    from strata.dflash.artifact import load_artifact
    from strata.dflash.converter import convert_hf_to_gguf

    target_dir = drafter_target(tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(8)
    extra = {"candidate_selector.predecessor_codebook": torch.randn(320, 32, generator=gen) * 0.2,
             "candidate_selector.successor_codebook": torch.randn(320, 32, generator=gen) * 0.2,
             "candidate_selector.hidden_projection.weight": torch.randn(32, 256, generator=gen) * 0.2}
    for conv in ("attention_conv", "mlp_conv"):
        base = torch.randn(2, 2, 256, generator=gen) * 0.1
        base[:, 0] += 1
        extra[f"layers.0.{conv}.base_kernel"] = base
        extra[f"layers.0.{conv}.kernel_projection.weight"] = torch.randn(2 * 2 * 16, 256, generator=gen) * 0.05
    dcfg = {"mask_token_id": 319, "target_layer_ids": [0, 1], "conv_kernel_size": 2, "conv_group_size": 16,
            "selector_rank": 32, "selector_top_k": 4}
    src = write_hf_drafter(tmp_path / "d", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256,
                           taps=(0, 1), num_target_layers=2, vocab=320, mask_token_id=319, tokenizer=False,
                           extra_config={"architectures": ["DFlash2DraftModel"], "dflash_config": dcfg},
                           extra_tensors={k: v.to(torch.bfloat16) for k, v in extra.items()})
    path = tmp_path / "d2-q8_0.gguf"
    convert_hf_to_gguf(src, path, target_dir, qtype="Q8_0", progress=False)  # as llama-quantize Q8_0 leaves it
    art = load_artifact(path)
    assert {art.types[n] for n in ("layers.0.attention_conv.kernel_projection.weight",
                                   "candidate_selector.successor_codebook")} == {"Q8_0"}
    (_, kept), want, got = proposals_plain_and_kept(art, target_dir)
    assert isinstance(kept.model.layers[0].attention_conv.kernel_projection.weight, QuantWeight)
    assert not isinstance(kept.model.candidate_selector.predecessor_codebook, QuantWeight)
    assert got.tokens.tolist() == want.tokens.tolist()
    # x rounded to int8 per 32 values in every Q8_0 product, the convolutions' kernels among them (the DFlash
    # test's drafter in Q8_0 measures 0.9e-2); a row or block out of place would be O(1)
    assert 1e-6 < rel(got.logits, want.logits) <= 5e-2
    assert (got.confidence - want.confidence).abs().max() <= 2e-2


def test_a_quantized_dspark_drafter_keeps_its_matrices_in_blocks(tmp_path, monkeypatch):
    """A Q8_0 DSpark drafter (llama-quantize's Q8_0 of one): its layers' matrices and fc in their blocks, its Markov
    head's codebooks read by rows (dequantized) and its one-row confidence head as stored; kept in its blocks it
    drafts what its dequantization drafts from the anchor: the same chain, close logits and confidences."""
    from strata.dflash.artifact import load_artifact
    from strata.dflash.converter import convert_hf_to_gguf

    target_dir = drafter_target(tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(9)
    extra = {"markov_head.markov_w1.weight": torch.randn(320, 32, generator=gen) * 0.2,
             "markov_head.markov_w2.weight": torch.randn(320, 32, generator=gen) * 0.2,
             "confidence_head.proj.weight": torch.randn(1, 256 + 32, generator=gen) * 0.1,
             "confidence_head.proj.bias": torch.zeros(1)}
    src = write_hf_drafter(tmp_path / "d", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256,
                           taps=(0, 1), num_target_layers=2, vocab=320, mask_token_id=319, tokenizer=False,
                           extra_config={"architectures": ["DSparkDraftModel"]},
                           extra_tensors={k: v.to(torch.bfloat16) for k, v in extra.items()})
    path = tmp_path / "ds-q8_0.gguf"
    convert_hf_to_gguf(src, path, target_dir, qtype="Q8_0", progress=False)
    art = load_artifact(path)
    assert art.cfg.variant == "dspark" and art.types["markov_head.markov_w1.weight"] == "Q8_0"
    (_, kept), want, got = proposals_plain_and_kept(art, target_dir)
    assert isinstance(kept.model.fc.weight, QuantWeight)
    assert not isinstance(kept.model.markov_head.markov_w1.weight, QuantWeight)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert 1e-6 < rel(got.logits, want.logits) <= 5e-2
    assert (got.confidence - want.confidence).abs().max() <= 2e-2
