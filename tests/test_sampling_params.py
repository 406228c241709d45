"""``SamplingParams`` validation that needs no model: every float must be a finite number in
the float32 range the sampler computes in, and the seed a signed 64-bit integer (issue 11)."""

from __future__ import annotations

import math

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError

FLOATS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e308, -1e308])
def test_non_finite_floats_are_rejected_naming_the_field(name, value):
    """NaN passed every range check (all comparisons are false) and sampled token 0 at each
    step; 1e308 is infinite once the sampler makes it a float32."""
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{name: value})
    assert err.value.param == name
    assert "finite number" in str(err.value) and name in str(err.value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_logit_bias_is_rejected(value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(logit_bias={5: value})
    assert err.value.param == "logit_bias"


def test_large_but_finite_temperature_is_fine():
    assert SamplingParams(temperature=1e30).temperature == 1e30
    assert SamplingParams(temperature=2).temperature == 2  # an int is a number


@pytest.mark.parametrize("seed", [2**63, 2**70, -(2**63) - 1])
def test_seed_outside_int64_is_rejected_with_the_range(seed):
    """It failed later with torch's "Overflow when unpacking long long"."""
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(seed=seed)
    assert err.value.param == "seed"
    assert "[-9223372036854775808, 9223372036854775807]" in str(err.value)


def test_seed_bounds_are_accepted():
    for seed in (-(2**63), 2**63 - 1, 0):
        assert SamplingParams(seed=seed).seed == seed


@pytest.mark.parametrize("name", ["top_p", "repetition_penalty"])
@pytest.mark.parametrize("value", [5e-324, 1e-40])
def test_positive_values_that_are_zero_in_float32_are_rejected(name, value):
    """5e-324 is positive but 0 as a float32: a repetition penalty of 0 turned the grammar's
    masked logits (-inf * 0) into NaN, and greedy sampling then picked a forbidden token."""
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{name: value})
    assert err.value.param == name and "1.175494e-38" in str(err.value)
    assert SamplingParams(**{name: 1e-30}).validate() is None
