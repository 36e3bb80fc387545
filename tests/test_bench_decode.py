"""`bench decode`: one clock for both sides (batch formed to tokens available, offline, the
same token counts), ours also on the engine's clock; the peer takes turns with us, B by B,
round by round."""

from __future__ import annotations

import statistics
import sys

import pytest

from cachecraft.errors import CachecraftError
from cachecraft.model.loader import LoadedModel
from cachecraft_bench import decode_bench
from cachecraft_bench.decode_bench import OursDecode, clocks_disagree, run_decode_bench


def test_a_batch_prefills_in_one_step_then_decodes_all_b_together(tiny: LoadedModel) -> None:
    """The offline clock's premise: T(1 + steps) - T(1) holds exactly `steps` steps with all B
    sequences decoding (no decode row rides along a later prefill, as none does in vLLM's
    prefix-cached run)."""
    ours = OursDecode(tiny, max_batch=3, context=24, steps=4, repeats=1)
    try:
        engine = ours.stack.engine
        first = len(engine.recent_steps)
        ours._generate(3, 1 + 4)
        # the last step's record is made after its tokens go out: a call between steps runs
        # only once that step is over
        engine.call(lambda: None).result(timeout=60)
        steps = list(engine.recent_steps)[first:]
        assert [(s.num_prefills, s.num_decodes) for s in steps] == [(3, 0)] + [(0, 3)] * 4
        assert ours.measure(3) is not None
    finally:
        ours.close()


def test_the_offline_step_is_the_difference_of_the_medians_over_the_steps(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = OursDecode(tiny, max_batch=2, context=16, steps=4, repeats=3)
    try:
        scripted = iter([9.0, 1.0, 1.4, 1.2, 1.5, 1.1, 1.6])  # warm-up, then (1, 1 + steps) x 3
        calls: list[tuple[int, int]] = []

        def fake(b: int, n: int) -> float:
            calls.append((b, n))
            return next(scripted)

        monkeypatch.setattr(ours, "_generate", fake)
        # medians: one 1.1 s, many 1.5 s -> (1.5 - 1.1) / 4 steps = 100 ms
        assert ours.measure_offline(2) == pytest.approx(100.0)
        assert calls == [(2, 1)] + [(2, 1), (2, 5)] * 3
    finally:
        ours.close()


def test_clocks_disagree_past_ten_percent() -> None:
    assert clocks_disagree(111.0, 100.0) is True
    assert clocks_disagree(109.0, 100.0) is False
    assert clocks_disagree(89.0, 100.0) is True
    assert clocks_disagree(None, 100.0) is None and clocks_disagree(5.0, None) is None


def test_decode_bench_reports_both_clocks_for_each_batch_size(tiny: LoadedModel) -> None:
    result = run_decode_bench(tiny, batches=(1, 3), context=24, steps=3, repeats=1)
    ours, engine = result["step_ms"]["ours"], result["engine_step_ms"]["ours"]
    assert set(ours) == set(engine) == {"1", "3"}
    for b in ("1", "3"):
        assert result["clocks_disagree"][b] == clocks_disagree(ours[b], engine[b])
        if ours[b] is not None:
            assert result["tokens_per_s"]["ours"][b] == pytest.approx(int(b) * 1000 / ours[b], 0.01)
    assert result["config"]["clock"].startswith("offline")
    assert "step_ratio_vs_vllm" not in result


def test_decode_bench_rejects_bad_sizes(tiny: LoadedModel) -> None:
    with pytest.raises(CachecraftError, match="batch sizes"):
        run_decode_bench(tiny, batches=(0,))
    with pytest.raises(CachecraftError, match="repeats"):
        run_decode_bench(tiny, batches=(1,), repeats=0)
    with pytest.raises(CachecraftError, match="no peer venv"):
        run_decode_bench(tiny, batches=(1,), context=16, steps=2, peer="vllm", peer_python="/nope")


def _fake_peer(tmp_path, body: str):
    """A stand-in for the peer venv's python: it ignores the vLLM script and speaks the
    bench's line protocol itself (READY, then one RESULT per batch size read)."""
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    fake.chmod(0o755)
    return fake


def test_decode_bench_takes_turns_with_the_peer_and_pairs_the_rounds(
    tiny: LoadedModel, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "peer.log"
    fake = _fake_peer(
        tmp_path,
        "print('some vLLM log line'); print('READY', flush=True)\n"
        "for line in sys.stdin:\n"
        f"    open({str(log)!r}, 'a').write(line)\n"
        "    print('RESULT', 1000.0 * int(line), flush=True)",
    )
    # ours on the offline clock, scripted: 400 ms per sequence, then 300, round by round
    scripted = iter([400.0, 300.0, 800.0, 600.0])
    monkeypatch.setattr(decode_bench.OursDecode, "measure_offline", lambda self, b: next(scripted))
    news: list[str] = []
    result = run_decode_bench(
        tiny, batches=(1, 2), context=16, steps=2, peer="vllm", peer_python=fake, rounds=2,
        progress=news.append, repeats=1,
    )  # fmt: skip
    assert news[0].startswith("starting vLLM") and len(news) == 1 + 2 * 2 * 2
    assert news[-1] == "vllm B=2 round 2/2: 2000.0 ms"
    assert log.read_text().split() == ["1", "1", "2", "2"]  # B by B, a turn per round
    rounds = result["rounds_ms"]
    assert rounds["vllm"] == {"1": [1000.0, 1000.0], "2": [2000.0, 2000.0]}
    assert rounds["ours"] == {"1": [400.0, 300.0], "2": [800.0, 600.0]}
    assert result["step_ratio_vs_vllm"] == {"1": 0.35, "2": 0.35}  # median of 0.4 and 0.3
    assert result["step_ms"]["ours"] == {"1": 350.0, "2": 700.0}
    # the engine clock runs too, every round, and is reported beside the common one
    assert all(len(v) == 2 for v in result["engine_rounds_ms"]["ours"].values())
    for b in ("1", "2"):
        known = [v for v in result["engine_rounds_ms"]["ours"][b] if v is not None]
        assert result["engine_step_ms"]["ours"][b] == pytest.approx(statistics.median(known))


def test_decode_bench_reports_a_peer_that_dies(tiny: LoadedModel, tmp_path) -> None:
    fake = _fake_peer(tmp_path, "print('ImportError: no module named vllm'); sys.exit(3)")
    with pytest.raises(CachecraftError, match=r"exit 3\):\nImportError: no module named vllm"):
        run_decode_bench(tiny, batches=(1,), context=16, steps=2, peer="vllm", peer_python=fake)
