"""One home per setting: the config file's errors name where a misplaced setting belongs; flags
override the file; the environment is read in env.py only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cachecraft
from cachecraft.config_file import load_reuse_overrides, merge_overrides
from cachecraft.env import cache_home
from cachecraft.errors import BadRequestError
from cachecraft.llm import reuse_config
from cachecraft.store.config import StoreConfig


def test_a_store_setting_in_the_reuse_section_names_the_store(tmp_path: Path) -> None:
    path = tmp_path / "cachecraft.json"
    path.write_text(json.dumps({"reuse": {"alpha": 0.2, "storage_dtype": "float32"}}))
    with pytest.raises(BadRequestError, match="storage_dtype: a store setting"):
        reuse_config(**load_reuse_overrides(path))


def test_a_reuse_option_outside_the_reuse_section_is_named(tmp_path: Path) -> None:
    path = tmp_path / "cachecraft.json"
    path.write_text(json.dumps({"alpha": 0.3, "calibration": {"target": 0.9}}))
    with pytest.raises(BadRequestError, match=r"\['alpha'\] at the top level; reuse options"):
        load_reuse_overrides(path)
    path.write_text(json.dumps({"reuse": {"alpha": 0.3}, "calibration": {}, "mine": 1}))
    assert load_reuse_overrides(path) == {"alpha": 0.3}


def test_flags_override_the_file() -> None:
    assert merge_overrides({"alpha": 0.1, "epic_k": 8}, alpha=0.3) == {"alpha": 0.3, "epic_k": 8}
    assert merge_overrides({"alpha": 0.1}, alpha=None) == {"alpha": 0.1}


def test_store_config_rejects_a_bad_storage_dtype() -> None:
    with pytest.raises(ValueError, match="storage_dtype"):
        StoreConfig(storage_dtype="int4")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--max-pinned-bytes-per-namespace", "-1", "max_pinned_bytes_per_namespace"),
        ("--max-variants-per-chunk", "0", "max_variants_per_chunk"),
        ("--max-queue", "-3", "max_queue"),
        ("--max-running", "0", "max_running"),
        ("--admit-all-below", "2", "admit_all_below"),
        ("--redis-url", "notaurl", "redis_url"),  # was a ValueError traceback from redis-py
    ],
)
def test_a_bad_serve_setting_is_one_line(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, needle: str
) -> None:
    from cachecraft.cli import main

    assert main(["serve", "--port", "0", "--cache-dir", "", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad setting:") and needle in err and "Traceback" not in err


def test_cache_home_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_home() == tmp_path / "cachecraft"


def test_only_env_py_reads_the_environment() -> None:
    root = Path(cachecraft.__file__).parent
    reading = re.compile(r"os\.environ(\.get|\.setdefault|\.pop|\[)|getenv|putenv")
    readers = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if reading.search(p.read_text(encoding="utf-8"))
    )
    assert readers == ["env.py"]  # (child processes may be handed the whole environment)


@pytest.mark.parametrize(
    ("reuse", "needle"),
    [
        ({"alpha": "x"}, "alpha must be a finite number"),
        ({"alpha": -3}, "alpha must be >= 0"),
        ({"min_fix": 0.9, "max_fix": 0.1}, "min_fix and max_fix"),
        ({"refresh_repeats": "no"}, "refresh_repeats must be true or false"),
        ({"stats_stride": 2.5}, "stats_stride must be an integer"),
        ({"stats_stride": 0}, "stats_stride must be >= 1"),
        ({"probe_sink": -1}, "probe_sink must be >= 0"),  # a strategy's parameter
    ],
)
def test_a_bad_value_in_the_config_file_stops_serve_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, reuse: dict, needle: str
) -> None:
    """These used to start a server (every request then planned with the bad value)."""
    from cachecraft.cli import main

    path = tmp_path / "cachecraft.json"
    path.write_text(json.dumps({"reuse": reuse}))
    assert main(["serve", "--port", "0", "--cache-dir", "", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad reuse setting:") and needle in err, err
    assert "Traceback" not in err


def test_a_negative_alpha_flag_and_a_bad_llm_keyword_are_refused() -> None:
    from cachecraft.cli import main
    from cachecraft.llm import reuse_config

    assert main(["serve", "--port", "0", "--cache-dir", "", "--alpha", "-1"]) == 2
    with pytest.raises(BadRequestError, match=r"max_fix must be \[0.0, 1.0\]"):
        reuse_config(max_fix=1.5)
    with pytest.raises(BadRequestError, match=r"unknown option\(s\) \['cacheblend_ratio'\]"):
        reuse_config(cacheblend_ratio=0.5)  # a lab baseline's parameter, not a reuse setting


@pytest.mark.parametrize(
    "args",
    [["--port", "99999"], ["--port", "-5"], ["--port", "abc"], ["--log-level", "bogus"]],
)
def test_a_bad_port_or_log_level_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """A port out of range used to end in an OverflowError traceback (exit 1) after loading
    the model; an unknown log level in a ValueError traceback."""
    from cachecraft.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--cache-dir", "", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_a_library_logging_at_debug_prints_at_our_level_only() -> None:
    """bm25s sets its logger to DEBUG on import, and its 'Building index' chatter went to
    stderr under every command that built a wiki-qa workload (the level was the root's only);
    and `serve --log-level trace` ended in a traceback (logging had no level named TRACE)."""
    code = (
        "import logging\n"
        "from cachecraft.logs import setup_logging\n"
        "setup_logging(logging.WARNING)\n"
        "noisy = logging.getLogger('noisy')\n"
        "noisy.setLevel(logging.DEBUG)\n"
        "noisy.debug('chatter')\n"
        "noisy.warning('kept')\n"
        "setup_logging('trace')\n"  # `serve --log-level trace` crashed: logging had no TRACE
        "noisy.setLevel(1)\n"
        "noisy.log(5, 'traced')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "kept" in done.stderr and "chatter" not in done.stderr
    assert "TRACE noisy: traced" in done.stderr


@pytest.mark.parametrize(
    ("device", "needle"),
    [("tpu", "unknown device 'tpu'"), ("mps", "runs on cpu or cuda"), ("cuda:99", "cuda:99")],
)
def test_serve_on_a_device_this_machine_lacks_stops_in_one_line(
    capsys: pytest.CaptureFixture[str], device: str, needle: str
) -> None:
    """`serve --device` puts the weights, the forward and the memory tier on a GPU; a device
    this machine cannot use is named before any weights load (mps was a RuntimeError
    traceback from the RoPE tables)."""
    from cachecraft.cli import main

    assert main(["serve", "--port", "0", "--cache-dir", "", "--device", device]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error:") and needle in err and "Traceback" not in err, err


def test_a_strategy_parameter_in_the_config_reaches_the_servers_requests(tiny_dir: Path) -> None:
    """`serve` used to refuse a strategy's parameters (probe_sink_kept, ...) in cachecraft.json:
    they now configure the registry the engine and every request's mode are resolved in."""
    from types import SimpleNamespace

    from cachecraft.llm import configure
    from cachecraft.server.launch import build_stack, close_stack
    from cachecraft.server.protocol import ChatCompletionRequest
    from cachecraft.server.validate import check_mode

    reuse, strategies = configure({"probe_sink_kept": False, "alpha": 0.25})
    stack = build_stack("cachecraft", model=str(tiny_dir), reuse=reuse, strategies=strategies)
    try:
        engine = stack.engine
        assert engine.default_strategy.params.probe_sink_kept is False  # type: ignore[attr-defined]
        assert engine.runner.reuse.alpha == 0.25
        state = SimpleNamespace(engine=engine)
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert check_mode(state, body) is engine.default_strategy  # type: ignore[arg-type]
        named = body.model_copy(update={"cachecraft_mode": "cachecraft"})
        assert check_mode(state, named).params.probe_sink_kept is False  # type: ignore[arg-type, attr-defined]
    finally:
        close_stack(stack)
