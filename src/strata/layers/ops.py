"""The reference math of every block, written once: the CPU path, the eager GPU path, and what the
compiled and Triton kernels (kernels.py) must reproduce up to accumulation order.

Activations are [..., T, features]: one sequence, or a batch of them (training) in front."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, cast back, then scale (the Hugging Face order of rounding)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """A residual add and the norm after it, one fused group when compiled. Returns (sum, normed)."""
    x = x + residual
    return x, rms_norm(x, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (rotate-half) RoPE with the cos/sin rows of x's positions."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def head_weights(q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Per-head norm weights of a fused q/k ([heads + kv_heads, head_dim])."""
    return torch.cat([q_weight.expand(heads, -1), k_weight.expand(kv_heads, -1)])


def store(k_cache: torch.Tensor, v_cache: torch.Tensor, cells: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> None:
    """Rows of k/v into the cache cells named by a device tensor (no host value read: graph-safe). Under
    autocast the rows may come in a lower precision than the cache holds. cells [B, T] with a cache of B
    sequences [B, cells, ...]: each sequence's rows into its own cells."""
    if cells.dim() > 1:
        seq = torch.arange(cells.shape[0], device=cells.device).unsqueeze(-1)
        k_cache[seq, cells] = k.to(k_cache.dtype)
        v_cache[seq, cells] = v.to(v_cache.dtype)
        return
    k_cache.index_copy_(-3, cells, k.to(k_cache.dtype))
    v_cache.index_copy_(-3, cells, v.to(v_cache.dtype))


def norm_rotate_store(qk: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                      k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float, heads: int,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """A fused q/k ([..., T, H + Hkv, D]): per-head RMSNorm (when the model has q/k norms), RoPE, k and v
    stored at their cells. Compiled, the cache writes ride in the same kernel group. Returns q."""
    if q_weight is not None:
        qk = rms_norm(qk, head_weights(q_weight, k_weight, heads, qk.shape[-2] - heads), eps)
    q, k = rotate(qk, cos, sin).split([heads, qk.shape[-2] - heads], dim=-2)
    store(k_cache, v_cache, cells, k, v)
    return q


def norm_rotate_store_kv(k: torch.Tensor, v: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         cells: torch.Tensor) -> None:
    """The key side alone (a drafter's context K/V): k norm, RoPE and both cache writes in one group."""
    store(k_cache, v_cache, cells, rotate(rms_norm(k, k_weight, eps), cos, sin), v)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention through PyTorch's SDPA. q: [..., T, H, D]; k, v: [..., S, Hkv, D]; mask:
    [..., T, S] bool (True = visible). Returns [..., T, H*D]."""
    *lead, t, h, d = q.shape
    if mask.dim() > 2:
        mask = mask.unsqueeze(-3)  # broadcast over heads
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), attn_mask=mask, scale=d ** -0.5,
        enable_gqa=h != k.shape[-2],  # K/V heads are shared by groups of query heads without copies
    )
    return out.transpose(-3, -2).reshape(*lead, t, h * d)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [Hkv, T, G, S] (the matmul's dtype) -> probabilities in that dtype, softmax in float32."""
    t, s = mask.shape
    x = scores.float().mul(scale).masked_fill(~mask.view(1, t, 1, s), float("-inf"))
    return torch.softmax(x, dim=-1).to(scores.dtype)


def attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   softmax=masked_softmax) -> torch.Tensor:
    """The same attention for one sequence as two batched matmuls per K/V head: the query heads of a
    group become extra rows, so no K/V is copied and no general kernel is chosen for a few queries
    over a long cache. q: [T, H, D]; k, v: [S, Hkv, D]; mask: [T, S] bool. Returns [T, H*D]."""
    t, h, d = q.shape
    s, hk, _ = k.shape
    g = h // hk
    qg = q.reshape(t, hk, g, d).permute(1, 0, 2, 3).reshape(hk, t * g, d)
    scores = torch.bmm(qg, k.permute(1, 2, 0)).view(hk, t, g, s)
    probs = softmax(scores, mask, d ** -0.5).view(hk, t * g, s)
    out = torch.bmm(probs, v.permute(1, 0, 2))  # [Hkv, T*G, D]
    return out.view(hk, t, g, d).permute(1, 0, 2, 3).reshape(t, h * d)


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool):
    """Qwen3-MoE routing of rows h [N, H]: the router's logits in h's dtype, softmax in float32, the top-k
    (renormalised to sum 1 when asked), cast back. Returns (weights [N, k], experts [N, k] int64), each
    row's pairs in ascending expert order (the order its outputs are summed in)."""
    logits = F.linear(h, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return by_expert(weights.to(logits.dtype), experts)


def expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e of the stacks (gate_up [2, E, I, H], down [E, H, I]) over rows x [n, H]: a SwiGLU MLP.
    Quantized stacks (layers/quant.QuantExperts) give expert e's values, its gate rows then its up rows."""
    if not isinstance(down, torch.Tensor):
        gate, up = gate_up.values(e).chunk(2)
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down.values(e))
    return F.linear(F.silu(F.linear(x, gate_up[0, e])) * F.linear(x, gate_up[1, e]), down[e])


