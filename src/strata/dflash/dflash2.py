"""DFlash2's additions to the drafter, as llama.cpp's `dflash` graph runs them: a dynamic grouped causal
convolution on each side of every attention and MLP (ConvolvedLayer), and a low-rank candidate selector that
walks the block slot by slot among each slot's top-k candidates (CandidateSelector).

The convolution mixes a token with the block's tokens before it (never the context): out[t, c] =
sum_k (base[side, k, c] + dyn[t, side, k, c // group]) * x[t - k, c], taps reaching before the block start
being zero, dyn a projection of the sublayer's normed input at t. Side 0 convolves that input, side 1 the
sublayer's output, with the same kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.sampling import sample
from ..engine.tree import Tree, beam_tree, search_steps
from ..layers.modules import DecoderLayer, Linear, Step


class DynamicConv(nn.Module):
    """A sublayer's pair of convolutions (base_kernel [2, taps, H], kernel_projection H -> 2 * taps * H / group),
    named as the reference checkpoint names them."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        self.taps, self.group = taps, group
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden))
        self.kernel_projection = Linear(hidden, 2 * taps * (hidden // group))

    def kernels(self, h: torch.Tensor, kernels) -> torch.Tensor:
        """Each row's kernels from its normed input h [..., T, H]: [..., T, 2, taps, H]."""
        dyn = self.kernel_projection(h, kernels).unflatten(-1, (2, self.taps, -1))
        return self.base_kernel + dyn.repeat_interleave(self.group, -1)

    def forward(self, x: torch.Tensor, w: torch.Tensor, side: int, block: int | None = None) -> torch.Tensor:
        """x [..., T, H] convolved with kernels w (kernels()) of one side, within blocks of `block` rows (None:
        the T rows are one block)."""
        if block is not None and block != x.shape[-2]:
            return self(x.unflatten(-2, (-1, block)), w.unflatten(-4, (-1, block)), side).flatten(-3, -2)
        rows = x.shape[-2]
        out = w[..., side, 0, :] * x
        for k in range(1, min(self.taps, rows)):
            out = out + w[..., side, k, :] * F.pad(x, (0, 0, k, 0))[..., :rows, :]
        return out

    @torch.no_grad()
    def reset_identity(self) -> None:
        """The published initialisation: the identity (tap 0 one, the rest and the projection zero), so that a
        fresh DFlash2 layer computes what its DFlash layer does."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1
        self.kernel_projection.weight.zero_()


class ConvolvedLayer(DecoderLayer):
    """The drafter's decoder layer with DFlash2's convolutions around its attention and its MLP (the block's
    rows only: the context's K/V come from the taps alone, Attention.store_context)."""

    def __init__(self, cfg, index: int, mixer, mlp):
        super().__init__(cfg, index, mixer, mlp)
        self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, step: Step, state):
        kernels, i = step.kernels, self.index
        norm = self.input_layernorm
        if pending is None:
            h = kernels.rms_norm(x, norm.weight, norm.eps)
        else:
            x, h = kernels.add_rms_norm(x, pending, norm.weight, norm.eps)
        conv, block = self.attention_conv, step.block
        w = conv.kernels(h, kernels)
        h = step.probed(i, "attn_in", conv(h, w, 0, block))
        mixed = conv(self.mixer(h, step, state), w, 1, block)
        norm = self.post_attention_layernorm
        x, h = kernels.add_rms_norm(x, mixed, norm.weight, norm.eps)
        x = step.probed(i, "o_residual", x)
        conv = self.mlp_conv
        w = conv.kernels(h, kernels)
        out = conv(self.mlp(conv(h, w, 0, block), kernels), w, 1, block)
        return x, step.probed(i, "mlp", out)


class CandidateSelector(nn.Module):
    """The low-rank edge scores between consecutive slots' candidates: slot t's candidate j after token p
    scores logit[t, j] + sum_r successor[j, r] * predecessor[p, r] * gate[t, r], gate = hidden_projection of
    slot t's final-normed hidden state."""

    def __init__(self, vocab: int, rank: int, hidden: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = Linear(hidden, rank)

    @staticmethod
    def scores(unary: torch.Tensor, succ: torch.Tensor, pred: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Candidates' scores after a predecessor: unary [..., k] plus succ [..., k, R] . (pred * gate) [..., R]."""
        return unary + (succ * (pred * gate).unsqueeze(-2)).sum(-1)

    def edges(self, logits: torch.Tensor, h: torch.Tensor, kernels):
        """Slots' top-k candidates [n, k], their logits [n, k], and the successor codes times the gate [n, k, R]
        (a candidate's score after token p adds (that . predecessor[p]).sum())."""
        unary, cand = logits.float().topk(self.top_k, dim=-1)
        gate = self.hidden_projection(h, kernels).float()
        return cand, unary, self.successor_codebook[cand].float(), gate

    def chain(self, logits: torch.Tensor, h: torch.Tensor, anchor: torch.Tensor, kernels, pick):
        """Slot by slot from the anchor [1] over slots with logits [n, V] and hidden states h [n, H]: each slot's
        candidate scores after the token picked before it, and pick(candidates [k], scores [k]) -> (token [1],
        what to keep). Device work only, no host read: (the picks, what was kept), lists."""
        cand, unary, succ, gate = self.edges(logits, h, kernels)
        pred = self.predecessor_codebook.float()
        prev, tokens, kept = anchor.view(1), [], []
        for t in range(cand.shape[0]):
            prev, keep = pick(cand[t], self.scores(unary[t], succ[t], pred[prev].view(-1), gate[t]))
            tokens.append(prev)
            kept.append(keep)
        return tokens, kept

    def walk(self, logits: torch.Tensor, h: torch.Tensor, anchor: torch.Tensor,
             kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy walk: at each slot the best-scoring of its top-k candidates after the one before (the first
        best on ties, as llama.cpp walks it): [n] token ids, and each pick's probability among the slot's k
        scores (llama.cpp's p_min quantity) [n]."""
        def pick(cand, scores):
            return cand.gather(0, scores.argmax().view(1)), torch.softmax(scores, -1).max().view(1)

        tokens, probs = self.chain(logits, h, anchor, kernels, pick)
        if not tokens:
            return anchor.new_empty(0), logits.new_empty(0).float()
        return torch.cat(tokens), torch.cat(probs)

    def tree(self, logits: torch.Tensor, h: torch.Tensor, anchor: torch.Tensor, kernels, budget: int) -> Tree:
        """A draft tree for tree verification (a beam over the edge scores, as SGLang's DFlash2 trees): the
        budget's best prefixes by summed log-probability, a node's children its slot's k candidates, each
        scored after the node's own token and log-softmaxed among the k. Device work only."""
        cand, unary, succ, gate = self.edges(logits, h, kernels)
        pred = self.predecessor_codebook.float()

        def children(d, parents):
            steps = search_steps(torch.log_softmax(self.scores(unary[d], succ[d], pred[parents], gate[d]), -1))
            return steps, cand[d].expand(parents.shape[0], -1)

        return beam_tree(anchor.view(1), cand.shape[0], cand.shape[1], budget, children)

    def draw(self, logits: torch.Tensor, h: torch.Tensor, anchor: torch.Tensor, kernels, probs, gen):
        """The sampled walk: each slot's token drawn (an exponential race, no host read) from q = probs of its
        candidates' scores after the token drawn before it (every other token -inf), so that rejection
        sampling against the target stays lossless. Returns (tokens [n], q [n, V])."""
        def pick(cand, scores):
            q = probs(torch.full((1, logits.shape[-1]), float("-inf"), device=logits.device)
                      .scatter(1, cand[None], scores[None]))
            return sample(q, gen), q

        tokens, qs = self.chain(logits, h, anchor, kernels, pick)
        if not tokens:
            return anchor.new_empty(0), logits.new_empty(0, logits.shape[-1])
        return torch.cat(tokens), torch.cat(qs)

    def loss(self, logits: torch.Tensor, h: torch.Tensor, prev: torch.Tensor, labels: torch.Tensor, kernels):
        """Training by the published recipe (a K-way cross-entropy over the top-k): each slot's true token scored
        among its candidates after the true token before it (prev [N]; teacher forcing, so a run of right
        picks is the greedy walk's), the true token standing in for the k-th candidate where the top-k misses
        it. logits [N, V], h [N, H], labels [N] -> (cross-entropy [N], whether the walk picks the true token [N])."""
        cand = logits.detach().topk(self.top_k, dim=-1).indices
        present = (cand == labels[:, None]).any(-1)
        cand = torch.where(present[:, None], cand, torch.cat([cand[:, :-1], labels[:, None]], -1))
        gate = self.hidden_projection(h, kernels).float()
        scores = self.scores(logits.float().gather(-1, cand), self.successor_codebook[cand].float(),
                             self.predecessor_codebook[prev].float(), gate)
        target = (cand == labels[:, None]).int().argmax(-1)
        return F.cross_entropy(scores, target, reduction="none"), present & (scores.argmax(-1) == target)
