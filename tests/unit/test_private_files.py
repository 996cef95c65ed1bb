"""The SQLite database (tasks' inputs and outputs, token hashes, the audit log) is readable by its owner only."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from turnout.errors import InvalidInput, TurnoutError
from turnout.runtime import private_dir
from turnout.store import open_store


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_database_with_its_wal_and_shm_is_private_and_so_is_the_directory_made_for_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state" / "turnout.db"
    store = open_store(f"sqlite:///{path}")
    try:
        store.append_audit([(0.0, "test", None, {"written": True})])  # a write: the -wal and -shm exist
        modes = {p.name: mode_of(p) for p in path.parent.iterdir()}
    finally:
        store.close()
    assert modes == {"turnout.db": 0o600, "turnout.db-wal": 0o600, "turnout.db-shm": 0o600}
    assert mode_of(path.parent) == 0o700


def test_a_world_readable_database_left_by_an_older_version_is_made_private_when_opened(
    tmp_path: Path,
) -> None:
    path = tmp_path / "turnout.db"
    old = sqlite3.connect(path)
    old.execute("PRAGMA journal_mode=WAL")
    old.execute("CREATE TABLE t (x)")
    old.execute("INSERT INTO t VALUES (1)")
    old.commit()
    files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
    for f in files:
        f.chmod(0o644)
    store = open_store(f"sqlite:///{path}")
    try:
        assert [mode_of(f) for f in files] == [0o600, 0o600, 0o600]
    finally:
        store.close()
        old.close()


def test_a_new_turnout_home_is_private_and_an_unrelated_existing_directory_is_left_alone(
    tmp_path: Path,
) -> None:
    home = tmp_path / "new" / "home"
    private_dir(home)
    assert mode_of(home) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    private_dir(shared)
    assert mode_of(shared) == 0o755
    (shared / "admin.token").write_text("x")  # a Turnout home made world-readable by an older version
    private_dir(shared)
    assert mode_of(shared) == 0o700


def test_the_admin_token_replaces_a_world_readable_one_whole_and_private(tmp_path: Path) -> None:
    from turnout.auth import write_admin_token

    old = tmp_path / "admin.token"
    old.write_text("old-token\n")
    old.chmod(0o644)
    path = write_admin_token(tmp_path, "new-token")
    assert path == old and path.read_text() == "new-token\n" and mode_of(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["admin.token"]  # no part file left beside it


def test_a_file_that_is_not_a_database_is_refused_and_its_mode_left_as_it_was(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, not a database\n")
    notes.chmod(0o644)
    with pytest.raises(TurnoutError) as refused:
        open_store(f"sqlite:///{notes}")
    assert refused.value.field == "db"
    assert mode_of(notes) == 0o644 and notes.read_text() == "my notes, not a database\n"


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_a_database_path_that_cannot_be_a_file_is_refused_naming_db(tmp_path: Path, where: str) -> None:
    (tmp_path / "file").write_text("x")
    path = tmp_path if where == "a directory" else tmp_path / "file" / "turnout.db"
    with pytest.raises(InvalidInput) as refused:
        open_store(f"sqlite:///{path}")
    assert refused.value.field == "db" and str(path) in refused.value.message