def by_expert(weights: torch.Tensor, experts: torch.Tensor):
    """Each row's (weight, expert) pairs in ascending expert order, the order a row's outputs are summed in."""
    experts, order = torch.sort(experts, dim=-1, stable=True)
    return weights.gather(-1, order), experts


def sum_slots(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert outputs y [N, k, H] (slots in ascending expert order) weighted and summed from zero slot by
    slot, rounding as experts_routed does."""
    out = torch.zeros(y.shape[0], y.shape[-1], dtype=dtype, device=y.device)
    for j in range(y.shape[1]):
        out = out + (y[:, j] * weights[:, j, None]).to(dtype)
    return out


def experts_routed(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                   experts: torch.Tensor) -> torch.Tensor:
    """Each expert that a row was routed to, over its rows only; a row's weighted outputs summed from zero
    in ascending expert order (transformers' order). The host reads which experts were hit, so this is
    the eager path. h [N, H]; gate_up [2, E, I, H] (every expert's gate, then every expert's up); down
    [E, H, I]; weights, experts [N, k] as route gives them (each row's pairs in ascending expert order)."""
    out = torch.zeros_like(h)
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)
        out.index_add_(0, rows, (expert(h[rows], gate_up, down, e) * weights[rows, slot, None]).to(out.dtype))
    return out


def experts_gathered(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                     experts: torch.Tensor, reduce=sum_slots) -> torch.Tensor:
    """experts_routed in static shapes, with no host read (CUDA-graph safe): slot by slot, every row's
    expert matrices gathered on the device and applied as batched matrix-vector products; the outputs
    [N, k, H] summed by reduce (sum_slots' contract)."""
    x = h[:, :, None]
    y = []
    for e in experts.T:
        a = F.silu(torch.bmm(gate_up[0, e], x)) * torch.bmm(gate_up[1, e], x)
        y.append(torch.bmm(down[e], a)[..., 0])
    return reduce(torch.stack(y, dim=1), weights, h.dtype)


def experts_grouped(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor, reduce=sum_slots) -> torch.Tensor:
    """experts_routed in static shapes, with no host read (CUDA-graph safe), reading only the experts hit:
    every (row, expert) pair sorted by expert, each expert's rows one group of a grouped GEMM
    (torch._grouped_mm); the outputs [N, k, H] summed by reduce (sum_slots' contract)."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    perm = torch.argsort(flat, stable=True)
    counts = torch.zeros(down.shape[0], dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = h.index_select(0, perm // k)
    a = F.silu(torch._grouped_mm(x, gate_up[0].mT, offs=offs)) * torch._grouped_mm(x, gate_up[1].mT, offs=offs)
    y = torch.empty_like(x).index_copy_(0, perm, torch._grouped_mm(a, down.mT, offs=offs)).view(n, k, -1)
    return reduce(y, weights, h.dtype)


def grouped_gemm_fits(h: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these experts: on the CPU, or bfloat16 on a GPU (its CUDA kernels'
    only type)."""
    return h.device.type == "cpu" or h.dtype == torch.bfloat16


def experts_placed(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, host_gate_up: torch.Tensor,
                   host_down: torch.Tensor, slot: list[int], weights: torch.Tensor, experts: torch.Tensor,
                   timing: dict | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """experts_routed with each expert on the device or in host memory (an expert cache): slot[e] >= 0
    indexes expert e in gate_up/down, slot[e] < 0 indexes host_gate_up/host_down at -1 - slot[e]. One host
    read of the routing; the device's experts are queued first, so they run while the CPU computes its
    own. Each expert sees exactly the rows experts_routed gives it and every row's outputs are summed in
    ascending expert order, so placement never changes the result. timing: seconds accumulate under
    "routing_read" (waiting for the device's work up to the routing) and "host_experts" (the CPU's
    experts with their copies). counts [E]: each expert's rows added (the placement's routing count)."""
    t0 = time.perf_counter()
    routed = experts.cpu()
    t1 = time.perf_counter()
    if counts is not None:
        counts += torch.bincount(routed.flatten(), minlength=counts.numel())
    host_s = 0.0
    y = torch.zeros(*routed.shape, h.shape[-1], dtype=h.dtype, device=h.device)
    hit = torch.unique(routed).tolist()
    for e in hit:
        if slot[e] >= 0:
            rows, slots = (t.to(h.device) for t in torch.where(routed == e))
            y[rows, slots] = expert(h[rows], gate_up, down, slot[e])
    if any(slot[e] < 0 for e in hit):
        t2 = time.perf_counter()
        host_y, host = host_expert_outputs(h.cpu(), routed, host_gate_up, host_down, slot)
        y = torch.where(host.to(h.device)[..., None], host_y.to(h.device), y)
        host_s = time.perf_counter() - t2
    if timing is not None:
        timing["routing_read"] = timing.get("routing_read", 0.0) + t1 - t0
        timing["host_experts"] = timing.get("host_experts", 0.0) + host_s
    return sum_slots(y, weights, h.dtype)


def host_expert_outputs(hx: torch.Tensor, routed: torch.Tensor, host_gate_up: torch.Tensor, host_down: torch.Tensor,
                        slot: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """On the host, rows hx [N, H] through those of their experts (routing `routed` [N, k]) that live in host
    memory (slot[e] < 0, as experts_placed): their outputs [N, k, H] (zero elsewhere) and where they are
    [N, k] (bool)."""
    y = torch.zeros(*routed.shape, hx.shape[-1], dtype=hx.dtype)
    host = torch.zeros(routed.shape, dtype=torch.bool)
    pairs: dict[int, tuple[list[int], list[int]]] = {}  # grouped in Python: a decode's few pairs, no torch op each
    for r, row in enumerate(routed.tolist()):
        for j, e in enumerate(row):
            if slot[e] < 0:
                rows, slots = pairs.setdefault(e, ([], []))
                rows.append(r)
                slots.append(j)
    if pairs and not isinstance(host_down, torch.Tensor):  # GGUF blocks: every expert in one call of the CPU's kernels
        order = sorted(pairs)
        out = host_gate_up.swiglu_pairs(host_down, hx, [(-1 - slot[e], pairs[e][0]) for e in order])
        rows = [r for e in order for r in pairs[e][0]]
        slots = [j for e in order for j in pairs[e][1]]
        y[rows, slots] = out.to(hx.dtype)
        host[rows, slots] = True
        return y, host
    for e in sorted(pairs):
        rows, slots = pairs[e]
        if len(rows) == 1:  # plain indexing: no index tensors made
            y[rows[0], slots[0]] = expert(hx[rows[0]][None], host_gate_up, host_down, -1 - slot[e])[0]
        else:
            y[rows, slots] = expert(hx[rows], host_gate_up, host_down, -1 - slot[e])
    if pairs:
        host[[r for rows, _ in pairs.values() for r in rows], [j for _, slots in pairs.values() for j in slots]] = True
    return y, host


def causal_conv(x_full: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A depthwise causal convolution and SiLU: x_full [K-1+T, C] (the K-1 inputs before the rows, then the
    rows), weight [C, K] -> [T, C] (PyTorch's conv1d, as transformers runs it)."""
    out = F.conv1d(x_full.t()[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])
    return F.silu(out[0].t()).to(x_full.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def value_heads(x: torch.Tensor, heads: int, tiled: bool) -> torch.Tensor:
    """Key heads x [..., Hk, D] repeated to the value heads they serve: each Hv / Hk times in a row, or with
    tiled the whole set Hv / Hk times (value head j reads key head j % Hk)."""
    rep = heads // x.shape[-2]
    return x.repeat(*(1,) * (x.dim() - 2), rep, 1) if tiled else x.repeat_interleave(rep, -2)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, rows: torch.Tensor | None = None, tiled: bool = False):
    """The gated delta rule, token by token in float32: q, k [T, Hk, Dk] (l2-normalised here, q scaled by
    Dk^-0.5, each key head serving Hv / Hk value heads: in a row, or with tiled every Hk-th, as llama.cpp's
    qwen35 files order them), v [T, Hv, Dv], g (log decay) and beta [T, Hv], state [Hv, Dk, Dv] before
    row 0. Returns (outputs [T, Hv, Dv], the state after the rows). rows (a 0-dim device tensor): the state
    after only the first `rows` rows (a rollback's replay; no host read, the later rows leave the state as
    it is)."""
    q, k = value_heads(l2norm(q.float()), v.shape[1], tiled), value_heads(l2norm(k.float()), v.shape[1], tiled)
    q = q / (q.shape[-1] ** 0.5)
    v, g, beta = v.float(), g.float(), beta.float()
    outs = []
    for t in range(q.shape[0]):
        new = state * g[t].exp()[:, None, None]
        delta = (v[t] - (new * k[t][:, :, None]).sum(dim=-2)) * beta[t][:, None]
        new = new + k[t][:, :, None] * delta[:, None, :]
        state = new if rows is None else torch.where(rows > t, new, state)
        outs.append((state * q[t][:, :, None]).sum(dim=-2))
    return torch.stack(outs), state


def delta_inputs(conv0: torch.Tensor, proj: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                 dt_bias: torch.Tensor, k_heads: int, v_heads: int, k_dim: int, v_dim: int):
    """Gated DeltaNet's inputs to the delta rule from its input projection proj [T, C + Hv*Dv + 2Hv] and the
    K-1 inputs before it (conv0): (x_full [K-1+T, C], qk [2, T, Hk, Dk], v [T, Hv, Dv], gb [2, T, Hv]). q, k,
    v are the convolution's output; g = -exp(A_log) * softplus(a + dt_bias) is the log decay and beta =
    sigmoid(b) the write strength, float32 (beta rounded to the model's type first, as transformers does)."""
    c = conv_weight.shape[0]
    kd, vd = k_heads * k_dim, v_heads * v_dim
    x_full = torch.cat([conv0, proj[:, :c]])
    mixed = causal_conv(x_full, conv_weight)
    qk = torch.stack([mixed[:, :kd], mixed[:, kd:2 * kd]]).unflatten(-1, (k_heads, k_dim))
    v = mixed[:, 2 * kd:].unflatten(-1, (v_heads, v_dim)).contiguous()
    b, a = proj[:, c + vd:c + vd + v_heads], proj[:, c + vd + v_heads:]
    gb = torch.stack([-a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid().float()])
    return x_full, qk, v, gb


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x, then times silu(gate) in float32 (DeltaNet's output norm)."""
    return (rms_norm(x, weight, eps).float() * F.silu(gate.float())).to(x.dtype)
