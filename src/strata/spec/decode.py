"""The decode loop: prefill, then rounds of propose -> verify -> commit.

Target-only decoding is the same loop with a drafter that proposes nothing (window 1)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import StrataError
from ..graphs import StepGraphs
from ..kv_cache import aligned_cells
from ..models.decoder import TargetDecoder
from ..models import triton_kernels
from ..models.layers import ATTENTION, EAGER, compiled_kernels
from .drafter import Drafter, NoDrafter
from .sampling import SamplingParams, process, sample
from .verify import greedy_accept, speculative_accept

DRAFT_SAMPLING_MODES = ("sample", "argmax")


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafter: str = "none"
    window: int = 1
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per round, bonus included
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0  # measured only by an Engine with profile=True
    verify_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tok_s(self) -> float:
        """Tokens produced by the decode rounds per second (the first token comes from prefill)."""
        n = max(self.new_tokens - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def stats(self) -> dict:
        rounds = len(self.accept_lengths)
        drafted = sum(self.per_position_drafted)
        accepted = sum(self.per_position_accepted)
        return {
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "tok_s": self.tok_s,
            "drafter": self.drafter,
            "window": self.window,
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tau": sum(self.accept_lengths) / rounds if rounds else 0.0,
            "accept_lengths": self.accept_lengths,
            "per_position_acceptance": [
                a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)
            ],
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
        }


class Engine:
    """A target, its cache and a drafter: serves one sequence at a time."""

    def __init__(self, target: TargetDecoder, drafter: Drafter | None = None, window: int | None = None,
                 max_len: int | None = None, draft_sampling: str = "sample", profile: bool = False,
                 static: bool = False, pad_rows: int = 1, graphs: bool = True, attention: str = "grouped",
                 compile: bool = True, triton: bool = True):
        """static=True: fixed verify windows over a cache addressed by device-side positions (every round
        verifies W tokens, also the last), attending over a power-of-two bucket of cells. On a CUDA
        device the draft, verify and observe steps are then captured in CUDA graphs (graphs=False runs
        them eagerly); elsewhere the same steps run as they are. Prefill stays dynamic.

        pad_rows: target-only decoding (static) in a window of this many rows, the anchor first and
        padding after. A GEMM row's result does not depend on the other rows, but it can depend on the
        number of rows: in bfloat16 a 1-row decode and a W-row verify round differently and greedy
        choices at near-ties can flip. With pad_rows = W, target-only runs in the verify's shapes, so
        DFlash output equals it token for token at any precision (on a GPU the extra rows are nearly
        free: the weights are streamed once either way).

        attention: "grouped" (two matmuls per K/V head; 1.4x faster decode than SDPA on the H200 for
        an 8B shape) or "sdpa" (PyTorch's scaled_dot_product_attention) for the static steps.
        compile: with CUDA graphs, the elementwise groups of each layer (norms, q/k norm + RoPE,
        SiLU-gate, masked softmax) become fused kernels through torch.compile.
        triton: with compile, Strata's Triton kernels also take projections of <= 16 rows, attention and the q/k
        group (models/triton_kernels.py), where Triton is installed."""
        if draft_sampling not in DRAFT_SAMPLING_MODES:
            raise StrataError(f"--draft-sampling: expected one of {', '.join(DRAFT_SAMPLING_MODES)}, "
                              f"got {draft_sampling!r}")
        if attention not in ATTENTION:
            raise StrataError(f"--attention: expected one of {', '.join(ATTENTION)}, got {attention!r}")
        self.draft_sampling = draft_sampling
        self.profile = profile
        self.target = target
        self.drafter = drafter or NoDrafter()
        self.window = window or self.drafter.max_window
        if not 1 <= self.window <= self.drafter.max_window:
            raise StrataError(f"--spec {self.window}: must be 2..{self.drafter.max_window} for this drafter")
        self.max_len = max_len or target.cfg.max_position_embeddings
        self.static = static
        self.attention = attention
        self.pad_rows = pad_rows if static and self.window == 1 else 1
        self.rows = max(self.window, self.pad_rows)
        self.cache = target.make_cache(aligned_cells(self.max_len + self.rows) if static else self.max_len)
        self.graphs = StepGraphs(target.device, enabled=graphs and static)
        self.kernels = EAGER
        if self.graphs.enabled and compile:
            self.kernels = compiled_kernels(triton=triton and triton_kernels.available(target.device))
        if static:
            dev = target.device
            self.anchor_buf = torch.zeros(1, dtype=torch.long, device=dev)
            self.pos_buf = torch.zeros(1, dtype=torch.long, device=dev)
            self.cands_buf = torch.zeros(self.window - 1, dtype=torch.long, device=dev)
            self.pad = torch.zeros(self.rows - self.window, dtype=torch.long, device=dev)
            self.row_offsets = torch.arange(self.rows, device=dev)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise StrataError("empty prompt: at least one token is needed")
        if len(prompt_ids) >= self.max_len:
            raise StrataError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_len}")
        vocab = self.target.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise StrataError(f"prompt token id {bad[0]} outside the vocabulary 0..{vocab - 1}")

    def _clock(self) -> float:
        """Wall time; with profile=True it first waits for the device, so segments can be told apart."""
        if self.profile and self.target.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() if self.profile else 0.0

    @staticmethod
    def bucket(end: int) -> int:
        """Cells a static step attends over: the power of two (at least 256) that holds `end` cells, so
        a handful of captured graphs serve every length."""
        b = 256
        while b < end:
            b *= 2
        return b

    def _draft(self, anchor: int, pos: int, n: int, params: SamplingParams, gen, bucket: int):
        """Candidates [n] on the device, and q [n, V] when they were sampled from the drafter."""
        drafter = self.drafter
        if self.static and drafter.on_device:
            proposal = self.graphs.run(("draft", bucket), lambda: drafter.propose_static(
                self.anchor_buf, self.pos_buf, n, bucket, self.attention, self.kernels))
        else:
            proposal = drafter.propose(anchor, pos, n)
        if not params.greedy and self.draft_sampling == "sample" and proposal.logits is not None:
            q = process(proposal.logits, params)
            return sample(q, gen), q
        return proposal.tokens, None

    def _verify_step(self, kv_len: int):
        def step():
            window = torch.cat([self.anchor_buf, self.cands_buf, self.pad])
            positions = self.pos_buf + self.row_offsets
            out = self.target.forward_static(window, positions, self.cache, self.drafter.tap_layers, kv_len,
                                             self.attention, self.kernels)
            return out, positions, greedy_accept(out.logits[: self.window], self.cands_buf)
        return step

    def _round(self, anchor: int, pos: int, params: SamplingParams, gen) -> tuple[list[int], int, list[float]]:
        """One propose -> verify -> observe round. Returns ([a, next, candidates...], W, clock marks)."""
        target, drafter, cache = self.target, self.drafter, self.cache
        w = self.window if self.static else min(self.window, self.max_len - pos)
        n = w - 1
        marks = [self._clock()]
        bucket = self.bucket(pos + self.rows)
        if n:
            cands, q = self._draft(anchor, pos, n, params, gen, bucket)
        else:
            cands, q = torch.empty(0, dtype=torch.long, device=target.device), None
        marks.append(self._clock())
        if self.static:
            if n:
                self.cands_buf.copy_(cands)
            kv_len = min(bucket, cache.max_len)
            out, positions, greedy = self.graphs.run(("verify", kv_len), self._verify_step(kv_len))
            logits, cands = out.logits[:w], self.cands_buf
        else:
            window = torch.cat([torch.tensor([anchor], device=target.device), cands])
            out = target(window, pos, cache, taps=drafter.tap_layers)
            logits = out.logits
            greedy = greedy_accept(logits, cands) if params.greedy else None
        packed = greedy if params.greedy else speculative_accept(process(logits, params), cands, q, gen)
        values = packed.tolist()  # the round's one host synchronisation
        a = values[0]
        cache.commit(pos + a + 1)
        marks.append(self._clock())
        if self.static and drafter.on_device:
            self.graphs.run(("observe", kv_len), lambda: drafter.observe_static(out.taps, positions, self.kernels))
        else:
            drafter.observe([anchor] + values[2:2 + a], pos, None if out.taps is None else out.taps[: a + 1])
        if self.static:
            self.anchor_buf.fill_(values[1])
            self.pos_buf.fill_(pos + a + 1)
        marks.append(self._clock())
        return values, w, marks

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_ids: set[int] | frozenset = frozenset(),
        params: SamplingParams = SamplingParams(),
        on_tokens: Callable[[list[int]], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        self.check_prompt(prompt_ids)
        if max_new_tokens < 1:
            raise StrataError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        target, cache, drafter = self.target, self.cache, self.drafter
        dev = target.device
        res = GenerationResult(list(prompt_ids), drafter=drafter.name, window=self.window)
        res.per_position_drafted = [0] * (self.window - 1)
        res.per_position_accepted = [0] * (self.window - 1)
        gen = None if params.greedy else params.generator(dev)
        budget = min(max_new_tokens, self.max_len + 1 - len(prompt_ids))  # the context's end

        def emit(tokens: list[int]) -> bool:
            """Append tokens up to a stop id or the budget; True when generation is over."""
            out = []
            done = False
            for t in tokens:
                out.append(t)
                if t in stop_ids:
                    res.finish_reason, done = "stop", True
                    break
                if len(res.output_ids) + len(out) >= budget:
                    res.finish_reason, done = "length", True
                    break
            res.output_ids.extend(out)
            if on_tokens and out:
                on_tokens(out)
            return done

        t0 = time.perf_counter()
        cache.reset()
        drafter.reset()
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
        out = target(prompt, 0, cache, taps=drafter.tap_layers, last_only=True)
        cache.commit(len(prompt_ids))
        drafter.observe(prompt_ids, 0, out.taps)
        if params.greedy:
            anchor = int(out.logits[-1].argmax().item())
        else:
            anchor = int(sample(process(out.logits[-1:], params), gen).item())
        if self.static:
            self.anchor_buf.fill_(anchor)
            self.pos_buf.fill_(len(prompt_ids))
        res.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        done = emit([anchor])
        while not done:
            if should_stop is not None and should_stop():
                res.finish_reason = "abort"
                break
            pos = cache.length
            if pos >= self.max_len:
                res.finish_reason = "length"
                break
            values, w, (t_draft, t_verify, t_observe, t_end) = self._round(anchor, pos, params, gen)
            a, anchor = values[0], values[1]
            res.draft_s += (t_verify - t_draft) + (t_end - t_observe)
            res.verify_s += t_observe - t_verify
            res.accept_lengths.append(a + 1)
            for i in range(w - 1):
                res.per_position_drafted[i] += 1
                res.per_position_accepted[i] += int(i < a)
            done = emit(values[2:2 + a] + [anchor])
        res.decode_s = time.perf_counter() - t1
        return res
