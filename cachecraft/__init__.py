"""cachecraft: Cache-Craft chunk-cache reuse for retrieval-augmented generation.

Public names: LLM, SamplingParams, Chunk, RagRequest. They load lazily, so that importing
`cachecraft` (the CLI does) does not start PyTorch before the CLI set its threading options.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "Chunk", "RagRequest", "SamplingParams"]

_WHERE = {
    "LLM": "cachecraft.llm",
    "SamplingParams": "cachecraft.engine.sampling",
    "Chunk": "cachecraft.request",
    "RagRequest": "cachecraft.request",
}

if TYPE_CHECKING:
    from cachecraft.engine.sampling import SamplingParams
    from cachecraft.llm import LLM
    from cachecraft.request import Chunk, RagRequest


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'cachecraft' has no attribute {name!r}")
