"""The strategy registry: one check of a strategy name, the product's three strategies, the lab's
baselines registered into it, parameters changed per arm, and the product config's field checks.
Torch-free (no model)."""

from __future__ import annotations

import dataclasses

import pytest

from cachecraft.config import ReuseConfig
from cachecraft.errors import BadRequestError
from cachecraft.llm import configure, split_settings
from cachecraft.reuse.cachecraft import CachecraftParams
from cachecraft.reuse.strategies import STRATEGIES, product_registry
from cachecraft.reuse.strategy import StrategyRegistry
from cachecraft_bench.modes import LAB_MODES
from cachecraft_bench.strategies import BASELINES, EpicStrategy, register


def test_the_product_ships_three_strategies() -> None:
    assert product_registry().names() == ("full", "prefix", "cachecraft")


def test_an_unknown_name_is_a_bad_request_naming_the_valid_ones() -> None:
    with pytest.raises(BadRequestError, match="unknown mode 'magic'; choose one of full, prefix, "):
        product_registry().get("magic")
    with pytest.raises(BadRequestError, match="choose one of full, prefix, cachecraft$"):
        product_registry().get("naive")  # a lab baseline: not served by the product alone


def test_the_lab_registers_its_baselines_once() -> None:
    registry = product_registry()
    assert register(registry) is registry
    assert set(registry.names()) == set(LAB_MODES)
    assert len(registry.names()) == 3 + len(BASELINES)
    register(registry)  # again: nothing changes
    assert len(registry.names()) == 3 + len(BASELINES)
    assert isinstance(registry.get("epic"), EpicStrategy)
    assert "naive" not in product_registry()  # a fresh product registry is the product's alone


def test_another_kind_under_a_taken_name_is_refused() -> None:
    class Impostor(EpicStrategy):
        name = "cachecraft"

    registry = product_registry()
    with pytest.raises(ValueError, match="'cachecraft' is registered already"):
        registry.register(Impostor())


def test_a_strategy_object_resolves_as_it_is_and_keeps_its_name() -> None:
    ablation = STRATEGIES.get("cachecraft").with_params(probe_sink=0)
    assert STRATEGIES.resolve(ablation) is ablation
    assert ablation.name == "cachecraft" and ablation.params.probe_sink == 0
    assert ablation != STRATEGIES.get("cachecraft")
    with pytest.raises(ValueError, match="probe_sink must be >= 0"):
        ablation.with_params(probe_sink=-1)


def test_flags_are_capabilities_not_names() -> None:
    full, prefix, cachecraft = (STRATEGIES.get(n) for n in ("full", "prefix", "cachecraft"))
    assert not full.reads_store and prefix.reads_store and cachecraft.reads_store
    assert prefix.exact_only and not cachecraft.exact_only
    assert cachecraft.remembers_prompts and not prefix.remembers_prompts


def test_one_settings_registry_routes_each_name_to_its_owner() -> None:
    cachecraft = STRATEGIES.get("cachecraft")
    fields = {"alpha": 0.3, "probe_sink": 2, "max_variants_per_chunk": 1}
    reuse, params, store = split_settings(fields, cachecraft)
    assert (reuse, params, store) == (
        {"alpha": 0.3},
        {"probe_sink": 2},
        {"max_variants_per_chunk": 1},
    )
    with pytest.raises(BadRequestError, match=r"unknown option\(s\) \['bogus'\]"):
        split_settings({"bogus": 1}, cachecraft)
    with pytest.raises(BadRequestError, match="storage_dtype: a store setting"):
        configure({"storage_dtype": "float32"})
    config, registry = configure({"alpha": 0.3, "epic_k": 4}, STRATEGIES)
    assert config == ReuseConfig(alpha=0.3) and isinstance(registry, StrategyRegistry)
    assert registry.get("epic").params.epic_k == 4
    assert registry.get("cachecraft") == cachecraft  # it takes no epic_k


def test_reuse_config_is_small_and_checks_each_range() -> None:
    assert len(dataclasses.fields(ReuseConfig)) <= 12
    for bad, says in (
        ({"alpha": -1.0}, "alpha must be >= 0.0"),
        ({"max_fix": 1.5}, r"max_fix must be \[0.0, 1.0\]"),
        ({"stats_stride": 0}, "stats_stride must be >= 1"),
        ({"stats_stride": 1.5}, "stats_stride must be an integer"),
        ({"refresh_repeats": "yes"}, "refresh_repeats must be true or false"),
        ({"min_fix": 0.6, "max_fix": 0.5}, "min_fix <= max_fix"),
    ):
        with pytest.raises(ValueError, match=says):
            ReuseConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probe_split must be one of need, global, chunk"):
        CachecraftParams(probe_split="half")  # type: ignore[arg-type]
