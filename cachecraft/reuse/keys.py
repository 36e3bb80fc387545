"""Stable cache keys for chunks and system prefixes (blake2b, 16-byte digest, hex).

Owns only hashing: a key binds the model fingerprint, the namespace (tenant) and the token ids, so
caches never cross models or namespaces. Never uses Python's hash() (salted per process).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_DIGEST_SIZE = 16


def _field(data: bytes) -> bytes:
    # Length-prefixed (uint32 LE) so no two field lists ever serialize to the same bytes.
    return struct.pack("<I", len(data)) + data


def _key(kind: bytes, fingerprint: str, namespace: str, token_ids: Sequence[int]) -> str:
    ids = struct.pack(f"<{len(token_ids)}i", *token_ids)
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for field in (kind, fingerprint.encode(), namespace.encode(), ids):
        h.update(_field(field))
    return h.hexdigest()


def chunk_key(fingerprint: str, namespace: str, token_ids: Sequence[int]) -> str:
    """Key of a chunk tokenized on its own; token ids are packed as little-endian int32."""
    return _key(b"chunk", fingerprint, namespace, token_ids)


def prefix_key(fingerprint: str, namespace: str, token_ids: Sequence[int]) -> str:
    """Key of a system prefix; never equal to a chunk key of the same ids (domain-separated)."""
    return _key(b"prefix", fingerprint, namespace, token_ids)
