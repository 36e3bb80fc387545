"""Chaos run: faults injected into a disk-tier chunk cache while real requests go through the
offline LLM; `cachecraft bench chaos` prints one row per fault class.

Owns the fault injector (bit flips and truncations of chunk files, index deletion with
recovery or `cachecraft chunks reindex`, non-finite values written into stored tensors with
valid checksums, a damaged attention-kernel library under a fresh process) and the invariant
check. Requests run in `prefix` mode over float32 storage, so an intact cache gives exactly the
full prefill's greedy tokens: every answer must equal that, or the request must fail cleanly
(an error, never a wrong answer); no variant acknowledged on disk and not itself damaged may
be lost; every store open and process start must succeed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from cachecraft.api import LLM, LoadedModel, SamplingParams, variant_from_bytes, variant_to_bytes
from cachecraft.env import cache_home
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.config import StoreConfig

FAULTS = ("bitflip", "truncate", "index", "nonfinite", "kernel")
FILE_FAULTS = FAULTS[:4]
SUFFIX = ".safetensors"
INDEX_GLOB = "index.sqlite*"  # the disk tier's index and its WAL files (docs/deploy.md)
MODE = "prefix"  # exact reuse only: an intact cache answers exactly as the full prefill
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)

DOCS = (
    "Saturn is the sixth planet from the Sun and has a prominent ring system.",
    "Jupiter is the largest planet in the Solar System, a gas giant.",
    "Mercury is the smallest planet and the closest to the Sun.",
    "Mars is called the Red Planet because of the iron oxide on its surface.",
    "Venus has a thick atmosphere of carbon dioxide and is the hottest planet.",
    "Neptune is the farthest known planet from the Sun and has strong winds.",
)
QUESTIONS = ("Which planet has rings?", "Which planet is the hottest?", "Which is the largest?")


def workload(rng: random.Random, num_requests: int = 4) -> list[RagRequest]:
    """A few fixed requests of three documents each (asked again and again: exact hits)."""
    out = []
    for i in range(num_requests):
        docs = rng.sample(DOCS, 3)
        out.append(RagRequest(QUESTIONS[i % len(QUESTIONS)], [Chunk(d) for d in docs]))
    return out


@dataclasses.dataclass(slots=True)
class FaultRow:
    """One fault class's tally."""

    fault: str
    injections: int = 0
    equal: int = 0
    """Answers equal to the intact cache's (the full prefill's greedy tokens)."""
    clean_failures: int = 0
    """Requests that failed with an error (nothing served)."""
    wrong: int = 0
    """Answers served that differ from the intact cache's (target 0)."""
    lost: int = 0
    """Variants acknowledged on disk, not themselves damaged, gone after the fault (target 0)."""
    failed_starts: int = 0
    """Store opens or process starts that failed (target 0)."""
    errors: list[str] = dataclasses.field(default_factory=list)


class FaultInjector:
    """Damages the files of one chunk-cache directory (and kernel caches) the way disks,
    crashes and bugs do."""

    def __init__(self, cache_dir: Path, rng: random.Random) -> None:
        self.cache_dir, self.rng = cache_dir, rng

    def bitflip(self, path: Path) -> None:
        data = bytearray(path.read_bytes())
        for _ in range(self.rng.randint(1, 8)):
            at = self.rng.randrange(len(data))
            data[at] ^= 1 << self.rng.randrange(8)
        path.write_bytes(bytes(data))

    def truncate(self, path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: self.rng.randrange(len(data))])

    def lose_index(self) -> None:
        for part in self.cache_dir.glob(INDEX_GLOB):
            part.unlink()

    def nonfinite(self, path: Path) -> None:
        """A NaN or an infinity written into one stored K/V value, the file re-encoded with
        valid checksums (as a bug that stored bad values would have written it)."""
        variant = variant_from_bytes(path.read_bytes())
        target = variant.keys if self.rng.random() < 0.5 else variant.values
        at = tuple(self.rng.randrange(n) for n in target.shape)
        target[at] = self.rng.choice((float("nan"), float("inf"), float("-inf")))
        path.write_bytes(variant_to_bytes(variant))

    def damage_kernels(self, kernels: Path) -> int:
        """Damage every built attention library in `kernels` (truncated as `head -c 5000`,
        zeroed, garbage or empty); returns how many."""
        libs = sorted(kernels.glob("*.so"))
        for lib in libs:
            data = lib.read_bytes()
            kind = self.rng.choice(("truncated", "zeroed", "garbage", "empty"))
            lib.write_bytes(
                {
                    "truncated": data[:5000],
                    "zeroed": bytes(len(data)),
                    "garbage": bytes(self.rng.randrange(256) for _ in range(4096)),
                    "empty": b"",
                }[kind]
            )
        return len(libs)


