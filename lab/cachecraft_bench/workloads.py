"""Evaluation workloads: the JSONL workload file format and `build_workload`, which dispatches to
the built-in generators (wiki-qa, synthetic, sharegpt, and the invented-fact shapes two-hop,
many-short, long-doc) or loads a file.

File format, one request per line:
`{"id", "system"?, "namespace"?, "chunks": [{"id"?, "text"}], "question", "answers"?: [str],
"arrival_s"?: float}`. Blank lines are skipped.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from cachecraft.errors import BadRequestError
from cachecraft.request import DEFAULT_SYSTEM, Chunk, RagRequest
from cachecraft_bench.facts import long_doc, many_short, two_hop
from cachecraft_bench.item import WorkloadItem, estimate_tokens
from cachecraft_bench.sharegpt import sharegpt
from cachecraft_bench.synthetic import synthetic
from cachecraft_bench.wiki_qa import wiki_qa

__all__ = [
    "BUILTIN_WORKLOADS",
    "WorkloadItem",
    "build_workload",
    "chunk_popularity",
    "estimate_tokens",
    "item_to_json",
    "load_workload_file",
    "sharegpt",
    "synthetic",
    "wiki_qa",
    "write_workload_file",
]

logger = logging.getLogger(__name__)

BUILTIN_WORKLOADS: dict[str, Callable[..., list[WorkloadItem]]] = {
    "wiki-qa": wiki_qa,
    "synthetic": synthetic,
    "sharegpt": sharegpt,
    "two-hop": two_hop,
    "many-short": many_short,
    "long-doc": long_doc,
}


def _parse_item(obj: object, where: str, lineno: int) -> WorkloadItem:
    if not isinstance(obj, dict):
        raise BadRequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in ("question", "chunks"):
        if name not in obj:
            raise BadRequestError(f"{where}: missing field {name!r}")
    raw_chunks = obj["chunks"]
    if not isinstance(raw_chunks, list):
        raise BadRequestError(f"{where}: 'chunks' must be a list")
    chunks = []
    for j, c in enumerate(raw_chunks):
        if isinstance(c, str):
            c = {"text": c}
        if not isinstance(c, dict) or "text" not in c:
            raise BadRequestError(f"{where}: chunk {j} is missing field 'text'")
        try:
            chunks.append(Chunk(c["text"], c.get("id")))
        except BadRequestError as e:
            raise BadRequestError(f"{where}: chunk {j}: {e}") from None
    answers = obj.get("answers")
    if isinstance(answers, str):
        answers = [answers]
    if answers is not None and (
        not isinstance(answers, list) or not all(isinstance(a, str) for a in answers)
    ):
        raise BadRequestError(f"{where}: 'answers' must be a list of strings")
    arrival = obj.get("arrival_s")
    if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, int | float)):
        raise BadRequestError(f"{where}: 'arrival_s' must be a number")
    try:
        request = RagRequest(
            obj["question"],
            chunks,
            system=obj.get("system"),
            namespace=obj.get("namespace", "default"),
        )
    except BadRequestError as e:
        raise BadRequestError(f"{where}: {e}") from None
    return WorkloadItem(
        id=str(obj.get("id", f"line{lineno}")),
        request=request,
        answers=tuple(answers) if answers is not None else None,
        arrival_s=float(arrival) if arrival is not None else None,
    )


def load_workload_file(path: str | Path) -> list[WorkloadItem]:
    """Read a JSONL workload file; errors name the file and line and raise BadRequestError."""
    path = Path(path)
    if not path.is_file():
        raise BadRequestError(f"workload file {path} does not exist")
    items = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadRequestError(f"{where}: bad JSON: {e.msg} (column {e.colno})") from None
            items.append(_parse_item(obj, where, lineno))
    logger.debug("loaded %d requests from %s", len(items), path)
    return items


def item_to_json(item: WorkloadItem) -> dict:
    """One workload-file record (optional fields only when set)."""
    req = item.request
    out: dict = {"id": item.id}
    if req.system != DEFAULT_SYSTEM:
        out["system"] = req.system
    if req.namespace != "default":
        out["namespace"] = req.namespace
    out["chunks"] = [{"id": c.id, "text": c.text} if c.id else {"text": c.text} for c in req.chunks]
    out["question"] = req.question
    if item.answers is not None:
        out["answers"] = list(item.answers)
    if item.arrival_s is not None:
        out["arrival_s"] = item.arrival_s
    return out


def write_workload_file(items: Iterable[WorkloadItem], path: str | Path) -> Path:
    """Write `items` as JSONL (UTF-8, one request per line); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item_to_json(item), ensure_ascii=False) + "\n")
    return path


def build_workload(
    name: str, num_requests: int | None = None, seed: int = 0, **kw: object
) -> list[WorkloadItem]:
    """`name` is "wiki-qa", "synthetic", "sharegpt" or a path to a .jsonl workload file (then
    the first `num_requests` lines are used, all when None). `kw` goes to the generator."""
    builder = BUILTIN_WORKLOADS.get(name)
    if builder is None:
        if name.endswith(".jsonl") or Path(name).is_file():
            if kw:
                raise BadRequestError(f"a workload file takes no options, got {sorted(kw)}")
            items = load_workload_file(name)
            if num_requests is not None and num_requests < len(items):
                items = items[:num_requests]
            elif num_requests is not None and num_requests > len(items):
                logger.warning("%s has only %d requests (asked %d)", name, len(items), num_requests)
            return items
        known = ", ".join(BUILTIN_WORKLOADS)
        raise BadRequestError(f"unknown workload {name!r}: use one of {known} or a .jsonl path")
    if num_requests is None:
        raise BadRequestError(f"workload {name!r} needs a number of requests")
    try:
        inspect.signature(builder).bind(num_requests, seed=seed, **kw)
    except TypeError as e:
        raise BadRequestError(f"workload {name!r}: {e}") from None
    return builder(num_requests, seed=seed, **kw)


def chunk_popularity(items: Iterable[WorkloadItem], top_fraction: float = 0.05) -> float:
    """Share of requests holding at least one of the `top_fraction` most frequent chunks (by
    text, over the distinct chunks the workload uses): the paper's "top 5% serve 60%"."""
    reqs = [{c.text for c in it.request.chunks} for it in items]
    counts = Counter(t for r in reqs for t in r)
    if not reqs or not counts:
        return 0.0
    n_top = max(1, round(top_fraction * len(counts)))
    top = {t for t, _ in counts.most_common(n_top)}
    return sum(1 for r in reqs if r & top) / len(reqs)
