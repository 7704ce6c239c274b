"""The decode loop: prefill, then rounds of propose -> verify -> commit.

Target-only decoding is the same loop with a drafter that proposes nothing (window 1), each round
launched one ahead in the static layout. The model runner (runner.py) runs the steps; this loop only
decides what to ask for, reads one host value per round, and emits tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..errors import StrataError
from ..models.decoder import ForwardOut
from .acceptance import NOT_FINITE, acceptor
from .config import EngineConfig
from .drafter import Drafter
from .runner import HostCopy, ModelRunner
from .sampling import SamplingParams, process, sample
from .stats import Acceptance
from .window_policy import WindowPolicy


@dataclass
class RoundOutcome:
    """What a round's verify decided: `accepted` of the candidates, then the target's own next token."""

    accepted: int
    next_token: int
    candidates: list[int]
    window: int

    @property
    def emitted(self) -> list[int]:
        return self.candidates[:self.accepted] + [self.next_token]


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    limit: str | None = None  # with finish_reason "length": "max_new_tokens", or "context" (the context ended)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafter: str = "none"
    window: int = 1
    acceptance: Acceptance = field(default_factory=Acceptance)
    tree: int | None = None  # tree verification's nodes per round
    draft_s: float = 0.0  # on a GPU measured only with EngineConfig(profile=True)
    verify_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def accept_lengths(self) -> list[int]:
        return self.acceptance.accept_lengths

    @property
    def tok_s(self) -> float:
        """Tokens produced by the decode rounds per second (the first token comes from prefill)."""
        n = max(self.new_tokens - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def stats(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "output_ids": self.output_ids, "new_tokens": self.new_tokens,
                "finish_reason": self.finish_reason, "limit": self.limit, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "tok_s": self.tok_s, "drafter": self.drafter, "window": self.window,
                **self.acceptance.summary(), "draft_s": self.draft_s, "verify_s": self.verify_s,
                **({} if self.tree is None else {"tree": self.tree,
                                                 "nodes_verified": self.acceptance.rounds * (self.tree + 1)})}


def check_prompt(prompt_ids: list[int], max_len: int, vocab: int) -> None:
    """A prompt the engine can take: not empty, shorter than the context, every id in the vocabulary."""
    if not prompt_ids:
        raise StrataError("empty prompt: at least one token is needed")
    if len(prompt_ids) >= max_len:
        raise StrataError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {max_len}")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise StrataError(f"prompt token id {bad[0]} outside the vocabulary 0..{vocab - 1}")


def not_finite(pos: int, dtype: torch.dtype) -> StrataError:
    """A decode stopped where the target's logits are NaN or inf (in the window from pos), and the likely
    causes."""
    overflow = "" if dtype == torch.float32 else \
        f", or its activations overflow {str(dtype).removeprefix('torch.')} (try --dtype float32)"
    return StrataError(f"the target's logits at position {pos} are not finite (NaN or inf): its weights hold "
                       f"non-finite values (--check-tensors scans them at load){overflow}")


class Engine:
    """A target, a drafter and a model runner: serves one sequence at a time."""

    def __init__(self, target, drafter: Drafter | None = None, config: EngineConfig | None = None, **overrides):
        """config: how to decode (EngineConfig); keyword overrides replace its fields."""
        self.config = replace(config or EngineConfig(), **overrides)
        self.target = target
        self.drafter = drafter or Drafter()
        plan = self.config.resolve(target, drafter)
        self.window, self.max_len = plan.window, plan.max_len
        self.runner = ModelRunner(target, self.drafter, self.config, plan)
        chooses = self.config.adaptive_window or self.config.auto_window
        self.policy = WindowPolicy(self.window) if chooses and self.window > 1 else None

    def check_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt(prompt_ids, self.max_len, self.target.cfg.vocab_size)

    def _clock(self) -> float:
        """Wall time. On a GPU only with profile=True, and after waiting for the device, so that segments
        can be told apart (a wait per segment would cost the speed it measures); on the CPU always."""
        if self.target.device.type != "cuda":
            return time.perf_counter()
        if not self.config.profile:
            return 0.0
        torch.cuda.synchronize()
        return time.perf_counter()

    def _draft(self, anchor: int, pos: int, n: int, kv_len: int, params: SamplingParams, gen):
        """Candidates [n] on the device, q [n, V] when they were sampled from the drafter, the confidences a
        draft may be cut by [n], and the confidences a window may be chosen by [n] (None where the drafter
        rates nothing). Cutting at the first low slot (--draft-p-min) is a stopping rule: a sampled slot's
        rating is its q's largest probability, which depends on the draws before it, not on its own. Choosing
        the window (--spec auto) looks at every slot, so it reads the greedy draft's ratings, which no draw
        changes. Either way rejection sampling stays lossless."""
        if n == 0:
            return torch.empty(0, dtype=torch.long, device=self.target.device), None, None, None
        proposal = self.runner.draft(anchor, pos, n, kv_len)
        rated = proposal.confidence
        sampled = not params.greedy and self.config.draft_sampling == "sample"
        if not sampled or (proposal.draw is None and proposal.logits is None):
            return proposal.tokens, None, rated, rated
        if proposal.draw is not None:
            tokens, q = proposal.draw(lambda logits: process(logits, params), gen)
        else:
            q = process(proposal.logits, params)
            tokens = sample(q, gen)
        return tokens, q, q.amax(-1) if self.config.draft_p_min > 0 else None, rated

    def _launch(self, anchor: int | None, pos: int, params: SamplingParams, gen, accept) -> Launched:
        """A round at pos enqueued: propose, verify, and its outcome's copy to the host, nothing waited for.
        anchor None: the device already holds it (runner.advance after the round before). accept: the
        request's acceptor."""
        runner = self.runner
        started = time.perf_counter()
        w = runner.window_at(pos)
        auto = self.policy is not None and self.config.auto_window
        if self.policy is not None and not auto:
            w = min(w, self.policy.choose())
        kv_len = runner.kv_len(pos, w)
        if anchor is not None:
            runner.start_round(anchor, pos)
        marks, ratings = [self._clock()], None
        if runner.tree is not None:  # greedy only (generate refuses sampling)
            tree = runner.draft_tree(anchor, pos, w - 1, kv_len)
            marks.append(self._clock())
            out, positions, packed = runner.verify_tree(tree, kv_len)
        else:
            cands, q, stop, rated = self._draft(anchor, pos, w - 1, kv_len, params, gen)
            p_min, limit = self.config.draft_p_min, None
            if p_min > 0 and stop is not None:  # the draft ends at its first doubtful slot
                limit = (stop >= p_min).to(torch.int64).cumprod(0).sum().view(1)
            if auto and w > 2:  # the round's second host read: its candidates' ratings pick the window
                ratings = rated.tolist()
                cut = next((i for i, c in enumerate(ratings) if c < p_min), len(ratings))
                ratings = ratings[:cut] + [0.0] * (len(ratings) - cut)  # nothing past a --draft-p-min cut
                w = min(w, self.policy.choose(ratings))
                kv_len, cands, q = runner.kv_len(pos, w), cands[:w - 1], None if q is None else q[:w - 1]
            marks.append(self._clock())
            out, positions, packed = runner.verify(cands, w, kv_len, accept, q, limit)
        return Launched(pos, w, kv_len, out, positions, HostCopy(packed), started, marks, ratings)

    def _finish(self, r: Launched, anchor: int) -> tuple[RoundOutcome, list[float]]:
        """Wait for a launched round's outcome (the round's one host synchronisation), commit it and let the
        drafter observe it; the outcome and the round's clock marks. anchor: the round's first token."""
        runner = self.runner
        values = r.outcome.values()
        if values[1] == NOT_FINITE:
            raise not_finite(r.pos, self.target.dtype)
        outcome = RoundOutcome(values[0], values[1], values[2:], r.window)
        runner.cache.commit(r.pos + outcome.accepted + 1)
        marks = r.marks + [self._clock()]
        runner.observe(r.pos, [anchor] + outcome.candidates[:outcome.accepted], r.out.taps, r.positions, r.kv_len)
        marks.append(self._clock())
        if self.policy is not None:
            self.policy.record(r.window, outcome.accepted, time.perf_counter() - r.started, r.ratings)
        return outcome, marks

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
        self.config.check_sampling(params)
        runner = self.runner
        res = GenerationResult(list(prompt_ids), drafter=self.drafter.name, window=self.window, tree=self.config.tree,
                               acceptance=Acceptance(drafted=[0] * (self.window - 1),
                                                     accepted=[0] * (self.window - 1)))
        gen = None if params.greedy else params.generator(self.target.device)
        accept = acceptor(params, gen)
        room = self.max_len + 1 - len(prompt_ids)  # the context's end
        budget = min(max_new_tokens, room)

        def emit(tokens: list[int]) -> tuple[bool, int]:
            """Append tokens up to a stop id or the budget: (whether generation is over, tokens used)."""
            out = []
            done = False
            for t in tokens:
                out.append(t)
                if t in stop_ids:
                    res.finish_reason, done = "stop", True
                    break
                if len(res.output_ids) + len(out) >= budget:
                    res.finish_reason, done = "length", True
                    res.limit = "max_new_tokens" if max_new_tokens <= room else "context"
                    break
            res.output_ids.extend(out)
            if on_tokens and out:
                on_tokens(out)
            return done, len(out)

        t0 = time.perf_counter()
        runner.reset()
        logits = runner.prefill(prompt_ids).logits
        if not torch.isfinite(logits[-1].max()):
            raise not_finite(len(prompt_ids) - 1, self.target.dtype)
        if params.greedy:
            anchor = int(logits[-1].argmax().item())
        else:
            anchor = int(sample(process(logits[-1:], params), gen).item())
        res.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        done, _ = emit([anchor])
        # Target-only rounds (window 1) advance one position whatever the device decides, so in the static
        # layout the next round is launched before this one's outcome is read: the GPU runs it while the host
        # reads, emits and decides. A stop token found then wastes that round; it only wrote past the
        # committed length. (The dynamic layout runs on the host's clock: there it would only add the waste.)
        ahead = self.window == 1 and runner.static and not self.config.profile
        launched = None
        while not done:
            if should_stop is not None and should_stop():
                res.finish_reason = "abort"
                break
            pos = runner.cache.length
            if launched is None:
                if pos >= self.max_len:
                    res.finish_reason, res.limit = "length", "context"
                    break
                launched = self._launch(anchor, pos, params, gen, accept)
            following = None
            if ahead and pos + 1 < self.max_len and len(res.output_ids) + 1 < budget:
                runner.advance(launched.outcome.device)
                following = self._launch(None, pos + 1, params, gen, accept)
            outcome, (t_draft, t_verify, t_observe, t_end) = self._finish(launched, anchor)
            launched = following
            anchor = outcome.next_token
            res.draft_s += (t_verify - t_draft) + (t_end - t_observe)
            res.verify_s += t_observe - t_verify
            done, used = emit(outcome.emitted)
            res.acceptance.add_round(outcome.accepted, outcome.window, delivered=used)
        res.decode_s = time.perf_counter() - t1
        return res


@dataclass
class Launched:
    """A round enqueued on the device, its outcome still on its way to the host."""

    pos: int
    window: int
    kv_len: int
    out: ForwardOut
    positions: torch.Tensor
    outcome: HostCopy  # [a, next, c1..] (verify.py)
    started: float
    marks: list[float]
    ratings: list[float] | None = None  # --spec auto: the drafter's confidence in each candidate