class ChaosRun:
    """One model over one chunk-cache directory, restarted (store closed and reopened) as a
    process would be; `ask` checks each answer against the full prefill's."""

    def __init__(self, loaded: LoadedModel, model_ref: str | None, cache_dir: Path) -> None:
        self.loaded, self.model_ref, self.cache_dir = loaded, model_ref, cache_dir
        self.config = StoreConfig(
            cache_dir=str(cache_dir),
            memory_bytes=0,  # every hit is read from its file: the faults are seen
            doorkeeper_threshold=1,
            storage_dtype="float32",
            max_variants_per_chunk=64,
        )
        self.llm = LLM(loaded, store=self.config)
        self.expected: dict[int, list[int]] = {}
        self.chunk_keys: dict[int, list[str]] = {}

    def reference(self, request: RagRequest) -> list[int]:
        """The full prefill's greedy tokens (what an intact cache answers in `prefix` mode)."""
        key = id(request)
        if key not in self.expected:
            out = self.llm.generate(request, GREEDY, mode="full")[0]
            self.expected[key] = out.token_ids
            self.chunk_keys[key] = [c.key for c in out.report.chunks]
        return self.expected[key]

    def ask(self, request: RagRequest, row: FaultRow) -> None:
        want = self.reference(request)
        try:
            got = self.llm.generate(request, GREEDY, mode=MODE)[0].token_ids
        except Exception as e:  # noqa: BLE001 - a failed request is the clean outcome
            row.clean_failures += 1
            row.errors.append(f"{type(e).__name__}: {e}"[:200])
            return
        if got == want:
            row.equal += 1
        else:
            row.wrong += 1

    def restart(self, row: FaultRow) -> None:
        self.llm.store.close()  # finishes queued writes
        try:
            self.llm = LLM(self.loaded, store=self.config)
        except Exception as e:  # noqa: BLE001 - counted: a start must never fail
            row.failed_starts += 1
            row.errors.append(f"start: {type(e).__name__}: {e}"[:200])
            raise

    def stored_ids(self, requests: list[RagRequest]) -> dict[str, str]:
        """variant id -> chunk key of every variant the store lists for the requests' chunks."""
        out = {}
        for request in requests:
            self.reference(request)
            for key in self.chunk_keys[id(request)]:
                for meta in self.llm.store.variants(key):
                    out[meta.variant_id] = key
        return out

    def close(self) -> None:
        self.llm.store.close()


def _reindex(cache_dir: Path) -> str | None:
    """`cachecraft chunks reindex` as a user runs it; None if it exited 0, else why."""
    cmd = [sys.executable, "-m", "cachecraft.cli", "chunks", "reindex"]
    done = subprocess.run(
        [*cmd, "--cache-dir", str(cache_dir), "--json"], capture_output=True, text=True, timeout=300
    )
    return None if done.returncode == 0 else f"reindex exit {done.returncode}: {done.stderr[-300:]}"


