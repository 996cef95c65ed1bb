"""A stored file's download reads from a handle the route opened before answering (`api/files.py`): a file
deleted or expired after the route found it still goes out whole, ranges included, and no handle is left open."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from tests.inprocess.conftest import Served
from turnout.api import files

DATA = os.urandom(3 * 1024 * 1024 + 17)  # more than one read of `CHUNK_BYTES`


def _upload(served: Served) -> str:
    resp = served.call(
        "POST", "/v1/files", content=DATA, headers={"Content-Type": "application/octet-stream"}
    )
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


@pytest.fixture
def unlinked_once_answered(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every download's file removed from the storage the moment its answer is made, before its body is read."""
    removed: list[Path] = []
    made = files.BigFileResponse.__init__

    def and_removed(self: files.BigFileResponse, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        Path(self.path).unlink()
        removed.append(Path(self.path))

    monkeypatch.setattr(files.BigFileResponse, "__init__", and_removed)
    return removed


@pytest.mark.parametrize(
    "byte_range", [None, "bytes=1000-2999999", "bytes=-5", "bytes=3145700-", "bytes=0-9,3145000-3145010"]
)
def test_a_file_removed_once_its_download_was_answered_still_goes_out_whole(
    served: Served, unlinked_once_answered: list[Path], byte_range: str | None
) -> None:
    file_id = _upload(served)
    resp = served.call("GET", f"/v1/files/{file_id}", headers={"Range": byte_range} if byte_range else {})
    assert unlinked_once_answered and not unlinked_once_answered[0].exists()  # gone before the body was read
    if byte_range is None:
        assert resp.status_code == 200 and resp.content == DATA
        assert resp.headers[files.SHA256_HEADER] == hashlib.sha256(DATA).hexdigest()
    elif "," not in byte_range:
        start, _, end = byte_range.removeprefix("bytes=").partition("-")
        want = DATA[-int(end) :] if not start else DATA[int(start) : int(end) + 1 if end else None]
        assert resp.status_code == 206 and resp.content == want
    else:  # two ranges: one multipart body, each part from the same handle
        assert (
            resp.status_code == 206 and DATA[0:10] in resp.content and DATA[3145000:3145011] in resp.content
        )


def test_no_handle_stays_open_after_downloads_heads_and_refused_ranges(served: Served) -> None:
    file_id = _upload(served)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        assert served.call("GET", f"/v1/files/{file_id}").content == DATA
        assert served.call("HEAD", f"/v1/files/{file_id}").status_code == 200
        assert (
            served.call("GET", f"/v1/files/{file_id}", headers={"Range": "bytes=99999999-"}).status_code
            == 416
        )
        assert served.call("GET", f"/v1/files/{file_id}", headers={"Range": "pages=1"}).status_code in (
            200,
            422,
        )
    assert len(os.listdir("/proc/self/fd")) <= before + 2  # what the loop opened, it closed (a little slack)


def test_a_range_for_another_copy_of_the_file_is_ignored_and_the_whole_file_sent(served: Served) -> None:
    """`If-Range` names the copy a client holds a part of: for any other, the range means nothing (RFC 9110
    13.1.5) and the whole file goes out, even where the range could not be served."""
    path = f"/v1/files/{_upload(served)}"
    etag = f'"{hashlib.sha256(DATA).hexdigest()}"'
    for byte_range in ("bytes=99999999-", "bytes=5-2", "bytes=10-19"):
        other = served.call("GET", path, headers={"Range": byte_range, "If-Range": '"other"'})
        assert (other.status_code, other.content) == (200, DATA), byte_range
    same = served.call("GET", path, headers={"Range": "bytes=10-19", "If-Range": etag})
    assert (same.status_code, same.content) == (206, DATA[10:20])
    past = served.call("GET", path, headers={"Range": "bytes=99999999-", "If-Range": etag})
    assert past.status_code == 416
