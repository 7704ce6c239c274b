"""Multi-token prediction: the next-token block Qwen3.5 and Qwen3-Next checkpoints ship beside their decoder
(`mtp.*` in Hugging Face folders; in llama.cpp's GGUF files the block after the decoder's, `blk.L.*` with its
`nextn.*` parts, counted by `{arch}.nextn_predict_layers`).

For a token at position p it reads the token's embedding and the target's final normed hidden state at p - 1,
each normed, projects the pair back to the hidden size (fc, llama.cpp's eh_proj), runs one full-attention
decoder layer over its own K/V, and norms the result: the target's LM head turns that into the guess for
p + 1, and chained drafting feeds it back in place of the target's hidden state. The layer is a full-attention
layer of the target's family (a mixture of experts where the target's layers are), laid out in both formats as
the decoder's own layers are."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..errors import StrataError
from ..layers.modules import MLP, DecoderLayer, Linear, RMSNorm, Step, run_layers
from ..layers.moe import SparseMoE

#: the block's own tensors besides its layer: parameter under mtp. -> (Hugging Face name under mtp., llama.cpp's
#: name under blk.L.)
OWN = {"fc.weight": ("fc.weight", "nextn.eh_proj.weight"),
       "embedding_norm.weight": ("pre_fc_norm_embedding.weight", "nextn.enorm.weight"),
       "hidden_norm.weight": ("pre_fc_norm_hidden.weight", "nextn.hnorm.weight"),
       "norm.weight": ("norm.weight", "nextn.shared_head_norm.weight")}


class MTPHead(nn.Module):
    def __init__(self, cfg, mixer: nn.Module):
        """mixer: the family's full-attention mixer, at index 0 of the block's own cache."""
        super().__init__()
        h, moe = cfg.hidden_size, cfg.moe
        self.embedding_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = Linear(2 * h, h)
        mlp = MLP(h, cfg.intermediate_size) if moe is None else \
            SparseMoE(h, moe.intermediate, moe.experts, moe.top_k, moe.renormalize, moe.shared)
        self.layer = DecoderLayer(cfg, 0, mixer, mlp)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, step: Step, cache) -> torch.Tensor:
        """Rows of (token embedding, hidden state before it) at step.positions -> the block's normed output
        (what the LM head reads); the layer's K/V written to `cache` (a one-layer KVCache)."""
        k = step.kernels
        x = self.fc(torch.cat([self.embedding_norm(embedded, k), self.hidden_norm(hidden, k)], dim=-1), k)
        x, pending, _ = run_layers([self.layer], x, step, cache)
        norm = self.norm
        return k.rms_norm(x, norm.weight, norm.eps) if pending is None else \
            k.add_rms_norm(x, pending, norm.weight, norm.eps)[1]


def source_layer(cfg) -> int:
    """The decoder layer whose layout the block's layer shares: the last full-attention one (a sparse one where
    the target has experts)."""
    sparse = cfg.moe.layers if cfg.moe is not None else None
    found = [n for n in range(cfg.num_layers) if n not in cfg.linear.layers and (sparse is None or n in sparse)]
    if not found:
        raise StrataError("the MTP block's layer has no full-attention counterpart in the decoder to lay out by")
    return found[-1]


def block_layout(layout: dict, param_of: str, source_of: str, source_to: str) -> dict:
    """The block's layer in a layout: the entries of parameters under param_of (layers.N.) moved under
    mtp.layer., their sources' prefix source_of replaced by source_to."""
    out = {}
    for param, sources in layout.items():
        if param.startswith(param_of):
            out["mtp.layer." + param[len(param_of):]] = [(source_to + name[len(source_of):], *rest)
                                                          for name, *rest in sources]
    return out


def hf_layout(layout: dict, cfg) -> dict:
    """The block's parameters from a Hugging Face checkpoint (mtp.layers.0.*, mtp.fc, mtp's norms), given the
    decoder's layout."""
    n, h = source_layer(cfg), cfg.hidden_size
    out = block_layout(layout, f"layers.{n}.", f"{cfg.checkpoint_prefix}layers.{n}.", "mtp.layers.0.")
    for param, (name, _) in OWN.items():
        out["mtp." + param] = [("mtp." + name, (h, 2 * h) if param == "fc.weight" else (h,))]
    return out


def gguf_layout(layout: dict, cfg) -> dict:
    """The block's parameters from llama.cpp's tensors (blk.L.*, L the decoder's layer count), given the
    decoder's GGUF layout."""
    n, h, last = source_layer(cfg), cfg.hidden_size, cfg.num_layers
    out = block_layout(layout, f"layers.{n}.", f"blk.{n}.", f"blk.{last}.")
    for param, (_, name) in OWN.items():
        out["mtp." + param] = [(f"blk.{last}.{name}", (h, 2 * h) if param == "fc.weight" else (h,), None)]
    return out


def loading(cfg, where):
    """--mtp on this model: the config to build and load it with its MTP block, or a one-line error before any
    weight loads where it has none to load."""
    if cfg.mtp_layers == 0:
        raise StrataError(f"{where}: the model has no MTP block (a Hugging Face folder's mtp.* tensors and "
                          f"mtp_num_hidden_layers, a GGUF file's nextn_predict_layers); --mtp needs one (Qwen3.5, "
                          f"Qwen3.6, Qwen3-Next checkpoints ship it)")
    if cfg.mtp_layers > 1:
        raise StrataError(f"{where}: the model has {cfg.mtp_layers} MTP blocks; Strata runs a single one, as "
                          f"llama.cpp's qwen35 graph does")
    return replace(cfg, load_mtp=True)


def with_block(layout: dict, cfg, gguf: bool) -> dict:
    """A decoder's layout, with the MTP block's parameters where cfg.load_mtp asks for them."""
    if not cfg.load_mtp:
        return layout
    return {**layout, **(gguf_layout if gguf else hf_layout)(layout, cfg)}
