"""The report writer on a small fake results dict: files, one table row per mode, plots."""

from __future__ import annotations

import json

from cachecraft_bench.report import format_cell, write_report

RESULTS = {
    "config": {"model": "tiny", "k": 5},
    "workloads": {
        "wiki-qa": {
            "modes": {
                "full": {
                    "computed_fraction": 1.0,
                    "flops_fraction": 1.0,
                    "ttft_p50_ms": 120.0,
                    "ttft_p95_ms": 150.0,
                    "rouge_l": {"mean": 1.0, "ci95": [1.0, 1.0], "n": 4},
                    "storage_bytes": 0,
                },
                "cachecraft": {
                    "computed_fraction": {"mean": 0.3, "ci95": [0.25, 0.35], "n": 4},
                    "flops_fraction": 0.28,
                    "ttft_p50_ms": 60.0,
                    "ttft_p95_ms": None,
                    "tf_kl": {"mean": 0.02, "ci95": [0.01, 0.03], "n": 4},
                    "rouge_l": {"mean": 0.9, "ci95": [0.8, 1.0], "n": 4},
                    "f1": float("nan"),
                    "storage_bytes": 3 * 1024 * 1024,
                },
                "naive": {},
            },
            "sweep": {
                "cachecraft": [
                    {"param": 0.1, "computed_fraction": 0.1, "tf_kl": 0.1, "rouge_l": 0.6},
                    {"param": 0.5, "computed_fraction": 0.5, "tf_kl": None, "rouge_l": 0.9},
                ]
            },
        },
        "examples/x.jsonl": {"modes": {"full": {"ttft_p50_ms": 10.0}}, "sweep": {}},
        "empty": {},
    },
}


def test_report_files_tables_and_plots(tmp_path):
    paths = write_report(RESULTS, tmp_path / "out")
    names = {p.name for p in paths}
    assert {"results.json", "report.md"} <= names
    assert {"pareto_wiki-qa.png", "ttft_wiki-qa.png", "computed_wiki-qa.png"} <= names
    assert "ttft_examples_x_jsonl.png" in names and "pareto_examples_x_jsonl.png" not in names
    for p in paths:
        assert p.exists() and p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    md = (tmp_path / "out" / "report.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    # per table: a header, then one row per mode
    assert [r.split("|")[1].strip() for r in rows] == ["mode", "full", "cachecraft", "naive"] + [
        "mode",
        "full",
    ]
    assert "0.300 [0.250, 0.350]" in md and "3.0 MiB" in md and "_no modes were run_" in md

    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["workloads"]["wiki-qa"]["modes"]["cachecraft"]["f1"] is None  # NaN -> null


def test_format_cell_missing_and_plain():
    assert format_cell(None, "{:.3f}") == "–"
    assert format_cell({"mean": None, "ci95": [None, None], "n": 0}, "{:.3f}") == "–"
    assert format_cell(0.5, "{:.2f}") == "0.50"
    assert format_cell({"mean": 2.0, "ci95": [1.0, 3.0], "n": 3}, "{:.1f}") == "2.0 [1.0, 3.0]"
    assert format_cell(512, "bytes") == "512 B"
