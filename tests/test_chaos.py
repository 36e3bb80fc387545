"""The chaos suite's fast slice: bit flips, truncations, index loss (with and without
`cachecraft chunks reindex`) and non-finite values written with valid checksums, injected into
a disk-tier chunk cache between real requests of the tiny model. Every answer equals the
intact cache's (the full prefill's, in `prefix` mode) or the request fails cleanly; nothing
acknowledged and undamaged is lost; every restart succeeds. (The damaged kernel library, the
fifth fault class, is tests/test_model_row_kernel.py's; `cachecraft bench chaos` runs all.)"""

from __future__ import annotations

from pathlib import Path

from cachecraft.model.loader import LoadedModel
from cachecraft_bench.chaos import FILE_FAULTS, run_chaos, table


def test_file_faults_never_serve_a_wrong_answer_nor_lose_data(
    tiny: LoadedModel, tiny_dir: Path, tmp_path: Path
) -> None:
    rows = run_chaos(tiny, str(tiny_dir), 8, seed=3, faults=FILE_FAULTS, cache_dir=tmp_path)
    print(table(rows))
    assert [r.fault for r in rows] == list(FILE_FAULTS)
    for r in rows:
        assert r.injections == 2, r
        assert r.wrong == 0 and r.lost == 0 and r.failed_starts == 0, r
        assert r.equal + r.clean_failures == r.injections, r
    # every damaged file was caught: the answers were recomputed, not served from it
    assert len(list(tmp_path.glob("quarantine/*.safetensors"))) >= 4
