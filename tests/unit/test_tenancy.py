"""Per-tenant limits: the `limits:` section validated whole, token buckets as properties, round-robin queues."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from turnout.config import controller_settings
from turnout.errors import InvalidInput, RateLimited
from turnout.tenancy import (
    LimitsTable,
    TenantBuckets,
    TenantLimits,
    TokenBucket,
    admit_submission,
    gpu_allocation_rule,
    parse_limits,
    round_robin,
    submit_rule,
)

# ---- the limits: section ---------------------------------------------------------------------------


def test_named_tenants_inherit_what_they_do_not_set_from_the_star_entry() -> None:
    table = parse_limits({"*": {"submit_per_s": 200, "gpu_allocations_per_min": 600, "max_gpus": 8},
                          "acme": {"submit_per_s": 50, "max_gpus": 2}})  # fmt: skip
    assert table.of("acme") == TenantLimits(submit_per_s=50, gpu_allocations_per_min=600, max_gpus=2)
    assert table.of("anyone-else") == TenantLimits(200, 600, 8)


def test_no_limits_section_means_no_limits() -> None:
    assert parse_limits(None) == LimitsTable()
    assert LimitsTable().of("acme") == TenantLimits(None, None, None)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ([1, 2], "limits"),
        ({"acme": 5}, "limits.acme"),
        ({"acme": {"submit_per_s": 0}}, "limits.acme.submit_per_s"),
        ({"acme": {"submit_per_s": "fast"}}, "limits.acme.submit_per_s"),
        ({"acme": {"submit_per_s": True}}, "limits.acme.submit_per_s"),
        ({"acme": {"gpu_allocations_per_min": -1}}, "limits.acme.gpu_allocations_per_min"),
        ({"acme": {"max_gpus": -0.5}}, "limits.acme.max_gpus"),
        ({"acme": {"max_gpus": float("nan")}}, "limits.acme.max_gpus"),
        ({"*": {"submits_per_s": 5}}, "limits.*.submits_per_s"),
        ({"bad tenant": {}}, "limits.bad tenant"),
    ],
)
def test_a_bad_limit_is_an_error_naming_the_key(raw: object, field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_limits(raw)
    assert caught.value.field == field
    assert field in caught.value.message


def test_a_bad_limit_in_the_config_file_names_the_file_and_the_key(tmp_path: Path) -> None:
    config = tmp_path / "turnout.yaml"
    config.write_text("limits:\n  acme: {max_gpus: lots}\n")
    with pytest.raises(InvalidInput) as caught:
        controller_settings(config)
    assert str(config) in caught.value.message and "limits.acme.max_gpus" in caught.value.message


def test_the_readme_limits_example_means_what_it_says() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", readme, flags=re.S) if b.startswith("limits:"))
    table = parse_limits(yaml.safe_load(block)["limits"], "README.md")
    assert table.of("acme") == TenantLimits(
        submit_per_s=50, gpu_allocations_per_min=60, max_gpus=2, reserved_share=0.25, refusal_hold_s=2
    )
    assert table.of("anyone") == TenantLimits(
        submit_per_s=200, gpu_allocations_per_min=600, max_gpus=8, reserved_share=0.25
    )


def test_zero_gpus_is_a_valid_quota() -> None:
    assert parse_limits({"acme": {"max_gpus": 0}}).of("acme").max_gpus == 0


# ---- token buckets -----------------------------------------------------------------------------------

requests = st.lists(
    st.tuples(st.floats(0, 2, allow_nan=False), st.integers(1, 30)), min_size=1, max_size=60
)  # (seconds since the last request, size)


@given(st.floats(0.5, 100), st.floats(1, 50), requests)
def test_a_bucket_never_admits_more_than_capacity_plus_rate_times_time_plus_one_oversize(
    rate: float, capacity: float, reqs: list[tuple[float, int]]
) -> None:
    bucket = TokenBucket(rate, capacity, capacity, 0.0)
    now = admitted = 0.0
    for dt, n in reqs:
        now += dt
        if bucket.take(n, now) == 0.0:
            admitted += n
    biggest = max(n for _, n in reqs)
    assert admitted <= capacity + rate * now + max(0.0, biggest - capacity) + 1e-6


@given(st.floats(0.5, 100), st.floats(1, 50), requests)
def test_a_refused_request_is_admitted_once_its_retry_after_has_passed(
    rate: float, capacity: float, reqs: list[tuple[float, int]]
) -> None:
    bucket = TokenBucket(rate, capacity, capacity, 0.0)
    now = 0.0
    for dt, n in reqs:
        now += dt
        level = bucket.level
        wait = bucket.take(n, now)
        if wait > 0:
            assert bucket.level == pytest.approx(min(capacity, level + dt * rate))  # a refusal took nothing
            assert bucket.take(n, now + wait + 1e-9) == 0.0
            now += wait + 1e-9


@given(st.floats(0.5, 100), st.floats(1, 50), st.integers(1, 200))
def test_a_request_bigger_than_the_bucket_passes_when_it_is_full(
    rate: float, capacity: float, n: int
) -> None:
    bucket = TokenBucket(rate, capacity, capacity, 0.0)
    assert bucket.take(n, 0.0) == 0.0


def test_buckets_are_per_tenant_and_unlimited_tenants_have_none() -> None:
    clock = [0.0]
    table = parse_limits({"acme": {"submit_per_s": 2}})
    buckets = TenantBuckets(submit_rule(table), lambda: clock[0])
    assert buckets.take("acme", 2) == 0.0
    assert buckets.take("acme", 1) == pytest.approx(0.5)
    assert buckets.take("globex", 10_000) == 0.0  # not named, no "*": unlimited
    clock[0] = 0.5
    assert buckets.take("acme", 1) == 0.0


def test_gpu_allocations_refill_per_minute_with_a_minute_of_burst() -> None:
    clock = [0.0]
    buckets = TenantBuckets(gpu_allocation_rule(parse_limits({"*": {"gpu_allocations_per_min": 60}})),
                            lambda: clock[0])  # fmt: skip
    assert all(buckets.take("acme") == 0.0 for _ in range(60))
    assert buckets.take("acme") == pytest.approx(1.0)
    clock[0] = 1.0
    assert buckets.take("acme") == 0.0


def test_a_gpu_only_submission_over_the_allocation_rate_is_refused_and_costs_nothing() -> None:
    clock = [0.0]
    table = parse_limits({"*": {"submit_per_s": 100, "gpu_allocations_per_min": 2}})
    subs, gpus = (
        TenantBuckets(submit_rule(table), lambda: clock[0]),
        TenantBuckets(gpu_allocation_rule(table), lambda: clock[0]),
    )
    admit_submission(subs, gpus, "acme", 2, 2)
    with pytest.raises(RateLimited) as caught:
        admit_submission(subs, gpus, "acme", 1, 1)
    assert caught.value.field == "gpu" and caught.value.retry_after_s == pytest.approx(30.0)
    assert subs.wait_s("acme", 98) == 0.0  # the refused request took no submission tokens
    admit_submission(subs, gpus, "acme", 5, 0)  # work that may run on a CPU is not held by the GPU rate


# ---- round robin -------------------------------------------------------------------------------------


@given(st.lists(st.lists(st.integers(), max_size=20), max_size=6), st.integers(0, 10))
def test_round_robin_yields_everything_once_and_never_two_from_one_source_while_another_waits(
    sources: list[list[int]], start: int
) -> None:
    tagged = [[(i, x) for x in s] for i, s in enumerate(sources)]
    out = list(round_robin(tagged, start))
    assert sorted(out) == sorted(x for s in tagged for x in s)
    for i, s in enumerate(tagged):
        assert [x for x in out if x[0] == i] == s  # each source's own order is kept
    # in the first k * (number of non-empty sources) items, every source with k items has given them all
    live = [s for s in tagged if s]
    k = min((len(s) for s in live), default=0)
    head = out[: k * len(live)]
    for s in live:
        assert [x for x in head if x[0] == s[0][0]] == s[:k]


def test_round_robin_begins_at_the_given_source() -> None:
    assert list(round_robin([["a1", "a2"], ["b1"], ["c1"]], 1)) == ["b1", "c1", "a1", "a2"]
