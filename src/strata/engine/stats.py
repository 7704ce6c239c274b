"""Acceptance statistics in one place: committed tokens per round (tau) and acceptance by candidate
position, for one generation or summed over many (the gate, the server's metrics, the bench)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Acceptance:
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per round, bonus included
    drafted: list[int] = field(default_factory=list)  # rounds that proposed a candidate at each position
    accepted: list[int] = field(default_factory=list)  # ... and where it was accepted

    def add_round(self, accepted: int, window: int, delivered: int | None = None) -> None:
        """A round that verified `window` tokens and accepted `accepted` of its window-1 candidates, of which
        (with the bonus token) `delivered` reached the output: a stop token or the token budget can end
        a round early, and tokens it discards count as neither committed nor accepted."""
        delivered = accepted + 1 if delivered is None else delivered
        accepted = min(accepted, delivered)
        self.accept_lengths.append(delivered)
        n = window - 1
        if len(self.drafted) < n:
            grow = n - len(self.drafted)
            self.drafted += [0] * grow
            self.accepted += [0] * grow
        for i in range(n):
            self.drafted[i] += 1
            self.accepted[i] += int(i < accepted)

    def merge(self, other: "Acceptance") -> "Acceptance":
        out = Acceptance(self.accept_lengths + other.accept_lengths)
        n = max(len(self.drafted), len(other.drafted))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        out.drafted = [a + b for a, b in zip(pad(self.drafted), pad(other.drafted))]
        out.accepted = [a + b for a, b in zip(pad(self.accepted), pad(other.accepted))]
        return out

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(self.drafted)
        return sum(self.accepted) / drafted if drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    def summary(self) -> dict:
        return {"rounds": self.rounds, "drafted": sum(self.drafted), "accepted": sum(self.accepted),
                "acceptance_rate": self.acceptance_rate, "tau": self.tau, "accept_lengths": self.accept_lengths,
                "per_position_acceptance": self.per_position}