def _kernel_start(
    injector: FaultInjector, model_ref: str | None, request: RagRequest, want: list[int]
) -> tuple[bool, bool, str]:
    """A fresh process over a copy of the kernel cache with every library damaged: (started,
    answer equal to the intact one, stderr tail). The cache's other entries are linked in."""
    home = cache_home()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "cachecraft"
        copy.mkdir()
        if home.is_dir():
            for entry in home.iterdir():
                if entry.name == "kernels":
                    shutil.copytree(entry, copy / "kernels")
                else:
                    (copy / entry.name).symlink_to(entry)
        injector.damage_kernels(copy / "kernels")
        script = (
            "import json, sys\n"
            "from cachecraft.api import LLM, SamplingParams\n"
            "from cachecraft.request import Chunk, RagRequest\n"
            "q, docs, model = json.loads(sys.argv[1])\n"
            "out = LLM(model).generate(RagRequest(q, [Chunk(d) for d in docs]),\n"
            f"    SamplingParams(max_tokens={GREEDY.max_tokens}, ignore_eos=True), mode='full')\n"
            "print(json.dumps(out[0].token_ids))\n"
        )
        arg = json.dumps([request.question, [c.text for c in request.chunks], model_ref])
        env = {**os.environ, "XDG_CACHE_HOME": tmp, "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run(
            [sys.executable, "-c", script, arg],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    if done.returncode != 0:
        return False, False, f"exit {done.returncode}: {done.stderr[-300:]}"
    return True, json.loads(done.stdout.strip().splitlines()[-1]) == want, ""


def run_chaos(
    loaded: LoadedModel,
    model_ref: str | None,
    injections: int,
    seed: int = 0,
    faults: tuple[str, ...] = FAULTS,
    cache_dir: Path | None = None,
    on_injection: Callable[[int, FaultRow], None] | None = None,
) -> list[FaultRow]:
    """`injections` faults, the classes in turn, each followed by the request whose chunk it
    hit (or, for the kernel, a fresh process answering it). `model_ref`: what a fresh process
    loads the same model from (the kernel class). `on_injection(i, row)`: after each one."""
    rng = random.Random(seed)
    rows = {f: FaultRow(f) for f in faults}
    requests = workload(rng)
    damaged: set[str] = set()  # every variant damaged so far (one not read yet stays indexed)
    with tempfile.TemporaryDirectory() as tmp:
        root = cache_dir or Path(tmp)
        run = ChaosRun(loaded, model_ref, root)
        injector = FaultInjector(root, rng)
        try:
            for i in range(injections):
                fault = faults[i % len(faults)]
                row, request = rows[fault], rng.choice(requests)
                row.injections += 1
                run.ask(request, FaultRow("warm"))  # its chunks are cached (a miss computes)
                run.restart(row)  # writes finished: what is indexed now was acknowledged
                if fault == "kernel":
                    started, equal, why = _kernel_start(
                        injector, model_ref, request, run.reference(request)
                    )
                    row.failed_starts += not started
                    row.equal += started and equal
                    row.wrong += started and not equal
                    if why:
                        row.errors.append(why)
                    if on_injection is not None:
                        on_injection(i, row)
                    continue
                before = run.stored_ids(requests)
                mine = sorted(run.stored_ids([request]))
                if fault == "index":
                    injector.lose_index()
                    failed = _reindex(root) if i // len(faults) % 2 else None
                    if failed is not None:
                        row.failed_starts += 1
                        row.errors.append(failed)
                    run.restart(row)
                elif mine:
                    victim = rng.choice(mine)
                    getattr(injector, fault)(root / (victim + SUFFIX))
                    damaged.add(victim)
                run.ask(request, row)
                after = run.stored_ids(requests)
                row.lost += sum(1 for vid in before if vid not in damaged and vid not in after)
                if on_injection is not None:
                    on_injection(i, row)
        finally:
            run.close()
    return list(rows.values())


def table(rows: list[FaultRow]) -> str:
    cols = ("fault", "injections", "equal", "clean_failures", "wrong", "lost", "failed_starts")
    head = "| " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(getattr(r, c)) for c in cols) + " |")
    return "\n".join(lines)


def add_bench_chaos_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chaos", help="faults injected into a disk chunk cache under real requests"
    )
    parser.add_argument("--model", default=None, help="model path or name (default: bundled)")
    parser.add_argument("--injections", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}"
    )
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=main_chaos)
    return parser


def main_chaos(args: argparse.Namespace) -> int:
    from cachecraft.api import load_model

    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise SystemExit(f"--faults: unknown {', '.join(unknown)}; choose of {', '.join(FAULTS)}")

    def progress(i: int, row: FaultRow) -> None:  # partial results survive a killed run
        print(f"injection {i + 1}/{args.injections}: {dataclasses.asdict(row)}", file=sys.stderr)

    rows = run_chaos(
        load_model(args.model), args.model, args.injections, args.seed, faults, None, progress
    )
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print(table(rows))
    bad = sum(r.wrong + r.lost + r.failed_starts for r in rows)
    return 1 if bad else 0
