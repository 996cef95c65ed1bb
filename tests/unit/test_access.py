"""Role and tenant checks as properties: no token reaches past its role, its tenant, or the token that made it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.access import (
    ALL_TENANTS,
    ALLOWED,
    Action,
    Principal,
    allow,
    check_grant,
    check_tenant_name,
    sees,
    visible,
    worker_serves,
)
from turnout.errors import Forbidden, InvalidInput, NotFound
from turnout.models import Role

TENANTS = ["default", "acme", "globex", ALL_TENANTS]
tenants = st.sampled_from(TENANTS)
roles = st.sampled_from(list(Role))
principals = st.builds(Principal, st.just("k_1"), roles, tenants)
# what a caller might ask for: real roles and tenants, and junk
asked_roles = st.one_of(st.sampled_from([r.value for r in Role]), st.text(max_size=8), st.integers())
asked_tenants = st.one_of(tenants, st.text(max_size=70), st.none())


def test_the_role_table_is_the_contract() -> None:
    """DESIGN.md: worker tokens lease and report but cannot submit; only admins manage; read reads."""
    assert ALLOWED[Action.SUBMIT] == {Role.ADMIN, Role.SUBMIT}
    assert ALLOWED[Action.READ] == {Role.ADMIN, Role.SUBMIT, Role.READ}
    assert ALLOWED[Action.WORKER] == {Role.ADMIN, Role.WORKER}
    assert ALLOWED[Action.ADMIN] == {Role.ADMIN}
    assert ALLOWED[Action.ANY] == set(Role)


@given(principals, st.sampled_from(list(Action)))
def test_allow_admits_exactly_the_roles_in_the_table(p: Principal, action: Action) -> None:
    if p.role in ALLOWED[action]:
        assert allow(p, action) is p
    else:
        with pytest.raises(Forbidden):
            allow(p, action)


@given(principals, asked_roles, asked_tenants)
def test_a_granted_token_never_sees_more_than_its_maker(p: Principal, role: object, tenant: object) -> None:
    try:
        granted_role, granted_tenant = check_grant(p, role, tenant)
    except (Forbidden, InvalidInput):
        return
    assert p.role is Role.ADMIN
    made = Principal("k_2", granted_role, granted_tenant)
    for owner in ["default", "acme", "globex", None]:
        assert not sees(made, owner) or sees(p, owner)  # whatever the new token sees, its maker sees
    if granted_tenant == ALL_TENANTS:
        assert p.is_operator and granted_role is not Role.SUBMIT


@given(principals, asked_roles, asked_tenants)
def test_only_admins_grant_and_a_tenant_admin_only_within_its_tenant(
    p: Principal, role: object, tenant: object
) -> None:
    may = p.role is Role.ADMIN and (p.tenant == ALL_TENANTS or tenant == p.tenant)
    try:
        check_grant(p, role, tenant)
        granted = True
    except Forbidden:
        granted = False
    except InvalidInput:
        return  # a malformed role or tenant: refused before any question of rights
    assert granted == may


@given(principals, st.sampled_from(["default", "acme", "globex"]))
def test_a_tenant_token_sees_its_own_tenant_only_and_cluster_records_never(p: Principal, owner: str) -> None:
    if p.tenant == ALL_TENANTS:
        assert sees(p, owner) and sees(p, None)
    else:
        assert sees(p, owner) == (owner == p.tenant)
        assert not sees(p, None)
        if owner != p.tenant:
            with pytest.raises(NotFound):
                visible(p, owner, "task t_1")


@given(tenants, st.sampled_from(["default", "acme", "globex"]))
def test_a_worker_serves_its_tenant_or_all_for_a_shared_pool(scope: str, task_tenant: str) -> None:
    assert worker_serves(scope, task_tenant) == (scope in (ALL_TENANTS, task_tenant))


@pytest.mark.parametrize(
    ("principal", "role", "tenant", "error"),
    [
        (Principal("k", Role.ADMIN, "acme"), "admin", "default", Forbidden),  # the first escalation
        (
            Principal("k", Role.ADMIN, "acme"),
            "worker",
            ALL_TENANTS,
            Forbidden,
        ),  # a shared pool: operator only
        (Principal("k", Role.SUBMIT, "acme"), "submit", "acme", Forbidden),
        (
            Principal("k", Role.ADMIN, ALL_TENANTS),
            "submit",
            ALL_TENANTS,
            InvalidInput,
        ),  # submits as one tenant
        (Principal("k", Role.ADMIN, ALL_TENANTS), "root", "acme", InvalidInput),
        (Principal("k", Role.ADMIN, ALL_TENANTS), "read", "no spaces", InvalidInput),
    ],
)
def test_escalations_and_bad_grants_are_refused_with_a_reason(
    principal: Principal, role: str, tenant: str, error: type[Exception]
) -> None:
    with pytest.raises(error) as caught:
        check_grant(principal, role, tenant)
    if error is InvalidInput:
        assert getattr(caught.value, "field", None) in ("role", "tenant")


def test_the_operator_acts_as_tenant_default_when_it_makes_things() -> None:
    assert Principal("k", Role.ADMIN, ALL_TENANTS).home_tenant == "default"
    assert Principal("k", Role.SUBMIT, "acme").home_tenant == "acme"


@pytest.mark.parametrize("name", ["", "-lead", "a" * 65, "sp ace", "dot.ted", "*"])
def test_bad_tenant_names_are_422_naming_the_field(name: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        check_tenant_name(name, "tenant")
    assert caught.value.field == "tenant"
