"""Simulator parameter models: durations, validation messages, presets, --set overrides."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from llmgw.services.sim.params import (
    EngineParams,
    FaultKnobs,
    ProviderParams,
    apply_overrides,
)


def test_engine_params_accept_duration_strings_and_forbid_unknown_fields() -> None:
    params = EngineParams.model_validate({"itl_base": "5ms", "prefill_per_token": "0.1ms"})
    assert params.itl_base == pytest.approx(0.005)
    assert params.kind == "engine"
    with pytest.raises(ValidationError, match="itl_bsae"):
        EngineParams.model_validate({"itl_bsae": "5ms"})
    with pytest.raises(ValidationError, match="output_len_mean"):
        EngineParams(output_len_mean=100, output_len_max=10)


def test_zero_delay_presets_zero_every_timing() -> None:
    engine = EngineParams.zero_delay(max_num_seqs=3)
    assert (
        engine.prefill_base,
        engine.prefill_per_token,
        engine.itl_base,
        engine.itl_per_running_seq,
    ) == (0, 0, 0, 0)
    assert engine.max_num_seqs == 3
    provider = ProviderParams.zero_delay()
    assert (provider.base_latency, provider.tokens_per_second) == (0, 0)


def test_provider_drift_must_be_sorted() -> None:
    with pytest.raises(ValidationError, match="sorted"):
        ProviderParams(
            drift=[{"at": "2s", "tokens_per_second": 1}, {"at": "1s", "tokens_per_second": 2}]
        )


def test_apply_overrides_parses_values_and_names_bad_keys() -> None:
    params = apply_overrides(
        EngineParams(),
        ["max_num_seqs=8", "itl_base=2ms", 'served_models=["a", "b"]', "die_at_token=null"],
        {"seed": 9},
    )
    assert (params.max_num_seqs, params.itl_base, params.served_models, params.seed) == (
        8,
        pytest.approx(0.002),
        ["a", "b"],
        9,
    )
    with pytest.raises(ValueError, match="max_num_sqs"):
        apply_overrides(EngineParams(), ["max_num_sqs=8"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        apply_overrides(EngineParams(), ["max_num_seqs=zero"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        apply_overrides(EngineParams(), ["max_num_seqs"])


def test_faults_copy_only_the_fault_knobs() -> None:
    faults = EngineParams(error_rate=0.25, max_num_seqs=2).faults()
    assert isinstance(faults, FaultKnobs) and faults.error_rate == 0.25
    assert "max_num_seqs" not in faults.model_dump()


@pytest.mark.parametrize(
    ("given", "expected"), [({}, "fcfs"), ({"scheduling_policy": "priority"}, "priority")]
)
def test_scheduling_policy_defaults_to_fcfs_and_accepts_priority(given, expected) -> None:
    assert EngineParams.model_validate(given).scheduling_policy == expected
    assert apply_overrides(EngineParams(), [f"scheduling_policy={expected}"]).scheduling_policy == (
        expected
    )


@pytest.mark.parametrize("value", ["lifo", "PRIORITY", "sjf", ""])
def test_unknown_scheduling_policies_are_refused_naming_the_field(value: str) -> None:
    with pytest.raises(ValidationError, match="scheduling_policy"):
        EngineParams(scheduling_policy=value)
    with pytest.raises(ValueError, match="scheduling_policy"):
        apply_overrides(EngineParams(), [f"scheduling_policy={value}"])
    with pytest.raises(ValidationError, match="scheduling_policy"):
        ProviderParams.model_validate({"scheduling_policy": "priority"})  # engines only
