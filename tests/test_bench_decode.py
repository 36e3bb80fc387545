"""`bench decode`: engine steps with exactly B sequences decoding are found and timed; the peer
takes turns with us, B by B, round by round."""

from __future__ import annotations

import statistics
import sys

import pytest

from cachecraft.errors import CachecraftError
from cachecraft.model.loader import LoadedModel
from cachecraft_bench.decode_bench import run_decode_bench


def test_decode_bench_times_steps_of_each_batch_size(tiny: LoadedModel) -> None:
    result = run_decode_bench(tiny, batches=(1, 3), context=24, steps=3)
    ours = result["step_ms"]["ours"]
    assert set(ours) == {"1", "3"} and all(ms is not None and ms > 0 for ms in ours.values())
    assert result["tokens_per_s"]["ours"]["3"] == pytest.approx(3000 / ours["3"], rel=0.01)
    assert "step_ratio_vs_vllm" not in result


def test_decode_bench_rejects_bad_sizes(tiny: LoadedModel) -> None:
    with pytest.raises(CachecraftError, match="batch sizes"):
        run_decode_bench(tiny, batches=(0,))
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
    tiny: LoadedModel, tmp_path
) -> None:
    log = tmp_path / "peer.log"
    fake = _fake_peer(
        tmp_path,
        "print('some vLLM log line'); print('READY', flush=True)\n"
        "for line in sys.stdin:\n"
        f"    open({str(log)!r}, 'a').write(line)\n"
        "    print('RESULT', 1000.0 * int(line), flush=True)",
    )
    news: list[str] = []
    result = run_decode_bench(
        tiny, batches=(1, 2), context=16, steps=2, peer="vllm", peer_python=fake, rounds=2,
        progress=news.append,
    )  # fmt: skip
    assert news[0].startswith("starting vLLM") and len(news) == 1 + 2 * 2 * 2
    assert news[-1] == "vllm B=2 round 2/2: 2000.0 ms"
    assert log.read_text().split() == ["1", "1", "2", "2"]  # B by B, a turn per round
    rounds = result["rounds_ms"]
    assert rounds["vllm"] == {"1": [1000.0, 1000.0], "2": [2000.0, 2000.0]}
    assert all(len(v) == 2 and None not in v for v in rounds["ours"].values())
    for b in ("1", "2"):
        want = statistics.median(round(o / (1000.0 * int(b)), 3) for o in rounds["ours"][b])
        assert result["step_ratio_vs_vllm"][b] == pytest.approx(want, abs=1e-3)
        assert result["step_ms"]["ours"][b] == pytest.approx(statistics.median(rounds["ours"][b]))


def test_decode_bench_reports_a_peer_that_dies(tiny: LoadedModel, tmp_path) -> None:
    fake = _fake_peer(tmp_path, "print('ImportError: no module named vllm'); sys.exit(3)")
    with pytest.raises(CachecraftError, match=r"exit 3\):\nImportError: no module named vllm"):
        run_decode_bench(tiny, batches=(1,), context=16, steps=2, peer="vllm", peer_python=fake)
