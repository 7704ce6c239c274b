"""`strata train-drafter`: train a DFlash drafter for a target by self-distillation.

The published recipe: the target writes the responses the drafter learns from; anchors are drawn at
random in the response region, anew every epoch; each block is [anchor, mask x (B-1)] and sees the
target context strictly before its anchor plus its own block in both directions, never another block;
the loss is cross-entropy of rows 1..B-1 weighted exp(-(k-1)/gamma). The target is frozen and lends
its embedding and LM head."""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import StrataError
from ..files import umask_mode
from ..layers.kernels import EAGER
from ..layers.modules import Step, init_weights_
from ..models.loader import pack, unpack
from .artifact import check_against_target, load_artifact
from .contract import Artifact, DFlashConfig, default_target_layers
from .dspark import confidence_logit
from .hf_format import config_to_hf
from .model import DFlashModel, hf_layout, scaled_logits

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class TrainConfig:
    layers: int = 2
    block_size: int = 8
    taps: list[int] | None = None
    steps: int = 2000
    batch_size: int = 32
    anchors_per_seq: int = 16
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    clip: float = 1.0
    prompt_len: int = 64
    gen_len: int = 192
    num_sequences: int = 2048
    held_out: float = 0.05
    temperature: float = 0.0
    seed: int = 0
    eval_every: int = 200
    save_every: int = 500
    mask_token_id: int | None = None
    variant: str = "dflash"  # dflash2: convolutions and selector; dspark: Markov and confidence heads
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 64
    selector_top_k: int = 8
    markov_rank: int = 64
    init_from: str | None = None  # a DFlash drafter whose layers start the training (its shape wins)

VARIANTS = ("dflash", "dflash2", "dspark")


def gamma_for(block_size: int) -> float:
    return GAMMA.get(block_size, max(1.0, 0.45 * block_size))


