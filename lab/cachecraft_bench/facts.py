"""Invented-fact workloads with exact gold answers, all deterministic from the seed:

* `two_hop`: the answer needs two chunks (a landmark's chunk names its designer, the designer's
  chunk names the town they were born in; the question asks for the town).
* `many_short`: many short chunks (one landmark each, ~40-60 tokens), a question about one.
* `long_doc`: long invented chronicles, each split into consecutive sections; a request is a
  window of consecutive sections (so a section recurs at new offsets after the same
  predecessors), with a question about one section of the window.

Every name is made of random syllables, so no model can know an answer without the passages;
chunks recur across requests (that is what a chunk cache serves). Owns text generation only.
"""

from __future__ import annotations

import numpy as np

from cachecraft.errors import BadRequestError
from cachecraft.request import Chunk, RagRequest
from cachecraft_bench.item import WorkloadItem

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "gl", "kr", "pl", "st", "th", "tr", "sh", "ch")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "m", "th", "k", "nd", "rn", "st")
_KINDS = ("lighthouse", "bridge", "library", "observatory", "museum", "clock tower", "theatre",
          "railway station", "botanical garden", "concert hall")  # fmt: skip
_MATERIALS = ("granite", "red brick", "limestone", "cast iron", "timber", "basalt", "marble")
_TRADES = ("architect", "engineer", "sculptor", "surveyor", "stonemason")
_GOODS = ("salt", "copper", "wool", "amber", "tin", "glass", "timber", "dyes", "pepper")
ANSWER_BRIEFLY = " Answer in a few words."


