"""Experts an expert cache keeps in host memory run by the CPU in their GGUF blocks (layers/kernels/host_blocks.c):
every type decodes bit for bit as gguf does, the SwiGLU products over a layer's (expert, rows) groups hold to a
float64 reference, and a quantized MoE target placed partly in host memory keeps its blocks there and decodes
the same tokens as with every expert on the device."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from strata.engine.decode import Engine
from strata.layers.kernels import host_blocks
from strata.layers.kernels.qtypes import KERNEL_TYPES
from strata.layers.quant import QuantExperts, random_blocks
from strata.models.loader import load_target
from strata.models.placement import place_experts, sparse_layers

from conftest import write_hf_model
from test_gguf_target import qwen2_tokenizer, write_gguf_target


def test_every_type_decodes_as_gguf_does():
    assert host_blocks.library() is not None, "the CPU's kernels need a C compiler (cc)"
    gen = torch.Generator().manual_seed(5)
    for qtype in KERNEL_TYPES:
        data = random_blocks(qtype, 12, 768, "cpu", gen)
        want = gguf_dequantize(data.numpy(), qtype).reshape(12, 768)
        got = host_blocks.dequantize(data, qtype, 768).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), qtype.name


def test_expert_groups_hold_to_a_float64_reference():
    """Groups of one and of several rows, a row in several groups, gate/up and down of different types."""
    gen = torch.Generator().manual_seed(6)
    experts, hidden, inter = 5, 512, 256
    for gu_type, dn_type in ((T.Q4_K, T.Q6_K), (T.Q8_0, T.Q5_K), (T.IQ4_XS, T.Q3_K), (T.Q4_0, T.IQ3_XXS)):
        gate_up = QuantExperts(gu_type, random_blocks(gu_type, experts * 2 * inter, hidden, "cpu", gen)
                               .view(experts, 2 * inter, -1), hidden, torch.float32)
        down = QuantExperts(dn_type, random_blocks(dn_type, experts * hidden, inter, "cpu", gen)
                            .view(experts, hidden, -1), inter, torch.float32)
        x = torch.randn(4, hidden, generator=gen)
        groups = [(1, [0, 2]), (4, [3]), (0, [0, 1, 2, 3])]
        y = gate_up.swiglu_pairs(down, x, groups)
        for p, (e, r) in enumerate((e, r) for e, rows in groups for r in rows):
            w1 = torch.from_numpy(gguf_dequantize(gate_up.data[e].numpy(), gu_type)).double()
            w2 = torch.from_numpy(gguf_dequantize(down.data[e].numpy(), dn_type)).double()
            h = w1 @ x[r].double()
            want = w2 @ (F.silu(h[:inter]) * h[inter:])
            assert ((y[p].double() - want).norm() / want.norm()).item() < 1e-5, (gu_type.name, p)


def experts_in_blocks(path):
    """The GGUF target with its experts in their blocks (QuantExperts) and every other matrix dequantized by gguf's
    reference (so that only the experts' products run over blocks, none in the interpreter but the device's)."""
    from strata.gguf_file import reference_values
    from strata.layers.quant import QuantWeight

    target = load_target(path, quantized=True)
    for module in target.modules():
        for attr, w in list(vars(module).items()):
            if isinstance(w, QuantWeight):
                values = torch.cat([reference_values(s.data.numpy(), s.qtype) for s in w.segments])
                delattr(module, attr)
                module.register_parameter(attr, torch.nn.Parameter(values, requires_grad=False))
    return target


def test_a_quantized_moe_target_keeps_its_host_experts_in_blocks(tmp_path):
    """Q4_K experts, half of them, then all, in host memory: the same tokens as the file dequantized; the host
    keeps their blocks, the plan counts them so, and the first prefill's routing swaps blocks between the
    device and the host (replace) without changing any expert."""
    hf, _ = write_hf_model(tmp_path / "hf", "qwen3_moe", seed=9, vocab=320, hidden_size=256, intermediate_size=256,
                           head_dim=64, layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                           norm_topk_prob=True)
    qwen2_tokenizer(hf, 320)
    path = tmp_path / "t.gguf"
    write_gguf_target(path, hf, "qwen3moe", T.Q4_K, seed=3)
    prompt = [3, 99, 14, 250, 8, 8, 41]
    want = Engine(load_target(path), max_len=64).generate(prompt, 8).output_ids
    expert_bytes = 3 * 256 * 256 * 144 // 256
    half = experts_in_blocks(path)
    blocks = [(m.gate_up_proj.data.clone(), m.down_proj.data.clone()) for m in sparse_layers(half)]
    for m in sparse_layers(half):
        m.place([0, 1], keep_blocks=True, count=True)
        assert m.host_experts == 2 and isinstance(m.host_down, QuantExperts) and m.host_expert_bytes == expert_bytes
    assert Engine(half, max_len=64).generate(prompt, 8).output_ids == want
    for m, (gate_up, down) in zip(sparse_layers(half), blocks):
        assert m.replace([1, 3]) == 1 and m.slot == [-2, 1, -1, 0]
        for e, (stack, host) in enumerate(((m.gate_up_proj, m.host_gate_up), (m.down_proj, m.host_down))):
            rebuilt = torch.stack([stack.data[s] if s >= 0 else host.data[-1 - s] for s in m.slot])
            assert torch.equal(rebuilt, (gate_up, down)[e])
    assert Engine(half, max_len=64).generate(prompt, 8).output_ids == want
    everything = experts_in_blocks(path)
    place_experts(everything, "cpu", 0, 64)
    assert [m.host_experts for m in sparse_layers(everything)] == [4, 4]
    plan = everything.expert_plan
    assert plan.host_expert_bytes == expert_bytes and ": 8 (0.8 MiB, in their GGUF blocks)" in plan.report()
    assert Engine(everything, max_len=64).generate(prompt, 8).output_ids == want
