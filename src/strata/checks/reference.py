"""An independent NumPy (float64) implementation of one DFlash proposal (DFlash2's convolutions and
selector walk, DSpark's Markov chain too), written from the spec (docs/DFLASH.md, llama.cpp's dflash graph) and sharing no code
with the runtime. The parity tool compares the two stage by
stage. Attention is recomputed cell by cell from the context K/V that the runtime dumps, so a
divergence in the context and one in the block pass are told apart."""

from __future__ import annotations

import numpy as np


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x: [T, heads, d]; NeoX layout: the first half of each head pairs with the second half."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _conv(x: np.ndarray, base: np.ndarray, dyn: np.ndarray, side: int, group: int) -> np.ndarray:
    """DFlash2's convolution of one side over a block x [T, H]: tap k of row t reads row t - k (none before
    the block), weighted by base[side, k] plus row t's dynamic kernel dyn [T, 2, K, G], one value a group."""
    rows, hidden = x.shape
    out = np.zeros_like(x)
    for t in range(rows):
        for k in range(min(base.shape[1], t + 1)):
            w = base[side, k] + np.repeat(dyn[t, side, k], group)
            out[t] += w * x[t - k]
    return out


def selector_walk(logits: np.ndarray, hidden: np.ndarray, weights: dict, anchor: int, top_k: int):
    """DFlash2's greedy walk over slots 1.. (logits and final-normed hidden rows of the block, slot 0 the
    anchor's): at each slot the candidate among its top_k with the highest logit + successor . (predecessor
    of the previous pick * gate), the first on ties. Returns the picks and each pick's softmax probability
    among its slot's scores (llama.cpp's p_min quantity)."""
    pred = weights["candidate_selector.predecessor_codebook"]
    succ = weights["candidate_selector.successor_codebook"]
    gates = hidden @ weights["candidate_selector.hidden_projection.weight"].T
    prev, out, conf = anchor, [], []
    for t in range(1, logits.shape[0]):
        cand = np.argsort(-logits[t], kind="stable")[:top_k]
        scores = np.array([logits[t, c] + np.sum(succ[c] * pred[prev] * gates[t]) for c in cand])
        prev = int(cand[int(np.argmax(scores))])
        out.append(prev)
        conf.append(1.0 / np.exp(scores - scores.max()).sum())
    return out, conf


def markov_walk(logits: np.ndarray, hidden: np.ndarray, weights: dict, anchor: int):
    """DSpark's greedy chain over the draft slots' raw logits: each slot's logits plus markov_w2 . markov_w1[the
    token before it] (the anchor before the first), its argmax the next token before. Returns the picks and each
    slot's confidence: sigmoid(conf_proj . [hidden; markov_w1[the token before]] + bias), or without that head
    the chained logits' top softmax probability."""
    w1, w2 = weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"]
    head = weights.get("confidence_head.proj.weight")
    prev, out, conf = anchor, [], []
    for row, h in zip(logits, hidden):
        chained = row + w2 @ w1[prev]
        if head is not None:
            z = head[0] @ np.concatenate([h, w1[prev]]) + weights["confidence_head.proj.bias"][0]
            conf.append(1.0 / (1.0 + np.exp(-z)))
        else:
            conf.append(1.0 / np.exp(chained - chained.max()).sum())
        prev = int(np.argmax(chained))
        out.append(prev)
    return out, conf


