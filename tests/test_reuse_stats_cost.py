"""Who pays for attention statistics: only chunks the store would admit, never `full`/`prefix`,
only at the layers ReuseConfig.stats_stride picks; new variants are assembled after the first
token, at commit."""

from __future__ import annotations

from pathlib import Path

from cachecraft.engine.runner import Runner
from cachecraft.llm import LLM
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.strategies import STRATEGIES
from cachecraft.store.config import StoreConfig
from cachecraft.store.store import make_store

DOCS = [
    "Saturn is the sixth planet from the Sun and has a prominent ring system.",
    "Jupiter is the largest planet in the Solar System, a gas giant.",
]


def _req() -> RagRequest:
    return RagRequest("Which planet has rings?", [Chunk(d) for d in DOCS])


def _prefill(runner: Runner, mode: str, precompute: bool = False):
    job = runner.start(runner.plan(_req(), STRATEGIES.get(mode)), precompute=precompute)
    result = runner.loaded.model.forward_step([job.work])[0]
    return job, result, runner.finish(job, result)


def test_refused_chunk_gets_no_statistics(tiny_dir: Path) -> None:
    store = make_store(
        StoreConfig(memory_bytes=1 << 26, doorkeeper_threshold=2, admit_all_below=0.0)
    )
    llm = LLM(str(tiny_dir), store=store)
    runner = llm.runner
    # First sighting: the doorkeeper would refuse both chunks, so no row pays for statistics.
    job, result, outcome = _prefill(runner, "cachecraft")
    assert job.work.span_bounds is None and result.span_mass_layers is None
    runner.commit(outcome)
    assert outcome.variants == [] and len(store) == 0
    # Second sighting: both would be admitted, so their rows (and only theirs) are measured.
    job, result, outcome = _prefill(runner, "cachecraft")
    assert job.stat_chunks == (0, 1) and result.row_span_mass is not None
    chunk_rows = job.rows < job.plan.layout.question_start
    question_rows = ~chunk_rows & (job.rows >= job.plan.chunks[0].slot.start)
    assert float(result.row_span_mass[question_rows].abs().sum()) == 0.0
    runner.commit(outcome)
    assert len(outcome.variants) == 2 and len(store) == 2


def test_full_and_prefix_never_pay_for_statistics(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir))
    for mode in ("full", "prefix"):
        job, result, outcome = _prefill(llm.runner, mode)
        assert job.work.span_bounds is None and result.span_mass_layers is None
        llm.runner.commit(outcome)
    # prefix mode still stores its chunks (K/V only, conservative metadata) for exact reuse.
    metas = [
        m
        for d in llm.runner.plan(_req(), STRATEGIES.get("prefix")).layout.chunks
        for m in llm.store.variants(d.key)
    ]
    assert len(metas) == 2 and all(m.cci == 1.0 for m in metas)
    again = llm.runner.plan(_req(), STRATEGIES.get("prefix"))
    assert all(cp.variant is not None for cp in again.chunks)


def test_variants_are_assembled_at_commit_not_before(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir))
    job, _, outcome = _prefill(llm.runner, "cachecraft")
    assert not outcome.is_assembled and outcome.variants == [] and len(llm.store) == 0
    assert llm.runner.prefix_cache.get(job.plan.layout.prefix_key) is None
    llm.runner.commit(outcome)
    assert outcome.is_assembled and len(outcome.variants) == 2 and len(llm.store) == 2
    assert llm.runner.prefix_cache.get(job.plan.layout.prefix_key) is not None


def test_the_runner_follows_the_plans_measure_stats_not_its_mode(tiny_dir: Path) -> None:
    from dataclasses import replace

    llm = LLM(str(tiny_dir))
    runner = llm.runner
    assert not runner.plan(_req(), STRATEGIES.get("prefix")).measure_stats
    assert runner.plan(_req(), STRATEGIES.get("cachecraft")).measure_stats
    plan = replace(runner.plan(_req(), STRATEGIES.get("cachecraft")), measure_stats=False)
    job = runner.start(plan)
    result = runner.loaded.model.forward_step([job.work])[0]
    assert job.work.span_bounds is None and result.span_mass_layers is None
    outcome = runner.finish(job, result)
    runner.commit(outcome)  # placeholder statistics, as prefix mode stores them
    assert len(outcome.variants) == 2 and all(v.meta.cci == 1.0 for v in outcome.variants)


def test_statistics_at_a_subset_of_layers_are_those_layers_of_the_full_measure(
    tiny_dir: Path,
) -> None:
    variants = {}
    for stride in (1, 2):
        llm = LLM(str(tiny_dir), stats_stride=stride)
        job, result, outcome = _prefill(llm.runner, "cachecraft")
        measured = result.span_mass_layers.abs().sum((1, 2)) > 0
        assert measured.nonzero().flatten().tolist() == list(llm.runner.stats_layers)
        llm.runner.commit(outcome)
        variants[stride] = {v.meta.chunk_key: v.meta for v in outcome.variants}
    assert set(variants[1]) == set(variants[2]) and len(variants[1]) == 2
    for key, every in variants[1].items():
        sub = variants[2][key]
        assert every.stats_layers == () and sub.stats_layers == (1, 3)  # 4 layers, stride 2
        assert sub.num_layers == every.num_layers == 4
        assert sub.intra == tuple(every.intra[layer] for layer in (1, 3))
        for a, b in zip(every.inter, sub.inter, strict=True):
            assert b == tuple(a[layer] for layer in (1, 3))
    assert variants[2][next(iter(variants[2]))].s_old == ()
    second = [m for m in variants[2].values() if m.s_old]
    assert second and all(0.5 < m.cci <= 1.0 for m in second)
