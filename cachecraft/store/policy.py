"""Eviction policies (value, lru, lfu) and the admission doorkeeper. Pure Python, no torch.

Owns the arithmetic of ranking variants; never touches tensors, files or tiers. Time is a
number supplied by the caller (the store uses a logical clock: one tick per chunk lookup).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

PolicyName = Literal["value", "lru", "lfu"]
POLICIES: tuple[str, ...] = ("value", "lru", "lfu")


@dataclass(slots=True)
class VariantStats:
    """What the policies know about one stored variant (mutable; updated on hits)."""

    variant_id: str
    chunk_key: str
    num_tokens: int
    nbytes: int
    hits: int = 0
    cfo_sum: float = 0.0
    freq: float = 0.0
    """Decayed hit frequency as of `last_tick`."""
    last_tick: float = 0.0

    def mean_cfo(self, prior: float) -> float:
        return self.cfo_sum / self.hits if self.hits else prior


def decayed(freq: float, since: float, now: float, half_life: float) -> float:
    """`freq` measured at tick `since`, decayed to tick `now` (halves every `half_life` ticks)."""
    if half_life <= 0 or math.isinf(half_life):
        return freq
    return freq * 0.5 ** (max(0.0, now - since) / half_life)


class EvictionPolicy:
    """Ranks variants: a higher `score` is kept longer. Subclasses define `score`.

    `gates_admission`: a candidate only displaces residents that score lower than itself.
    """

    name: str = "base"
    gates_admission: bool = False

    def __init__(self, half_life: float = 2000.0, prior_cfo: float = 0.5) -> None:
        self.half_life = half_life
        self.prior_cfo = prior_cfo

    def score(self, stats: VariantStats, now: float) -> float:
        raise NotImplementedError

    def on_hit(self, stats: VariantStats, cfo: float, now: float) -> None:
        stats.freq = decayed(stats.freq, stats.last_tick, now, self.half_life) + 1.0
        stats.hits += 1
        stats.cfo_sum += min(1.0, max(0.0, cfo))
        stats.last_tick = now

    def on_admit(self, stats: VariantStats, sightings: int, now: float) -> None:
        """A new variant starts with the demand its chunk already showed."""
        stats.freq = float(sightings)
        stats.last_tick = now

    def order(self, stats: Iterable[VariantStats], now: float) -> list[VariantStats]:
        """Least valuable first; ties broken by age, then id, so the order is deterministic."""
        return sorted(stats, key=lambda s: (self.score(s, now), s.last_tick, s.variant_id))

    def victims(
        self,
        residents: Iterable[VariantStats],
        need_bytes: int,
        now: float,
        candidate: VariantStats | None = None,
    ) -> list[VariantStats] | None:
        """Residents to evict, in order, to free `need_bytes`; None if the candidate must not
        displace them (a gating policy and a resident worth more than the candidate)."""
        chosen: list[VariantStats] = []
        freed = 0
        cand_score = self.score(candidate, now) if candidate is not None else math.inf
        for s in self.order(residents, now):
            if freed >= need_bytes:
                break
            if self.gates_admission and self.score(s, now) > cand_score:
                return None
            chosen.append(s)
            freed += s.nbytes
        return chosen if freed >= need_bytes else None


class ValuePolicy(EvictionPolicy):
    """decayed hit frequency x tokens saved per hit / bytes (cache-craft.md §5, [ours])."""

    name = "value"
    gates_admission = True

    def score(self, stats: VariantStats, now: float) -> float:
        freq = decayed(stats.freq, stats.last_tick, now, self.half_life)
        saved = stats.num_tokens * (1.0 - stats.mean_cfo(self.prior_cfo))
        return freq * saved / max(1, stats.nbytes)


class LRUPolicy(EvictionPolicy):
    """Least recently used (admission, hit) goes first."""

    name = "lru"

    def score(self, stats: VariantStats, now: float) -> float:
        return stats.last_tick


class LFUPolicy(EvictionPolicy):
    """Fewest hits goes first (no decay); ties: least recently used."""

    name = "lfu"

    def on_admit(self, stats: VariantStats, sightings: int, now: float) -> None:
        stats.last_tick = now

    def score(self, stats: VariantStats, now: float) -> float:
        return float(stats.hits)


def make_policy(name: str, half_life: float = 2000.0, prior_cfo: float = 0.5) -> EvictionPolicy:
    classes: dict[str, type[EvictionPolicy]] = {
        "value": ValuePolicy,
        "lru": LRUPolicy,
        "lfu": LFUPolicy,
    }
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {POLICIES}")
    return classes[name](half_life=half_life, prior_cfo=prior_cfo)


class Doorkeeper:
    """Counts sightings per chunk key; a chunk is admitted once seen `threshold` times.

    A request that misses a chunk and then offers its variant is one sighting, not two: a miss
    leaves the key pending and the next offer of that key does not count again. At most
    `max_keys` keys are remembered (oldest forgotten first). threshold <= 1 admits everything.
    """

    def __init__(self, threshold: int = 2, max_keys: int = 65536) -> None:
        self.threshold = threshold
        self.max_keys = max_keys
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._pending: set[str] = set()

    def sight_miss(self, chunk_key: str) -> None:
        self._bump(chunk_key)
        self._pending.add(chunk_key)

    def sight_offer(self, chunk_key: str) -> None:
        if chunk_key in self._pending:
            self._pending.discard(chunk_key)
        else:
            self._bump(chunk_key)

    def count(self, chunk_key: str) -> int:
        return self._counts.get(chunk_key, 0)

    def admits(self, chunk_key: str) -> bool:
        return self.threshold <= 1 or self.count(chunk_key) >= self.threshold

    def would_admit_after_miss(self, chunk_key: str) -> bool:
        """admits() once one more miss of `chunk_key` is counted (a miss always counts)."""
        return self.threshold <= 1 or self.count(chunk_key) + 1 >= self.threshold

    def __len__(self) -> int:
        return len(self._counts)

    def _bump(self, chunk_key: str) -> None:
        self._counts[chunk_key] = self._counts.get(chunk_key, 0) + 1
        self._counts.move_to_end(chunk_key)
        while len(self._counts) > self.max_keys:
            old, _ = self._counts.popitem(last=False)
            self._pending.discard(old)
