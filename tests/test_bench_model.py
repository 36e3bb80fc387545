"""`bench model`'s peak-memory reading: the growth of one run over the RSS before it, even
when the process peaked higher earlier (the model load), so it is never a flat 0."""

from __future__ import annotations

import json
import subprocess
import sys

# In a process of its own: RSS is process-wide, and memory that threads left behind by other
# tests free meanwhile (a server's, a store writer's) offsets what the run touches.
MEASURE = """
import json, torch
from cachecraft_bench.model_bench import _peak_since
big = torch.ones(96 << 18)  # 96 MiB touched, then freed: an earlier, higher peak
del big

def run():
    x = torch.ones(48 << 18)  # 48 MiB, freed before the run returns
    assert float(x[-1]) == 1.0

print(json.dumps([_peak_since(run), _peak_since(lambda: None)]))
"""


def test_peak_counts_what_a_run_touches_after_a_higher_earlier_peak() -> None:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=120, check=True
    )
    peak, idle = json.loads(done.stdout.strip().splitlines()[-1])
    assert 40 << 20 <= peak <= 80 << 20
    assert idle < 16 << 20
