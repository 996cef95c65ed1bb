"""Resource quantities and requirements: parse, validate, and name the field on every error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.errors import InvalidInput
from turnout.resources import format_bytes, model_matches, parse_bytes, parse_resources


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512Mi", 512 * 2**20), ("4Gi", 4 * 2**30), ("1G", 10**9), ("1.5Gi", int(1.5 * 2**30)), ("100", 100),
     (2048, 2048), ("80GiB", 80 * 2**30), (" 2 Gi ", 2 * 2**30)],
)  # fmt: skip
def test_quantities_parse_to_bytes(text: object, expected: int) -> None:
    assert parse_bytes(text, "memory") == expected


@pytest.mark.parametrize("bad", ["8Gx", "-1", -1, "Gi", "", "1.2.3Gi", True, None, [1], float("nan")])
def test_a_bad_quantity_is_an_error_naming_the_field(bad: object) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_bytes(bad, "resources.memory")
    assert err.value.field == "resources.memory"
    assert "resources.memory" in err.value.message


@given(
    st.integers(min_value=0, max_value=2**22), st.sampled_from(["", "Ki", "Mi", "Gi", "Ti", "K", "M", "G"])
)
def test_integer_quantities_round_trip(n: int, suffix: str) -> None:  # 2**22 Ti is just under 2**63 bytes
    parsed = parse_bytes(f"{n}{suffix}", "memory")
    assert parse_bytes(format_bytes(parsed), "memory") == parsed


@given(st.integers(min_value=1, max_value=64))
def test_whole_gpus_are_exclusive_and_not_shared(n: int) -> None:
    r = parse_resources({"gpu": n})
    assert r.wants_gpu and r.whole_gpus == n and not r.is_shared_gpu


@given(st.floats(min_value=0.001, max_value=0.999))
def test_a_fraction_of_a_gpu_is_shared(x: float) -> None:
    r = parse_resources({"gpu": x})
    assert r.is_shared_gpu and r.whole_gpus == 0


@given(st.floats(min_value=1.0001, max_value=100).filter(lambda x: x != int(x)))
def test_fractional_gpu_counts_above_one_are_refused(x: float) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_resources({"gpu": x})
    assert err.value.field == "resources.gpu"


@pytest.mark.parametrize(
    ("spec", "field"),
    [({"gpu": 1.5}, "resources.gpu"), ({"gpu": -1}, "resources.gpu"), ({"memory": "8Gx"}, "resources.memory"),
     ({"cpu": -2}, "resources.cpu"), ({"cpu": "lots"}, "resources.cpu"), ({"gpu_memory": "0"}, "resources.gpu_memory"),
     ({"min_compute_capability": "eight"}, "resources.min_compute_capability"), ({"gpu_model": [1]}, "resources.gpu_model"),
     ({"gpus": 1}, "resources.gpus")],
)  # fmt: skip
def test_bad_resources_name_the_field(spec: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_resources(spec)
    assert err.value.field == field


def test_gpu_memory_alone_is_a_shared_gpu_request() -> None:
    r = parse_resources({"gpu_memory": "8Gi", "gpu_model": ["H100", "A100"], "min_compute_capability": "8.0"})
    assert r.is_shared_gpu and r.gpu_memory_bytes == 8 * 2**30
    assert r.gpu_models == ("H100", "A100") and r.min_compute_capability == (8, 0)


@given(
    st.dictionaries(st.sampled_from(["cpu", "memory", "gpu", "gpu_memory"]), st.integers(0, 4), min_size=1)
)
def test_to_dict_round_trips(spec: dict[str, int]) -> None:
    spec = {k: v for k, v in spec.items() if not (k == "gpu_memory" and v == 0)}
    r = parse_resources(spec)
    assert parse_resources(r.to_dict()) == r


def test_model_preference_is_ordered_substring_matching() -> None:
    assert model_matches(("H100", "A100"), "NVIDIA A100-SXM4-80GB") == 1
    assert model_matches(("h100",), "NVIDIA H100 80GB HBM3") == 0
    assert model_matches(("L4",), "NVIDIA A100") is None
    assert model_matches((), "anything") == 0


@pytest.mark.parametrize("quantity", ["8388608Ti", "9" * 400 + "Gi", 2**63, "1e400"])
def test_a_quantity_of_2_to_the_63_bytes_or_more_is_refused_naming_the_field(quantity: object) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_bytes(quantity, "resources.memory")  # type: ignore[arg-type]
    assert err.value.field == "resources.memory"