def lr_at(step: int, total: int, peak: float, warmup_frac: float) -> float:
    """Linear warmup, then cosine decay to zero."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def drafter_config_for(target, tc: TrainConfig) -> DFlashConfig:
    t = target.cfg
    taps = tc.taps if tc.taps is not None else default_target_layers(min(5, t.num_layers), t.num_layers) \
        if t.num_layers >= 5 else default_target_layers(1, t.num_layers)
    bad = [x for x in taps if not 0 <= x < t.num_layers]
    if bad:
        raise StrataError(f"--taps: layer {bad[0]} outside the target's 0..{t.num_layers - 1}")
    mask = tc.mask_token_id if tc.mask_token_id is not None else t.vocab_size - 1
    cfg = DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=tc.layers,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps,
        rope_theta=float(t.rope.theta), block_size=tc.block_size, mask_token_id=mask, target_layer_ids=list(taps),
        target_hidden_size=t.hidden_size, context_length=t.max_position_embeddings,
        num_target_layers=t.num_layers, vocab_size=t.vocab_size)
    return with_variant(cfg, tc)


def with_variant(cfg: DFlashConfig, tc: TrainConfig) -> DFlashConfig:
    """cfg made the variant tc asks for (DFlash2's or DSpark's sizes from tc), checked."""
    if tc.variant not in VARIANTS:
        raise StrataError(f"--variant must be one of {', '.join(VARIANTS)}, got {tc.variant!r}")
    cfg = replace(cfg, conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None,
                  markov_rank=None, sample_from_anchor=None, has_confidence_head=None)
    if tc.variant == "dflash2":
        cfg = replace(cfg, conv_kernel_size=tc.conv_kernel_size, conv_group_size=tc.conv_group_size,
                      selector_rank=tc.selector_rank, selector_top_k=tc.selector_top_k)
    elif tc.variant == "dspark":
        cfg = replace(cfg, markov_rank=tc.markov_rank, sample_from_anchor=True, has_confidence_head=True)
    cfg.validate(f"--variant {tc.variant}")
    return cfg


def init_drafter(cfg: DFlashConfig, seed: int, device, start: Artifact | None = None) -> DFlashModel:
    """From scratch, or from a drafter's weights (start); the variant's additions that the start does not
    carry start as the published recipe starts them: the convolutions the identity, the Markov head's bias
    zero."""
    torch.manual_seed(seed)
    model = init_weights_(DFlashModel(cfg))
    if start is not None:
        model.load_state_dict(pack(start.tensors, hf_layout(start.cfg), torch.float32, start.source), strict=False)
        if start.cfg.variant == cfg.variant:  # a drafter of this kind goes on training as it is
            return model.to(device)
    for layer in model.layers:
        for conv in (getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)):
            if conv is not None:
                conv.reset_identity()
    if cfg.variant == "dspark":
        nn.init.zeros_(model.markov_head.markov_w2.weight)
    return model.to(device)


def start_from(path: str, target, tc: TrainConfig) -> tuple[DFlashConfig, Artifact]:
    """--init-from: a drafter for this target; its shape (layers, block size, taps, and its own variant's sizes)
    replaces tc's."""
    art = load_artifact(path)
    check_against_target(art.cfg, target.cfg, str(art.source), art.vocab)
    return (art.cfg if art.cfg.variant == tc.variant else with_variant(art.cfg, tc)), art


@torch.no_grad()
def continue_batch(target, prompts: torch.Tensor, new_tokens: int, pick) -> torch.Tensor:
    """Extend every row of prompts [B, P] by new_tokens, each chosen by pick(logits [B, V]) -> [B, 1],
    over a batch cache (the same tokens as re-running the whole rows, at a fraction of the cost)."""
    b, p = prompts.shape
    cache = target.make_cache(p + new_tokens, batch=b)
    rows, window, start = [prompts], prompts, 0
    for _ in range(new_tokens):
        end = start + window.shape[1]
        out = target(window, Step(torch.arange(start, end, device=prompts.device), end), cache, logits="last")
        window = pick(out.logits[:, -1])
        rows.append(window)
        start = end
    return torch.cat(rows, dim=1)


@torch.no_grad()
def self_distill(target, corpus_ids: list[int], tc: TrainConfig, device, progress=True,
                 prompts: list[list[int]] | None = None):
    """The target writes the continuations of `prompts` (each prompt_len tokens, when given), then of
    prompts cut from the corpus at seeded offsets, num_sequences in all."""
    rng = random.Random(tc.seed)
    span = tc.prompt_len
    if len(corpus_ids) <= span + 1:
        raise StrataError(f"--data: the corpus has {len(corpus_ids)} tokens, fewer than --prompt-len {span} + 1")
    given = [list(p) for p in (prompts or [])][: tc.num_sequences]
    if any(len(p) != span for p in given):
        raise StrataError(f"self-distillation prompts must be --prompt-len {span} tokens long")
    starts = [rng.randrange(0, len(corpus_ids) - span) for _ in range(tc.num_sequences - len(given))]
    prompts = torch.tensor(given + [corpus_ids[s:s + span] for s in starts], device=device)
    gen = torch.Generator(device=device).manual_seed(tc.seed)
    out = []
    chunk = 1024 if device != "cpu" else 32

    def pick(logits):
        if tc.temperature > 0:
            return torch.multinomial(torch.softmax(logits / tc.temperature, -1), 1, generator=gen)
        return logits.argmax(-1, keepdim=True)

    for i in tqdm(range(0, len(prompts), chunk), desc="self-distill", disable=not progress, leave=False):
        with _autocast(device):
            out.append(continue_batch(target, prompts[i:i + chunk], tc.gen_len, pick))
    return torch.cat(out)


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if str(device).startswith("cuda") else \
        torch.autocast("cpu", enabled=False)


def block_forward(model: DFlashModel, target, cfg: DFlashConfig, tokens: torch.Tensor, taps: torch.Tensor,
                  anchors: torch.Tensor):
    """Training pass over K blocks per sequence, through the drafter's one forward: the context K/V in
    cells 0..T-1, the blocks' rows packed after them. tokens [B, T]; taps [B, T, n*H]; anchors [B, K].

    Returns, for the S draft slots of each block (bs-1, or bs where the anchor's slot drafts: DSpark), the
    logits [B, K, S, V], the final-normed hidden states [B, K, S, H], the labels [B, K, S] and the true
    tokens before them [B, K, S]."""
    b, t = tokens.shape
    k, bs = anchors.shape[1], cfg.block_size
    first = 0 if cfg.anchor_drafts else 1
    rows = k * bs
    dev = tokens.device
    cache = model.make_cache(t + rows, batch=b)
    model.store_context(taps, Step(torch.arange(t, device=dev), 0), cache)
    pos = anchors[..., None] + torch.arange(bs, device=dev)  # [B, K, bs]
    block = torch.full((b, k, bs), cfg.mask_token_id, device=dev, dtype=torch.long)
    block[..., 0] = tokens.gather(1, anchors)
    x = target.embed(block).view(b, rows, -1)
    if cfg.input_embedding_scale is not None:
        x = x * cfg.input_embedding_scale
    row_anchor = anchors.repeat_interleave(bs, dim=1)  # [B, K*bs]
    ctx_visible = torch.arange(t, device=dev).view(1, 1, t) < row_anchor.unsqueeze(-1)  # strictly before the anchor
    block_id = torch.arange(k, device=dev).repeat_interleave(bs)
    own_block = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
    mask = torch.cat([ctx_visible, own_block], dim=-1)
    step = Step(pos.view(b, rows), t + rows, cells=t + torch.arange(rows, device=dev),
                masks={w: mask for w in model.windows}, block=bs)
    h = model(x, step, cache).view(b, k, bs, -1)[:, :, first:]
    logits = scaled_logits(cfg, target.head(h))
    wanted = (anchors[..., None] + torch.arange(1, bs + 1 - first, device=dev)).view(b, -1)
    labels = tokens.gather(1, wanted).view(b, k, -1)
    prev = tokens.gather(1, wanted - 1).view(b, k, -1)
    return logits, h, labels, prev


def sample_anchors(n_seq: int, k: int, lo: int, hi: int, gen: torch.Generator, device) -> torch.Tensor:
    return torch.randint(lo, hi + 1, (n_seq, k), generator=gen).to(device)


class DrafterTrainer:
    def __init__(self, target, tc: TrainConfig, out_dir: Path, device):
        self.target, self.tc, self.out, self.device = target, tc, Path(out_dir), device
        start = None
        if tc.init_from:
            self.cfg, start = start_from(tc.init_from, target, tc)
        else:
            self.cfg = drafter_config_for(target, tc)
        self.model = init_drafter(self.cfg, tc.seed, device, start)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=tc.lr, betas=(0.9, 0.95),
                                     weight_decay=tc.weight_decay)
        self.step = 0
        self.gen = torch.Generator().manual_seed(tc.seed + 1)
        g = gamma_for(self.cfg.block_size)
        slots = self.cfg.block_size - (0 if self.cfg.anchor_drafts else 1)
        self.weights = torch.tensor([math.exp(-(r - 1) / g) for r in range(1, slots + 1)], device=device)
        self.history: list[dict] = []
        self.cache_taps = str(device).startswith("cuda")

    # -- data
    def set_data(self, sequences: torch.Tensor):
        n_hold = max(1, int(len(sequences) * self.tc.held_out))
        self.train_seqs, self.held_seqs = sequences[n_hold:], sequences[:n_hold]
        self.train_taps = self._tap_table(self.train_seqs)

    def _tap_table(self, seqs: torch.Tensor) -> torch.Tensor | None:
        """On CUDA, the frozen target's features of every training sequence, computed once (bf16) when they
        take at most a third of the free memory: each step then skips the target's forward."""
        if not self.cache_taps:
            return None
        width = len(self.cfg.target_layer_ids) * self.target.cfg.hidden_size
        if str(self.device).startswith("cuda") and seqs.numel() * width * 2 > torch.cuda.mem_get_info(self.device)[0] // 3:
            return None
        table = torch.empty(*seqs.shape, width, dtype=torch.bfloat16, device=self.device)
        for i in range(0, len(seqs), self.tc.batch_size):
            table[i:i + self.tc.batch_size] = self.taps_of(seqs[i:i + self.tc.batch_size].to(self.device))
        return table

    def taps_of(self, tokens):
        with torch.no_grad(), _autocast(self.device):
            taps = self.target.forward_batch(tokens, self.cfg.target_layer_ids, logits=False).taps
        return taps.float()

    def loss_on(self, tokens, anchors, taps=None):
        """The weighted loss, and per slot whether the drafter's pick is the true token [B, K, S]: its argmax,
        DFlash2's walk or DSpark's chain (teacher-forced, so a run of right picks is what greedy drafting
        gets accepted). DFlash2 adds its selector's cross-entropy, DSpark its confidence head's (the head
        learns whether the chain's pick is right, on detached inputs)."""
        model = self.model
        with _autocast(self.device):
            logits, h, labels, prev = block_forward(model, self.target, self.cfg, tokens,
                                                    self.taps_of(tokens) if taps is None else taps.float(), anchors)
        flat = labels.flatten()
        logits, h, prev = logits.float().flatten(0, 2), h.float().flatten(0, 2), prev.flatten()
        if self.cfg.variant == "dspark":
            ce, right, _ = model.markov_head.loss(logits, prev, flat)
            code = model.markov_head.markov_w1(prev).detach()
            ce = ce + F.binary_cross_entropy_with_logits(
                confidence_logit(model.confidence_head.proj, h.detach(), code), right.float(), reduction="none")
        else:
            ce = F.cross_entropy(logits, flat, reduction="none")
            right = logits.argmax(-1) == flat
            if self.cfg.variant == "dflash2":
                chosen, right = model.candidate_selector.loss(logits, h, prev, flat, EAGER)
                ce = ce + chosen
        ce, right = ce.view(labels.shape), right.view(labels.shape)
        loss = (ce * self.weights).sum() / (self.weights.sum() * labels.shape[0] * labels.shape[1])
        return loss, right

    def anchor_range(self):
        return self.tc.prompt_len - 1, self.train_seqs.shape[1] - self.cfg.block_size - int(self.cfg.anchor_drafts)

    # -- one optimisation step
    def train_step(self) -> float:
        tc = self.tc
        idx = torch.randint(0, len(self.train_seqs), (tc.batch_size,), generator=self.gen)
        tokens = self.train_seqs[idx].to(self.device)
        lo, hi = self.anchor_range()
        anchors = sample_anchors(tc.batch_size, tc.anchors_per_seq, lo, hi, self.gen, self.device)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, tc.steps, tc.lr, tc.warmup)
        self.model.train()
        taps = None if self.train_taps is None else self.train_taps[idx.to(self.device)]
        loss, _ = self.loss_on(tokens, anchors, taps)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip)
        self.opt.step()
        self.step += 1
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss and acceptance under teacher forcing: per block, the run of leading rows whose
        argmax is right; tau estimate = 1 + its mean (the bonus token counted)."""
        self.model.eval()
        gen = torch.Generator().manual_seed(12345)
        lo, hi = self.anchor_range()
        tokens = self.held_seqs.to(self.device)
        anchors = sample_anchors(len(tokens), self.tc.anchors_per_seq, lo, hi, gen, self.device)
        losses, runs, per_pos = [], [], []
        for i in range(0, len(tokens), self.tc.batch_size):
            loss, right = self.loss_on(tokens[i:i + self.tc.batch_size], anchors[i:i + self.tc.batch_size])
            ok = right.float()
            losses.append(float(loss))
            runs.append(ok.cumprod(-1).sum(-1).flatten())
            per_pos.append(ok.flatten(0, 1))
        run = torch.cat(runs)
        pp = torch.cat(per_pos).mean(0)
        return {"step": self.step, "held_out_loss": sum(losses) / len(losses), "tau_estimate": 1 + float(run.mean()),
                "per_position_accuracy": [round(float(x), 4) for x in pp]}

    # -- persistence
    def save_checkpoint(self):
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                    "gen": self.gen.get_state(), "train_config": asdict(self.tc), "history": self.history}, tmp)
        os.replace(tmp, self.out / "checkpoint.pt")

    def load_checkpoint(self) -> bool:
        path = self.out / "checkpoint.pt"
        if not path.is_file():
            return False
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.history = state["step"], state["history"]
        self.gen.set_state(state["gen"])
        return True

    def export(self):
        """The reference Hugging Face format, BF16 (then `strata convert-dflash` makes the GGUF)."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(config_to_hf(self.cfg), indent=2) + "\n")
        tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
                   for k, v in unpack(self.model.state_dict(), hf_layout(self.cfg)).items()}
        save_file(tensors, str(self.out / "model.safetensors"), metadata={"format": "pt"})
        umask_mode(self.out / "model.safetensors")
        (self.out / "training_log.json").write_text(json.dumps(self.history, indent=2) + "\n")

    def fit(self, progress=True):
        bar = tqdm(total=self.tc.steps, initial=self.step, desc="train-drafter", disable=not progress)
        est = {}
        if not self.history:
            est = self.evaluate()  # the untrained baseline
            self.history.append(est)
        while self.step < self.tc.steps:
            loss = self.train_step()
            bar.update(1)
            if self.step % self.tc.eval_every == 0 or self.step == self.tc.steps:
                est = self.evaluate()
                est["train_loss"] = loss
                self.history.append(est)
                self.export()
            bar.set_postfix(loss=f"{loss:.3f}", tau=f"{est.get('tau_estimate', float('nan')):.2f}")
            if self.step % self.tc.save_every == 0:
                self.save_checkpoint()
        bar.close()
        self.save_checkpoint()
        self.export()
        return self.history


def read_corpus(files: list[str], tokenizer) -> list[int]:
    ids: list[int] = []
    eos = tokenizer.token_id("<|endoftext|>")
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise StrataError(f"--data {f}: {e.strerror}") from None
        ids.extend(tokenizer.encode(text))
        if eos is not None:
            ids.append(eos)
    return ids


def train(target, tokenizer, tc: TrainConfig, out: Path, device, data: list[str], resume: bool = False,
          progress: bool = True) -> DrafterTrainer:
    """`strata train-drafter`: self-distil (or reuse OUT/distill.pt when resuming), fit, export."""
    if tc.block_size < 2:
        raise StrataError(f"--block-size must be >= 2, got {tc.block_size}")
    out = Path(out)
    trainer = DrafterTrainer(target, tc, out, device)
    data_path = out / "distill.pt"
    if resume and trainer.load_checkpoint() and data_path.is_file():
        trainer.set_data(torch.load(data_path, weights_only=True))
    else:
        seqs = self_distill(target, read_corpus(data, tokenizer), tc, device).cpu()
        out.mkdir(parents=True, exist_ok=True)
        torch.save(seqs, data_path)
        trainer.set_data(seqs)
    trainer.fit(progress=progress)
    return trainer
