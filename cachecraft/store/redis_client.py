"""RedisConnection: how the shared tier reaches Redis or Valkey, one server or a cluster.

Owns building the client (redis-py's `Redis` for one server, `RedisCluster` for a cluster,
where the URLs name startup nodes), lazily, so that a server or cluster down at start-up is an
outage like any other rather than a failed start; the errors that mean "unreachable"; and the
per-shard reachability probe behind the tier's health. Knows nothing of the key layout.
"""

from __future__ import annotations

import threading

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import ClusterError, RedisClusterException, TryAgainError
from redis.retry import Retry

REDIS_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
    ClusterError,  # CLUSTERDOWN, MASTERDOWN, "TTL exhausted" (slots moving or owner gone)
    RedisClusterException,  # no startup node reachable, slot not covered
    TryAgainError,  # a slot is being migrated
)
"""What a call raises when a server or shard is unreachable (never a bug in our commands)."""

Client = redis.Redis | RedisCluster


class RedisConnection:
    """One client for `url`, built on first use. With `cluster`, `url` may name several
    startup nodes separated by commas (`redis://h1:7000,redis://h2:7000`); the first one's
    options (password, TLS) apply to all, and the cluster's own map of slots to shards is
    learned from whichever answers."""

    def __init__(self, url: str, cluster: bool = False, timeout_s: float = 0.5) -> None:
        self.url = url
        self.is_cluster = cluster
        self.timeout_s = timeout_s
        self._client: Client | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Client:
        """The client; raises one of REDIS_ERRORS when a cluster has no reachable startup
        node yet (the caller treats it as an outage and asks again after its back-off)."""
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _connect(self) -> Client:
        timeouts = {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s}
        if not self.is_cluster:
            return redis.Redis.from_url(self.url, **timeouts)
        urls = [u.strip() for u in self.url.split(",") if u.strip()]
        options = parse_url(urls[0])
        options.pop("db", None)  # a cluster has database 0 only
        nodes = [ClusterNode(parse_url(u)["host"], parse_url(u).get("port", 6379)) for u in urls]
        options.pop("host", None)
        options.pop("port", None)
        # One retry, at once, after the client refreshed its map of slots (a slot that moved
        # is found); past that the tier backs off as a whole instead of sleeping per call.
        retry = Retry(NoBackoff(), retries=1)
        return RedisCluster(startup_nodes=nodes, retry=retry, **options, **timeouts)

    def shards_down(self) -> tuple[int, int]:
        """(shards that do not answer PING, shards): one server counts as one shard. Raises one
        of REDIS_ERRORS when not even the map of shards can be had."""
        client = self.client
        if not isinstance(client, RedisCluster):
            return (0 if client.ping() else 1), 1
        primaries = client.get_primaries()
        down = 0
        for node in primaries:
            try:
                client.ping(target_nodes=node)
            except REDIS_ERRORS:
                down += 1
        return down, len(primaries)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def tag(name: str) -> str:
    """`name` as a hash tag: every key holding `{name}` maps to one cluster slot, so one
    shard holds all of them (a no-op on one server)."""
    return "{" + name + "}"
