"""turnout.yaml and the controller's start, given what a user gets wrong: each is one InvalidInput naming the key
or flag, and nothing is made or lost first (above all, never another database's admin token)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from turnout.config import controller_settings
from turnout.errors import InvalidInput
from turnout.runtime import build_controller, check_tls_files, listen, private_dir


def settings_of(tmp_path: Path, text: str) -> InvalidInput | object:
    path = tmp_path / "turnout.yaml"
    path.write_text(text)
    try:
        return controller_settings(path)
    except InvalidInput as exc:
        return exc


# ---- M6: a key defined twice -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "pipelines:\n  p: {stages: [{capability: a}]}\n  p: {stages: [{capability: b}]}\n",
            "pipelines.p: defined twice (lines 2 and 3)",
        ),
        ("prices: {cpu: 1}\nprices: {cpu: 2}\n", "prices: defined twice (lines 1 and 2)"),
        ("prices:\n  cpu: 1\n  gpu: 2\n  cpu: 3\n", "prices.cpu: defined twice (lines 2 and 4)"),
        (
            "pipelines:\n  p:\n    stages:\n      - capability: a\n        retries: 1\n        retries: 2\n",
            "pipelines.p.stages.0.retries: defined twice (lines 5 and 6)",
        ),
    ],
)
def test_a_key_defined_twice_is_refused_naming_it_and_both_lines(
    tmp_path: Path, text: str, says: str
) -> None:
    got = settings_of(tmp_path, text)
    assert isinstance(got, InvalidInput)
    assert got.message.startswith(f"{tmp_path / 'turnout.yaml'}: {says}")


def test_the_same_key_in_two_mappings_is_fine(tmp_path: Path) -> None:
    text = "pipelines:\n  p: {stages: [{capability: a}]}\n  q: {stages: [{capability: a}]}\n"
    got = settings_of(tmp_path, text)
    assert not isinstance(got, InvalidInput), got


# ---- M7, L11: prices -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("price", "shown"),
    [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf"), ("-1", "-1"), ("'abc'", "'abc'")],
)
def test_a_price_that_is_not_a_finite_number_at_least_0_is_refused(
    tmp_path: Path, price: str, shown: str
) -> None:
    got = settings_of(tmp_path, f"prices: {{cpu: {price}}}\n")
    assert isinstance(got, InvalidInput)
    assert got.message == (
        f"{tmp_path / 'turnout.yaml'}: prices.cpu: expected a price >= 0 in USD per second, got {shown}"
    )


def test_a_price_in_scientific_notation_is_taken(tmp_path: Path) -> None:
    got = settings_of(tmp_path, "prices: {cpu: 2e-4, gpu: 1.5E-3, 'gpu:H100': 3e-3}\n")
    assert not isinstance(got, InvalidInput), got
    assert (got.prices.cpu, got.prices.gpu, got.prices.gpu_models) == (2e-4, 1.5e-3, {"H100": 3e-3})  # type: ignore[attr-defined]


# ---- L2, L3: --port and --host ---------------------------------------------------------------------------


@pytest.mark.parametrize("port", [70000, -1, 65536])
def test_a_port_out_of_range_is_refused_naming_port(port: int) -> None:
    with pytest.raises(InvalidInput) as caught:
        listen("127.0.0.1", port)
    assert caught.value.field == "port" and "0-65535" in caught.value.message


@pytest.mark.parametrize("host", ["nosuch.invalid", "192.0.2.1"])
def test_a_host_that_is_not_this_machines_is_blamed_on_host_not_port(host: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        listen(host, 0)
    assert caught.value.field == "host" and caught.value.message.startswith(f"host: cannot listen on {host}")


def test_a_port_in_use_is_still_the_ports_fault() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(InvalidInput) as caught:
            listen("127.0.0.1", taken.getsockname()[1])
        assert caught.value.field == "port" and "address already in use" in caught.value.message
    finally:
        taken.close()


# ---- H2: admin.token, --home, --storage, TLS files --------------------------------------------------------


def test_a_start_on_another_database_keeps_the_admin_token_that_was_there(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "admin.token").write_text("tnt_the_only_copy_of_another_databases_token\n")
    parts = build_controller(db="memory://", home=home, fresh_admin_token=True)
    # Then the new token is in admin.token (where the CLI looks), and the old one was kept, whole, beside it
    assert parts.admin_token and (home / "admin.token").read_text().strip() == parts.admin_token
    kept = parts.previous_admin_token
    assert kept is not None and kept.parent == home and kept.name.startswith("admin.token.")
    assert kept.read_text() == "tnt_the_only_copy_of_another_databases_token\n"
    assert kept.stat().st_mode & 0o077 == 0


def test_a_start_that_reuses_its_own_admin_token_keeps_nothing_aside(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 't.db'}"
    first = build_controller(db=db, home=tmp_path / "home", fresh_admin_token=True)
    again = build_controller(db=db, home=tmp_path / "home", fresh_admin_token=True)
    assert again.admin_token == first.admin_token and again.previous_admin_token is None
    assert sorted(p.name for p in (tmp_path / "home").iterdir() if p.name.startswith("admin")) == [
        "admin.token"
    ]


@pytest.mark.parametrize("flag", ["--home", "--storage"])
def test_a_home_or_storage_that_is_a_file_is_refused_naming_the_flag_before_anything_is_made(
    tmp_path: Path, flag: str
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    home = afile if flag == "--home" else tmp_path / "home"
    with pytest.raises(InvalidInput) as caught:
        build_controller(db="memory://", home=home, storage=afile if flag == "--storage" else None)
    assert caught.value.message == f"{flag}: {afile} is not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no home, no token


def test_a_home_under_a_file_is_refused() -> None:
    with pytest.raises(InvalidInput) as caught:
        private_dir(Path("/etc/hostname/sub"))
    assert caught.value.field == "home" and "is under /etc/hostname" in caught.value.message


def test_tls_files_are_checked_naming_the_flag_and_the_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as caught:
        check_tls_files(tmp_path / "nope.pem", tmp_path / "nope.key")
    assert caught.value.field == "tls-cert" and str(tmp_path / "nope.pem") in caught.value.message
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(InvalidInput) as caught:
        check_tls_files(junk, junk)
    assert "not a PEM certificate and its key" in caught.value.message
    with pytest.raises(InvalidInput):
        check_tls_files(junk, None)
    check_tls_files(None, None)
