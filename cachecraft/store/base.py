"""ChunkStore: the whole interface callers (planner, runner, engine, server, benchmarks) use to
reach chunk-caches, with the contract of each method; `PinView`, what it says about pins. Nobody
probes a store with `getattr`.

The one implementation is `store.TieredStore` (its write-behind, prefetcher and pin set are
collaborators behind this surface); `memory.MemoryStore` is its memory-only, LRU
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

RefusalReason = Literal["doorkeeper", "chunk_cap", "value", "too_big", "write_failed", "not_finite"]
"""Why `offer` stored a variant nowhere: its K/V hold a NaN or an infinity (never stored
anywhere); the doorkeeper has not seen its chunk often enough;
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


class PinView(Protocol):
    """What a store's pins are, for listing and per-tenant accounting (read-only)."""

    def variant_ids(self) -> set[str]:
        """Returns: the ids of every pinned variant."""
        ...

    def chunk_keys(self) -> set[str]:
        """Returns: the chunk keys with at least one pinned variant."""
        ...

    def nbytes(self, chunk_keys: set[str] | None = None) -> int:
        """Args: chunk_keys: the chunks to count (one tenant's), or None for all.

        Returns: the bytes pinned for variants of those chunks."""
        ...


class ChunkStore(Protocol):
    """Chunk-caches by chunk key and variant id. Thread-safe; no method raises for a missing
    variant or an unreachable tier (a miss recomputes), except where it says so."""

    @property
    def storage_dtype(self) -> StorageDtype:
        """The dtype new variants' K/V are cast to before `offer` (the runner reads it)."""
        ...

    # -- reads --------------------------------------------------------------------------
    def variants(self, chunk_key: str) -> list[VariantMeta]:
        """Args: chunk_key: the chunk asked for.

        Returns: metadata of every stored variant of it, pinned ones included, each id once
        (cheap: no tensors are read); an unreachable tier contributes nothing."""
        ...

    def load(self, variant_id: str) -> Variant | None:
        """Args: variant_id: an id from `variants`.

        Returns: the variant's K/V, promoted into memory; None if it is gone (evicted,
        corrupt, unreachable)."""
        ...

    def open_layers(self, variant_id: str) -> LayerReader | None:
        """Args: variant_id: an id from `variants`.

        Returns: a layer-wise reader of its K/V (from memory as slices, from disk lazily with
        read-ahead), which the caller closes; None if the variant is nowhere."""
        ...

    def prefetch(self, variant_ids: list[str]) -> None:
        """Start bringing these variants from slow tiers into memory in the background;
        returns at once. A later `load`/`open_layers` waits for an in-flight fetch instead of
        repeating it. Unknown ids are ignored.

        Args: variant_ids: ids from `variants`, of a request waiting in the queue."""
        ...

    # -- admission ----------------------------------------------------------------------
    def offer(self, variant: Variant, wait: bool = True) -> OfferResult:
        """Offer a freshly computed variant; admission (doorkeeper, per-chunk cap, policy,
        space) decides. Offering a stored variant again refreshes it (its hit history kept).

        Args:
            variant: K/V already cast to `storage_dtype`, with its metadata.
            wait: False lets the disk and Redis writes go to a background writer
                (`OfferResult.queued`), so a caller on a serving path does not wait for file
                writes and fsyncs; admission and the memory tier act at once either way.
        Returns: whether any tier stored it, why not (`OfferResult.reason`) and which write
            failed; a refusal or a failed write never raises."""
        ...

    def would_admit(self, chunk_key: str) -> bool:
        """Args: chunk_key: a chunk the current request misses (its miss counted).

        Returns: whether admission would let in a variant of it now (cheap; the prefill skips
        attention statistics for chunks that would be turned away). Space may still refuse
        it later."""
        ...

    def record_hit(self, variant_id: str, cfo: float) -> None:
        """A request reused this variant (feeds the eviction policy; shared with other
        processes when the store is).

        Args:
            variant_id: the variant reused.
            cfo: the fraction of its tokens recomputed, in [0, 1]."""
        ...

    def record_miss(self, chunk_key: str) -> None:
        """A request needed `chunk_key` and no variant was found (one doorkeeper sighting).

        Args: chunk_key: the chunk missed."""
        ...

    # -- pins ---------------------------------------------------------------------------
    def pin(self, variant: Variant, namespace: str = "default") -> bool:
        """Keep `variant` in memory and never evict it, nor its disk copy (a restart pins it
        again from there); it is served even when admission or capacity would refuse it, until
        `unpin`, `remove` of its chunk or `clear`. Pinning a pinned variant again is a no-op.

        Args:
            variant: the variant to keep.
            namespace: the tenant that asked; the bytes count against it.
        Returns: whether the pin is durable: its disk copy exists (a restart can pin it again);
            False without a disk tier or when writing the copy failed.
        Raises: PinLimitError, pinning nothing, past `max_pinned_bytes_per_namespace`;
            CorruptVariantError, pinning nothing, if its K/V hold a NaN or an infinity."""
        ...

    def unpin(self, variant_id: str) -> bool:
        """Release a pin (its bytes stop counting against its namespace); the variant stays in
        whichever tiers hold it, a copy held only by the pin is dropped.

        Args: variant_id: the pinned variant.
        Returns: False if it was not pinned."""
        ...

    def pinned(self) -> PinView:
        """Returns: a live view of which variants are pinned and how many bytes, per chunk."""
        ...

    # -- removal ------------------------------------------------------------------------
    def remove(self, chunk_key: str) -> int:
        """Unpin and drop every variant of `chunk_key` from every tier.

        Args: chunk_key: the chunk to remove.
        Returns: how many variant ids were dropped (0 if none).
        Raises: StoreUnavailableError, having removed nothing, when a shared tier is
            unreachable (its copies would outlive the removal)."""
        ...

    def forget_in_memory(self, chunk_key: str) -> int:
        """Unpin and drop every variant of `chunk_key` from this process's memory tiers only,
        leaving disk and Redis as they are (another process sharing them removed it there).

        Args: chunk_key: the chunk removed elsewhere.
        Returns: how many variant ids were dropped."""
        ...

    def clear(self) -> None:
        """Drop every variant (pinned ones too) from every tier, shared tiers included."""
        ...

    # -- operations ---------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Returns: a snapshot of the counters, with current bytes and counts per tier."""
        ...

    def health(self) -> list[TierHealth]:
        """Returns: each configured tier, top down, with whether it is reachable now and, when
        it is degraded, why (`TierHealth.detail`). The store is degraded while any tier is
        unreachable: it still answers, from the tiers it can reach."""
        ...

    def close(self) -> None:
        """Finish background work (queued writes, prefetches) and release files and
        connections. Idempotent."""
        ...
