"""The public surface for code built on cachecraft: anyone who drives the engine, the offline
LLM or a chunk store from Python, or adds a reuse strategy (the lab registers its baselines
through it).

Public modules are this one plus `cachecraft` (LLM, SamplingParams, Chunk, RagRequest),
`cachecraft.llm`, `cachecraft.request`, `cachecraft.config`, `cachecraft.config_file`,
`cachecraft.errors`, `cachecraft.env`, `cachecraft.store.base` (ChunkStore and its typed
results) and `cachecraft.store.config` (StoreConfig). Every other module is internal and may
change; a name it owns that outsiders need is re-exported here, so `bench` imports nothing
else (tests/test_layers.py checks that).
"""

from __future__ import annotations

from typing import Any

from cachecraft.config import check_fields, ranged
from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.engine.handle import Failed, Finished, PromptLogprobs, RequestHandle, Token
from cachecraft.engine.options import RequestExtras, RequestOptions, StepStat
from cachecraft.engine.report import ChunkReport, RequestReport
from cachecraft.engine.sampling import SamplingParams
from cachecraft.errors import BadRequestError
from cachecraft.llm import LLM, Answer, RequestOutput
from cachecraft.model.loader import LoadedModel, default_dtype, load_model, resolve_model_dir
from cachecraft.model.reference import greedy_tokens, prefill
from cachecraft.model.shapes import SHAPES
from cachecraft.request import RagRequest
from cachecraft.reuse.cachecraft import (
    CachecraftParams,
    CachecraftStrategy,
    make_probe,
    probe_cost,
    rows_that_fit,
)
from cachecraft.reuse.layout import build_layout
from cachecraft.reuse.modes import (
    PlanInput,
    fix_count,
    given_budget,
    hit,
    make_plan,
    miss,
    per_chunk,
)
from cachecraft.reuse.plan import ChunkPlan, ChunkSlot, DeviationCheck, EarlyExit, RecomputePlan
from cachecraft.reuse.planner import matched_budgets
from cachecraft.reuse.selectors import first_n, random_n, top_scored
from cachecraft.reuse.stats import Scoring, ScoringRules
from cachecraft.reuse.strategies import STRATEGIES
from cachecraft.reuse.strategy import ReuseStrategy, StrategyRegistry
from cachecraft.reuse.variant_choice import VariantScore
from cachecraft.server.convert import to_rag
from cachecraft.server.launch import Stack, build_stack, close_stack, start_server
from cachecraft.server.protocol import ChatCompletionRequest
from cachecraft.store.codec import from_bytes as variant_from_bytes
from cachecraft.store.codec import to_bytes as variant_to_bytes
from cachecraft.store.memory import MemoryStore, memory_config
from cachecraft.store.meta import VariantMeta
from cachecraft.store.redis_server import RedisServer
from cachecraft.store.store import make_store
from cachecraft.store.variant import Variant

__all__ = [
    "LLM",
    "STRATEGIES",
    "Answer",
    "CachecraftParams",
    "CachecraftStrategy",
    "ChunkPlan",
    "ChunkReport",
    "ChunkSlot",
    "DeviationCheck",
    "EarlyExit",
    "Engine",
    "EngineConfig",
    "Failed",
    "Finished",
    "LoadedModel",
    "MemoryStore",
    "PlanInput",
    "PromptLogprobs",
    "RecomputePlan",
    "RedisServer",
    "RequestExtras",
    "RequestHandle",
    "RequestOptions",
    "RequestOutput",
    "RequestReport",
    "ReuseStrategy",
    "SHAPES",
    "SamplingParams",
    "Scoring",
    "ScoringRules",
    "Stack",
    "StepStat",
    "StrategyRegistry",
    "Token",
    "Variant",
    "VariantMeta",
    "VariantScore",
    "build_stack",
    "chat_request",
    "check_fields",
    "close_stack",
    "default_dtype",
    "first_n",
    "fix_count",
    "given_budget",
    "greedy_tokens",
    "hit",
    "load_model",
    "make_plan",
    "make_probe",
    "make_store",
    "matched_budgets",
    "memory_config",
    "miss",
    "per_chunk",
    "prefill",
    "probe_cost",
    "prompt_token_ids",
    "random_n",
    "ranged",
    "resolve_model_dir",
    "rows_that_fit",
    "start_server",
    "top_scored",
    "variant_from_bytes",
    "variant_to_bytes",
]


def prompt_token_ids(request: RagRequest, tokenizer: Any) -> list[int]:
    """The prompt token ids our engine prefills for `request`: the template head, each chunk
    tokenized alone as `text + "\\n\\n"`, then "Question: ..." and the template tail."""
    # the fingerprint only feeds the cache keys, never the ids
    return list(build_layout(request, tokenizer, fingerprint="").token_ids)


def chat_request(
    messages: list[dict[str, Any]],
    documents: list[dict[str, Any]] | None = None,
    namespace: str = "default",
) -> RagRequest:
    """The RagRequest the server makes of a chat completion with these OpenAI `messages` and
    cachecraft `documents` ({"text", "id"?}): system messages -> system prompt, the last
    (user) message -> question, earlier turns -> chunk-caches in front of the documents
    (docs/api.md, "Serving"). Bad input raises BadRequestError as the server answers 400."""
    try:
        body = ChatCompletionRequest(messages=messages, documents=documents or [])
    except ValueError as e:  # pydantic's ValidationError
        raise BadRequestError(f"not a valid chat request: {e}") from None
    return to_rag(body, namespace)
