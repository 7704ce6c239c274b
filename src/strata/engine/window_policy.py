"""An adaptive verify window: each round verifies w <= W tokens, the w with the most committed tokens per
second expected from the acceptance so far (or, with --spec auto, from the drafter's confidence in this
round's candidates) and the measured cost of a round at each w.

Where a verify's cost grows with its rows (a mixture-of-experts target reads up to w x top-k experts),
a long window whose tail is rarely accepted costs more than it brings; where verifying is nearly free
the full window stays. Greedy verification accepts exactly the target's tokens at any w, so the
window never changes the output."""

from __future__ import annotations

from typing import Callable

#: rounds each candidate window is measured at first (the first of them, which may capture graphs, is
#: not counted), and how often a window not chosen is measured again
PROBES = 2
REPROBE_EVERY = 64
#: weight of a new round in a window's running cost
EMA = 0.2


def candidate_windows(window: int) -> list[int]:
    """Powers of two from 2 below W, and W (in the static layout each is a set of captured graphs)."""
    out, w = [], 2
    while w < window:
        out.append(w)
        w *= 2
    return out + [window]


class WindowPolicy:
    def __init__(self, window: int, cost: Callable[[int], float] | None = None):
        """cost(w): a fixed cost model in place of measured rounds (tests, what-if runs)."""
        self.windows = candidate_windows(window)
        self.fixed_cost = cost
        self.tried = [0] * (window - 1)  # rounds that verified a candidate at each position
        self.kept = [0] * (window - 1)  # ... and accepted it
        self.rated = [0.0] * (window - 1)  # ... and the drafter's confidences there, summed
        self.seen = {w: 0 for w in self.windows}
        self.cost = {w: None for w in self.windows}
        self.rounds = 0

    def expected_tokens(self, w: int) -> float:
        """Committed tokens a round of window w brings: 1 + sum over j < w of P(the first j candidates all
        accepted), each position's conditional acceptance estimated with a uniform prior."""
        total, alive = 1.0, 1.0
        for i in range(w - 1):
            alive *= (self.kept[i] + 1) / (self.tried[i] + 2)
            total += alive
        return total

    def expected_from(self, confidence: list[float], w: int) -> float:
        """Committed tokens a round of window w brings as the drafter rates its candidates: 1 + sum over j < w of
        the product of the first j conditional confidences, each scaled by how often candidates at its position
        were accepted against how confident the drafter was there (a calibration, with a prior of one)."""
        total, alive = 1.0, 1.0
        for i in range(w - 1):
            alive *= min(1.0, confidence[i] * (self.kept[i] + 1) / (self.rated[i] + 1))
            total += alive
        return total

    def cost_of(self, w: int) -> float | None:
        return self.fixed_cost(w) if self.fixed_cost is not None else self.cost[w]

    def choose(self, confidence: list[float] | None = None) -> int:
        """The window to verify; confidence: the drafter's rating of this round's candidates (--spec auto)."""
        if self.fixed_cost is None:
            for w in self.windows:  # measure every window first, then one of them again now and then
                if self.seen[w] < PROBES:
                    return w
            if confidence is None and self.rounds % REPROBE_EVERY == 0:  # ratings move the choice on their own
                return self.windows[(self.rounds // REPROBE_EVERY) % len(self.windows)]
        return self.best(confidence)

    def best(self, confidence: list[float] | None = None) -> int:
        def expected(w):
            return self.expected_tokens(w) if confidence is None else self.expected_from(confidence, w)

        return max(self.windows, key=lambda w: expected(w) / max(self.cost_of(w) or 0.0, 1e-9))

    def record(self, w: int, accepted: int, seconds: float, confidence: list[float] | None = None) -> None:
        """A round of window w that accepted `accepted` candidates and took `seconds` (host wall time, the
        round's one synchronisation included); confidence: the drafter's rating of its candidates."""
        self.rounds += 1
        for i in range(min(accepted + 1, w - 1)):
            self.tried[i] += 1
            self.kept[i] += int(i < accepted)
            if confidence is not None:
                self.rated[i] += confidence[i]
        if w in self.seen:
            self.seen[w] += 1
            if self.seen[w] > 1:  # the first round of a window may capture its graphs
                old = self.cost[w]
                self.cost[w] = seconds if old is None else (1 - EMA) * old + EMA * seconds
