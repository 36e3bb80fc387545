"""ChunkStore: the whole interface callers (planner, runner, engine, server, benchmarks) use to
reach chunk-caches, with the contract of each method. Nobody probes a store with `getattr`.

The one implementation is `store.TieredStore`; `memory.MemoryStore` is its memory-only, LRU
configuration. Tiers below it (`RamTier`, `DiskTier`, `RedisTier`) share one `put`/`get` shape
(`tier.Tier`) and are not ChunkStores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from cachecraft.store.layers import LayerReader
from cachecraft.store.meta import VariantMeta
from cachecraft.store.stats import StoreStats
from cachecraft.store.variant import Variant

StorageDtype = Literal["float16", "bfloat16", "float32"]

RefusalReason = Literal["doorkeeper", "chunk_cap", "value", "too_big", "write_failed"]
"""Why `offer` stored a variant nowhere: the doorkeeper has not seen its chunk often enough;
the per-chunk cap (`max_variants_per_chunk`) keeps more valuable variants of the chunk; the
eviction policy values it below what it would have to evict; it is bigger than every tier;
every tier that would have taken it failed to write it (disk full or unwritable)."""


@dataclass(frozen=True, slots=True)
class OfferResult:
    """What `ChunkStore.offer` did with one variant.

    stored: at least one tier holds it now (then `reason` is None).
    reason: why it is stored nowhere (None when stored); also the key of the store's
    `StoreStats.rejected` counter it was counted under.
    write_error: a tier's write failed (`"OSError: ..."`), whether or not another tier took
    the variant; None when no write failed.
    queued: `offer(..., wait=False)` left the slow tiers' writes (disk, Redis) to a
    background writer; `stored` then says whether memory holds it, `reason` is None, and
    the writes' outcome is counted in `StoreStats` when they end.
    """

    variant_id: str
    stored: bool
    reason: RefusalReason | None = None
    write_error: str | None = None
    queued: bool = False

    def __post_init__(self) -> None:
        if self.stored and self.reason is not None:
            raise ValueError("an offer is stored with a reason for refusing it")
        if not (self.stored or self.queued or self.reason is not None):
            raise ValueError("an offer is refused with no reason")

    def __bool__(self) -> bool:
        raise TypeError("read OfferResult.stored (a result is not a truth value)")


class TierHealth(NamedTuple):
    """One tier as `/health` reports it."""

    name: str
    """memory, host, disk or redis."""
    is_reachable: bool
    """False only for a shared tier that is down (then the store serves from local tiers)."""
    num_variants: int
    nbytes: int
    detail: str | None = None
    """Why it is degraded, e.g. "1 of 3 shards unreachable: serving from local tiers"; None
    while all is well."""


class ChunkStore(Protocol):
    @property
    def storage_dtype(self) -> StorageDtype:
        """The dtype new variants' K/V are cast to before `offer` (the runner reads it)."""
        ...

    def variants(self, chunk_key: str) -> list[VariantMeta]:
        """Metadata of every stored variant of `chunk_key`, pinned ones included, each id once
        (cheap: no tensors are read). An unreachable tier contributes nothing; never raises."""
        ...

    def load(self, variant_id: str) -> Variant | None:
        """The variant's K/V, promoted into memory; None if it is gone (evicted, corrupt,
        unreachable). Never raises for a missing variant."""
        ...

    def offer(self, variant: Variant, wait: bool = True) -> OfferResult:
        """Offer a freshly computed variant; admission (doorkeeper, per-chunk cap, policy,
        space) decides. Never raises for a refusal or a failed write: the result says whether
        any tier stored it, why not (`OfferResult.reason`) and which write failed. Offering
        a variant that is stored already refreshes it (its hit history is kept).

        wait=False: admission and the memory tier act now; the disk and Redis writes may be
        left to a background writer (`OfferResult.queued`), so that a caller on a serving
        path does not wait for file writes and fsyncs."""
        ...

    def would_admit(self, chunk_key: str) -> bool:
        """Would admission let in a variant of `chunk_key` offered by a request that misses it
        now (its miss counted)? Cheap; the prefill skips attention statistics for chunks that
        would be turned away. Space may still refuse it later."""
        ...

    def record_hit(self, variant_id: str, cfo: float) -> None:
        """A request reused this variant, recomputing a fraction `cfo` of its tokens (feeds the
        eviction policy; shared with other processes when the store is)."""
        ...

    def record_miss(self, chunk_key: str) -> None:
        """A request needed `chunk_key` and no variant was found (one doorkeeper sighting)."""
        ...

    def prefetch(self, variant_ids: list[str]) -> None:
        """Start bringing these variants from slow tiers into memory in the background; returns
        at once. A later `load`/`open_layers` waits for an in-flight fetch instead of repeating
        it. Unknown ids are ignored."""
        ...

    def open_layers(self, variant_id: str) -> LayerReader | None:
        """A layer-wise reader of the variant's K/V (from memory as slices, from disk lazily
        with read-ahead); None if the variant is nowhere. The caller closes it."""
        ...

    def pin(self, variant: Variant, namespace: str = "default") -> None:
        """Keep `variant` in memory and never evict it, nor its disk copy (a restart pins it
        again from there); it is served even when admission or capacity would refuse it, until
        `unpin`, `remove` of its chunk or `clear`. The bytes count
        against `namespace` (the tenant that asked); past `max_pinned_bytes_per_namespace`
        it raises PinLimitError and pins nothing. Pinning a pinned variant again is a no-op."""
        ...

    def unpin(self, variant_id: str) -> bool:
        """Release a pin (its bytes stop counting against its namespace); the variant stays in
        whichever tiers hold it, a copy held only by the pin is dropped. False if it was not
        pinned."""
        ...

    def pinned_variant_ids(self) -> set[str]:
        """Ids of every pinned variant."""
        ...

    def pinned_chunk_keys(self) -> set[str]:
        """Chunk keys with at least one pinned variant."""
        ...

    def pinned_nbytes(self, chunk_keys: set[str]) -> int:
        """Bytes pinned for variants of these chunk keys (one tenant's share)."""
        ...

    def remove(self, chunk_key: str) -> int:
        """Unpin and drop every variant of `chunk_key` from every tier; returns how many
        variant ids were dropped (0 if none). Raises StoreUnavailableError, having removed
        nothing, when a shared tier is unreachable (its copies would outlive the removal)."""
        ...

    def forget_in_memory(self, chunk_key: str) -> int:
        """Unpin and drop every variant of `chunk_key` from this process's memory tiers only,
        leaving disk and Redis as they are (another process sharing them removed it there);
        returns how many variant ids were dropped."""
        ...

    def clear(self) -> None:
        """Drop every variant (pinned ones too) from every tier, shared tiers included."""
        ...

    def stats(self) -> StoreStats:
        """A snapshot of the counters with current bytes and counts per tier."""
        ...

    def health(self) -> list[TierHealth]:
        """Each configured tier, top down, with whether it is reachable now."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError unless every tier is internally consistent and within capacity
        and the per-chunk cap holds (tests call this after every step)."""
        ...

    def close(self) -> None:
        """Finish background work and release files and connections. Idempotent."""
        ...
