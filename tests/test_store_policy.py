"""Eviction policies and the doorkeeper: scripted scenarios with exact survivors and order."""

from __future__ import annotations

import pytest
from store_helpers import make_variant

from cachecraft.store.config import StoreConfig
from cachecraft.store.policy import Doorkeeper, VariantStats, decayed, make_policy
from cachecraft.store.store import TieredStore

SIZE = 512


def memory_store(policy: str, threshold: int, slots: int = 3, **kw: object) -> TieredStore:
    kw.setdefault("admit_all_below", 0.0)  # the doorkeeper decides from the first offer
    cfg = StoreConfig(
        memory_bytes=slots * SIZE, policy=policy, doorkeeper_threshold=threshold, **kw
    )
    return TieredStore(cfg)


def request(store: TieredStore, key: str, cfo: float = 0.0) -> str:
    """One request's use of chunk `key`: hit the first variant, or miss and offer."""
    metas = store.variants(key)
    if metas and store.load(metas[0].variant_id) is not None:
        store.record_hit(metas[0].variant_id, cfo)
        result = "hit"
    else:
        store.record_miss(key)
        result = "stored" if store.offer(make_variant(key)).stored else "refused"
    store.check_integrity()
    return result


def resident(store: TieredStore) -> set[str]:
    return {store.ram[0].get(v).chunk_key for v in store.ram[0].ids()}  # type: ignore[union-attr]


def evicted(store: TieredStore) -> list[str]:
    ids = {make_variant(k).variant_id: k for k in "abcdefghxyz"} | {
        make_variant(f"x{i}").variant_id: f"x{i}" for i in range(10)
    }
    return [ids[v] for _, v, _ in store.eviction_log]


def test_lru_scenario() -> None:
    store = memory_store("lru", threshold=1)
    assert [request(store, k) for k in "abc"] == ["stored"] * 3
    assert request(store, "a") == "hit"
    assert request(store, "d") == "stored"  # b is least recently used
    assert resident(store) == {"a", "c", "d"}
    for k in ("x0", "x1"):  # a flood of one-off chunks flushes the hot chunk a
        assert request(store, k) == "stored"
    assert evicted(store) == ["b", "c", "a"]
    assert resident(store) == {"d", "x0", "x1"}


def test_lfu_scenario() -> None:
    store = memory_store("lfu", threshold=1)
    for k in "abc":
        request(store, k)
    for k in "aac":
        assert request(store, k) == "hit"
    assert request(store, "d") == "stored"  # b: 0 hits
    assert request(store, "e") == "stored"  # d: 0 hits, a new entry dies first under LFU
    assert evicted(store) == ["b", "d"]
    assert resident(store) == {"a", "c", "e"}


def test_value_scenario_doorkeeper_and_gating() -> None:
    store = memory_store("value", threshold=2, decay_half_life=1e12)
    for k in "abc":
        assert request(store, k) == "refused"  # first sighting: doorkeeper
        assert request(store, k) == "stored"
    for _ in range(3):
        assert request(store, "a", cfo=0.0) == "hit"  # a: freq 5, saves 8 tokens per hit
    assert request(store, "b", cfo=0.5) == "hit"  # b: freq 3, saves 4 -> value 12
    # c: freq 2, prior CFO 0.5 -> value 8; d arrives with freq 2, value 8: c goes (tie)
    assert request(store, "d") == "refused"
    assert request(store, "d") == "stored"
    assert evicted(store) == ["c"]
    for i in range(5):  # one-off flood: every chunk is seen once, nothing is displaced
        assert request(store, f"x{i}") == "refused"
    assert resident(store) == {"a", "b", "d"}
    assert request(store, "d", cfo=0.0) == "hit"  # d: freq 3, saves 8 -> 24
    assert request(store, "e") == "refused"
    assert request(store, "e") == "refused"  # value 8 < every resident: not admitted
    assert evicted(store) == ["c"]
    assert resident(store) == {"a", "b", "d"}
    stats = store.stats()
    assert stats.rejected["doorkeeper"] == 10 and stats.rejected["value"] == 1
    assert stats.hits["memory"] == 5 and stats.admitted == 4


def test_value_decay_lets_new_hot_chunk_in() -> None:
    store = memory_store("value", threshold=2, slots=1, decay_half_life=2.0)
    request(store, "a")
    request(store, "a")
    for _ in range(3):
        request(store, "a")  # a: freq ~ 5 at tick 5
    request(store, "b")
    assert request(store, "b") == "refused"  # a (value ~ 2.9 x 8) outweighs b (2 x 4)
    for i in range(12):  # 12 one-off lookups later a's frequency has decayed to ~0.05
        assert request(store, f"y{i}") == "refused"
    assert resident(store) == {"a"}
    assert request(store, "b") == "stored"
    assert resident(store) == {"b"}


def test_chunk_cap_keeps_most_valuable() -> None:
    store = TieredStore(
        StoreConfig(memory_bytes=100 * SIZE, doorkeeper_threshold=1, max_variants_per_chunk=2)
    )
    v1, v2, v3 = (make_variant("c", s_old=(s,)) for s in "xyz")
    assert store.offer(v1).stored and store.offer(v2).stored
    store.record_hit(v1.variant_id, 0.0)
    store.record_hit(v2.variant_id, 0.9)
    assert store.offer(v3).stored  # v2 saves least (CFO 0.9) and goes
    store.check_integrity()
    assert {m.variant_id for m in store.variants("c")} == {v1.variant_id, v3.variant_id}
    assert store.stats().evictions["memory:chunk_cap"] == 1


def test_doorkeeper_counts_one_sighting_per_request() -> None:
    dk = Doorkeeper(threshold=2, max_keys=2)
    dk.sight_miss("a")
    dk.sight_offer("a")  # same request: no second count
    assert dk.count("a") == 1 and not dk.admits("a")
    dk.sight_offer("a")  # an offer without a preceding miss is a sighting
    assert dk.admits("a")
    dk.sight_miss("b")
    dk.sight_miss("c")  # forgets a (oldest)
    assert dk.count("a") == 0 and len(dk) == 2


def test_value_score_formula() -> None:
    policy = make_policy("value", half_life=10.0)
    st = VariantStats("v", "c", num_tokens=100, nbytes=1000)
    policy.on_admit(st, sightings=2, now=0.0)
    policy.on_hit(st, cfo=0.2, now=10.0)  # freq = 2 * 0.5 + 1 = 2
    assert st.freq == pytest.approx(2.0)
    assert policy.score(st, now=10.0) == pytest.approx(2.0 * 100 * 0.8 / 1000)
    assert policy.score(st, now=20.0) == pytest.approx(1.0 * 100 * 0.8 / 1000)
    assert decayed(4.0, 0.0, 5.0, float("inf")) == 4.0


def test_unknown_policy() -> None:
    with pytest.raises(ValueError):
        make_policy("fifo")
    with pytest.raises(ValueError):
        StoreConfig(policy="fifo")


def test_with_room_to_spare_every_chunk_is_admitted_on_first_sight() -> None:
    store = memory_store("value", threshold=2, slots=4, admit_all_below=0.5)
    assert store.would_admit("a")  # empty: room to spare
    assert request(store, "a") == "stored"  # first sighting, admitted
    store.ROOM_RECHECK_S = 0.0  # measure the fill at every decision
    assert request(store, "b") == "stored"  # 1 of 4 slots used: still below half
    assert not store.would_admit("c")  # 2 of 4 slots: the doorkeeper decides again
    assert request(store, "c") == "refused"
    assert store.stats().rejected["doorkeeper"] == 1
    assert request(store, "c") == "stored"  # its second sighting
