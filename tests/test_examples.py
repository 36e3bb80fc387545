"""The examples still run: `examples/gpu_ttft.py` on the CPU with the bundled model at a tiny
size (its numbers are a GPU's business; here only that it answers and reuses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_ttft_runs_on_the_cpu_and_reuses(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    args = [
        sys.executable, str(ROOT / "examples" / "gpu_ttft.py"), "--device", "cpu",
        "--chunks", "2", "--pool", "3", "--chunk-tokens", "40", "--warmup", "1",
        "--requests", "2", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    modes = got["modes"]
    assert set(modes) == {"full", "prefix", "cachecraft"} and got["device"] == "cpu"
    assert modes["full"]["computed_fraction"] == 1.0
    assert 0 < modes["cachecraft"]["computed_fraction"] < 1  # the chunks were reused
    assert all(m["ttft_ms_p50"] > 0 for m in modes.values())
    assert "full/cachecraft" in done.stdout