class _Names:
    """Unique invented words from one generator (two draws never give the same word)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: tuple[int, int] = (2, 3)) -> str:
        while True:
            n = int(self.rng.integers(syllables[0], syllables[1] + 1))
            parts = [
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                for _ in range(n)
            ]
            word = "".join(parts).capitalize()
            if word not in self.used and 4 <= len(word) <= 10:
                self.used.add(word)
                return word

    def person(self) -> str:
        return f"{self.word()} {self.word()}"

    def pick(self, options: tuple[str, ...]) -> str:
        return str(options[int(self.rng.integers(len(options)))])

    def year(self, low: int, high: int) -> int:
        return int(self.rng.integers(low, high + 1))


def _landmark(names: _Names) -> dict[str, str]:
    kind = names.pick(_KINDS)
    return {
        "name": f"{names.word()} {kind.title()}",
        "kind": kind,
        "town": names.word(),
        "designer": names.person(),
        "opened": str(names.year(1820, 1990)),
        "material": names.pick(_MATERIALS),
        "height": str(names.year(12, 140)),
    }


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _landmark_text(f: dict[str, str], long: bool) -> str:
    text = (
        f"The {f['name']} is {_article(f['kind'])} {f['kind']} in the town of {f['town']}. "
        f"It was designed by "
        f"{f['designer']} and opened in {f['opened']}."
    )
    if long:
        text += (
            f" Built of {f['material']}, it rises {f['height']} metres above the square. "
            f"Visitors reach it by a path that starts near the old market of {f['town']}, and "
            "the local council restored its facade after a storm damaged the upper floors."
        )
    return text


def _person(names: _Names, trade: str | None = None) -> dict[str, str]:
    return {
        "name": names.person(),
        "trade": trade or names.pick(_TRADES),
        "born_in": names.word(),
        "born": str(names.year(1780, 1950)),
        "school": f"the {names.word()} Academy",
    }


def _person_text(p: dict[str, str]) -> str:
    return (
        f"{p['name']} was {_article(p['trade'])} {p['trade']} born in {p['born_in']} in "
        f"{p['born']}. "
        f"{p['name'].split()[0]} studied at {p['school']} and later taught drawing to "
        "apprentices, keeping notebooks of measured sketches that survive in a private "
        "collection."
    )


def _ask(question: str) -> str:
    return question + ANSWER_BRIEFLY


def _draw(rng: np.random.Generator, pool: int, k: int, keep: list[int]) -> list[int]:
    """`keep` plus k - len(keep) other distinct indices of range(pool), shuffled."""
    others = [i for i in rng.permutation(pool).tolist() if i not in keep][: k - len(keep)]
    return [int(i) for i in rng.permutation([*keep, *others])]


def two_hop(
    num_requests: int, k: int = 4, num_pairs: int | None = None, seed: int = 0
) -> list[WorkloadItem]:
    """Requests of k chunks holding a landmark's chunk and its designer's chunk (the answer
    needs both) plus k - 2 other chunks of the pool; the gold answer is the designer's birth
    town. The pool has `num_pairs` landmark/designer pairs (default: each chunk in ~4 requests)."""
    if k < 2:
        raise BadRequestError("two-hop needs k >= 2 (two chunks hold the answer)")
    num_pairs = num_pairs or max(k, -(-num_requests * k // 8))
    rng = np.random.default_rng(seed)
    names = _Names(rng)
    chunks: list[Chunk] = []
    facts = []
    for i in range(num_pairs):
        person = _person(names, "architect")
        place = _landmark(names)
        place["designer"] = person["name"]
        chunks.append(Chunk(_landmark_text(place, long=True), f"hop{seed}-l{i}"))
        chunks.append(Chunk(_person_text(person), f"hop{seed}-p{i}"))
        facts.append((place, person))
    items = []
    for n in range(num_requests):
        pair = int(rng.integers(num_pairs))
        place, person = facts[pair]
        picked = _draw(rng, len(chunks), k, [2 * pair, 2 * pair + 1])
        question = _ask(f"In which town was the designer of the {place['name']} born?")
        items.append(
            WorkloadItem(
                id=f"two-hop-{seed}-{n}",
                request=RagRequest(question, [chunks[i] for i in picked]),
                answers=(person["born_in"],),
            )
        )
    return items


_SHORT_QUESTIONS = (
    ("town", "In which town is the {name}?"),
    ("designer", "Who designed the {name}?"),
    ("opened", "In which year did the {name} open?"),
)


def many_short(
    num_requests: int, k: int = 12, num_chunks: int | None = None, seed: int = 0
) -> list[WorkloadItem]:
    """Requests of k short chunks (one landmark each) from a pool of `num_chunks` (default:
    each chunk in ~5 requests), a question about one of them (its town, designer or year)."""
    if k < 1:
        raise BadRequestError("many-short needs k >= 1")
    num_chunks = max(num_chunks or -(-num_requests * k // 5), k)
    rng = np.random.default_rng(seed)
    names = _Names(rng)
    facts = [_landmark(names) for _ in range(num_chunks)]
    chunks = [Chunk(_landmark_text(f, long=False), f"short{seed}-{i}") for i, f in enumerate(facts)]
    items = []
    for n in range(num_requests):
        target = int(rng.integers(num_chunks))
        key, template = _SHORT_QUESTIONS[int(rng.integers(len(_SHORT_QUESTIONS)))]
        picked = _draw(rng, num_chunks, k, [target])
        items.append(
            WorkloadItem(
                id=f"many-short-{seed}-{n}",
                request=RagRequest(
                    _ask(template.format(name=facts[target]["name"])), [chunks[i] for i in picked]
                ),
                answers=(facts[target][key],),
            )
        )
    return items


def _section(names: _Names, city: str, year: int) -> tuple[str, list[tuple[str, str]]]:
    """One section of a chronicle: its text and (question, gold) pairs about it."""
    mayor, guild, good = names.person(), names.word(), names.pick(_GOODS)
    place = _landmark(names)
    place["town"], place["opened"] = city, str(year + 3)
    text = (
        f"In {year} the council of {city} elected {mayor} as mayor. That year the "
        f"{guild} guild won the right to trade {good} in the lower harbour, and the merchants "
        f"paid for a new quay that the older families opposed for a decade. "
        + _landmark_text(place, long=True)
        + f" The chronicle records a hard winter in {year + 1}, when the river froze as far as "
        "the mills and the guilds shared their grain stores with the poorer quarters."
    )
    questions = [
        (f"Who was elected mayor of {city} in {year}?", mayor),
        (f"Which guild won the right to trade {good} in {city} in {year}?", guild),
        (f"Who designed the {place['name']}?", place["designer"]),
    ]
    return text, questions


def long_doc(
    num_requests: int,
    k: int = 5,
    sections: int = 10,
    num_docs: int | None = None,
    seed: int = 0,
) -> list[WorkloadItem]:
    """Requests over invented chronicles of `sections` consecutive sections (~150 tokens each):
    each request takes a window of k consecutive sections of one chronicle, in order, at a
    random offset, and asks about one section of it. `num_docs`: default one per ~8 requests."""
    if not 1 <= k <= sections:
        raise BadRequestError("long-doc needs 1 <= k <= sections")
    num_docs = num_docs or max(1, -(-num_requests // 8))
    rng = np.random.default_rng(seed)
    names = _Names(rng)
    docs = []
    for d in range(num_docs):
        city, start = names.word(), names.year(1600, 1800)
        parts = [_section(names, city, start + 7 * s) for s in range(sections)]
        chunks = [Chunk(text, f"doc{seed}-{d}-s{s}") for s, (text, _) in enumerate(parts)]
        docs.append((chunks, [q for _, q in parts]))
    items = []
    for n in range(num_requests):
        chunks, questions = docs[int(rng.integers(num_docs))]
        offset = int(rng.integers(sections - k + 1))
        target = offset + int(rng.integers(k))
        question, gold = questions[target][int(rng.integers(len(questions[target])))]
        items.append(
            WorkloadItem(
                id=f"long-doc-{seed}-{n}",
                request=RagRequest(_ask(question), chunks[offset : offset + k]),
                answers=(gold,),
            )
        )
    return items
