"""The one retry on a corrupt chunk-cache: the store drops a variant whose bytes fail their
checks as it reads them, so planning the request again makes that chunk a miss. One retry is
enough (the dropped variant cannot be chosen again); a second failure propagates."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from cachecraft.store.codec import CorruptVariantError

log = logging.getLogger(__name__)

T = TypeVar("T")


def again_if_corrupt(attempt: Callable[[int], T], what: str) -> T:
    """`attempt(0)`; if it raises CorruptVariantError, `attempt(1)` (which must plan afresh).
    `what` names the request in the warning."""
    try:
        return attempt(0)
    except CorruptVariantError:
        log.warning("%s: a chunk-cache was corrupt; planning it again", what)
        return attempt(1)