def reference_proposal(weights: dict, cfg, embed: np.ndarray, lm_head: np.ndarray, context_taps: np.ndarray,
                       context_k: list, context_v: list, context_ranges: list, anchor: int, pos: int, w: int):
    """Returns {(layer, stage): array}, layer -1 for stages outside the layers.

    weights: the drafter's tensors by Hugging Face name (float64); context_taps: [pos, taps*H_t];
    context_k/v[j]: the runtime's dumped cells [cells, kv_heads, d] of layer j for cells
    context_ranges[j] = (begin, end)."""
    eps, theta = cfg.rms_norm_eps, cfg.rope_theta
    dflash2 = cfg.conv_kernel_size is not None
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = {}
    fused = _rms(context_taps @ weights["fc.weight"].T, weights["hidden_norm.weight"], eps)
    out[(-1, "fused")] = fused
    tokens = [anchor] + [cfg.mask_token_id] * (w - 1)
    x = embed[tokens].copy()
    if cfg.input_embedding_scale is not None:
        x = x * cfg.input_embedding_scale
    rows = np.arange(pos, pos + w)
    for j in range(cfg.num_layers):
        p = f"layers.{j}."
        W = lambda name, p=p: weights[p + name]  # noqa: E731
        bias = (lambda name, p=p: weights[p + name]) if cfg.attention_bias else (lambda name: 0.0)
        begin, end = context_ranges[j]
        ctx_pos = np.arange(begin, end)
        ck = (fused[begin:end] @ W("self_attn.k_proj.weight").T + bias("self_attn.k_proj.bias")).reshape(-1, nkv, d)
        out[(j, "context_k")] = _rope(_rms(ck, W("self_attn.k_norm.weight"), eps), ctx_pos, theta)
        out[(j, "context_v")] = (fused[begin:end] @ W("self_attn.v_proj.weight").T
                                 + bias("self_attn.v_proj.bias")).reshape(-1, nkv, d)
        h = _rms(x, W("input_layernorm.weight"), eps)
        if dflash2:
            dyn = (h @ W("attention_conv.kernel_projection.weight").T).reshape(w, 2, cfg.conv_kernel_size, -1)
            h = _conv(h, W("attention_conv.base_kernel"), dyn, 0, cfg.conv_group_size)
        out[(j, "attn_in")] = h
        q = (h @ W("self_attn.q_proj.weight").T + bias("self_attn.q_proj.bias")).reshape(w, nh, d)
        out[(j, "q_raw")] = q
        q = _rms(q, W("self_attn.q_norm.weight"), eps)
        out[(j, "q_normed")] = q
        q = _rope(q, rows, theta)
        out[(j, "q_roped")] = q
        k = (h @ W("self_attn.k_proj.weight").T + bias("self_attn.k_proj.bias")).reshape(w, nkv, d)
        k = _rope(_rms(k, W("self_attn.k_norm.weight"), eps), rows, theta)
        v = (h @ W("self_attn.v_proj.weight").T + bias("self_attn.v_proj.bias")).reshape(w, nkv, d)
        out[(j, "k")], out[(j, "v")] = k, v
        keys = np.concatenate([context_k[j], k])  # cells first, then the block's own rows
        values = np.concatenate([context_v[j], v])
        attn = np.zeros((w, nh, d))
        for r in range(w):  # non-causal: each row sees every context cell and every block row
            for head in range(nh):
                g = head // (nh // nkv)
                scores = np.array([q[r, head] @ keys[c, g] for c in range(keys.shape[0])]) / np.sqrt(d)
                prob = np.exp(scores - scores.max())
                prob /= prob.sum()
                attn[r, head] = prob @ values[:, g]
        attn = attn.reshape(w, nh * d)
        out[(j, "attn")] = attn
        a = attn @ W("self_attn.o_proj.weight").T + bias("self_attn.o_proj.bias")
        x = x + (_conv(a, W("attention_conv.base_kernel"), dyn, 1, cfg.conv_group_size) if dflash2 else a)
        out[(j, "o_residual")] = x
        m = _rms(x, W("post_attention_layernorm.weight"), eps)
        if dflash2:
            dyn = (m @ W("mlp_conv.kernel_projection.weight").T).reshape(w, 2, cfg.conv_kernel_size, -1)
            m = _conv(m, W("mlp_conv.base_kernel"), dyn, 0, cfg.conv_group_size)
        m = (_silu(m @ W("mlp.gate_proj.weight").T) * (m @ W("mlp.up_proj.weight").T)) @ W("mlp.down_proj.weight").T
        if dflash2:
            m = _conv(m, W("mlp_conv.base_kernel"), dyn, 1, cfg.conv_group_size)
        out[(j, "mlp")] = m
        x = x + m
        out[(j, "out")] = x
    h = _rms(x, weights["norm.weight"], eps)
    out[(-1, "final_norm")] = h
    logits = raw = h @ lm_head.T
    dspark = cfg.markov_rank is not None
    if cfg.output_multiplier is not None and not dspark:  # DSpark's logits are raw
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None and not dspark:
        logits = np.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    out[(-1, "logits")] = logits
    if dflash2:
        tokens, conf = selector_walk(logits, h, weights, anchor, cfg.selector_top_k)
        out[(-1, "tokens")] = np.array(tokens)
    elif dspark:  # the anchor's slot drafts too unless sample_from_anchor is false
        first = 0 if cfg.sample_from_anchor else 1
        tokens, conf = markov_walk(logits[first:], h[first:], weights, anchor)
        out[(-1, "tokens")] = np.array(tokens)
    else:  # DFlash: the softmax of the raw logits' top 10 at the first
        top = -np.sort(-raw[1:], axis=-1)[:, :10]
        conf = 1.0 / np.exp(top - top[:, :1]).sum(-1)
    out[(-1, "confidence")] = np.array(conf)
    return out
