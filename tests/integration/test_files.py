"""Files over the real HTTP API: upload, download (whole and by range), delete, limits, tenants, retention,
and files moving in and out of tasks on a real worker: by HTTP, or through a shared storage directory."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Cluster, Processes

APP = "tests.apps.files_app:app"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _upload(
    cluster: Cluster, data: bytes, name: str = "blob.bin", token: str | None = None
) -> httpx.Response:
    headers = {**_headers(token or cluster.token), "Content-Type": "application/octet-stream"}
    return httpx.post(
        f"{cluster.url}/v1/files", params={"name": name}, content=data, headers=headers, timeout=60
    )


def _get(cluster: Cluster, path: str, **headers: str) -> httpx.Response:
    return httpx.get(f"{cluster.url}{path}", headers={**_headers(cluster.token), **headers}, timeout=60)


def _until(check: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.1)


def test_an_uploaded_file_downloads_whole_and_by_range_with_its_sha256(cluster: Cluster) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    # Given one file uploaded as raw bytes and the same bytes as the file part of a multipart form
    raw = _upload(cluster, data)
    form = httpx.post(f"{cluster.url}/v1/files", files={"file": ("form.bin", data)}, data={"note": "x"},
                      headers=_headers(cluster.token), timeout=60)  # fmt: skip
    assert raw.status_code == form.status_code == 201, (raw.text, form.text)
    for body, name in ((raw.json(), "blob.bin"), (form.json(), "form.bin")):
        assert (body["size"], body["sha256"], body["name"]) == (len(data), _sha(data), name)

    # When each is read back whole, by a closed range, by an open range, and by a suffix range
    file_id = raw.json()["id"]
    whole = cluster.api("GET", f"/v1/files/{form.json()['id']}")
    assert whole.status_code == 200 and whole.content == data
    assert whole.headers["x-turnout-sha256"] == _sha(data)
    for spec, expected in ((f"bytes=10-{2**20}", data[10 : 2**20 + 1]), ("bytes=3145700-", data[3145700:]),
                           ("bytes=-100", data[-100:])):  # fmt: skip
        part = _get(cluster, f"/v1/files/{file_id}", Range=spec)
        # Then each range answers 206 with exactly those bytes and where they sit
        assert part.status_code == 206 and part.content == expected, spec
        assert part.headers["content-range"].endswith(f"/{len(data)}")

    # and a range past the end is a 416 naming Range; a malformed one a 422 naming Range; HEAD has the length
    past = _get(cluster, f"/v1/files/{file_id}", Range="bytes=99999999-")
    assert (past.status_code, past.json()["error"]["field"]) == (416, "Range")
    assert past.headers["content-range"] == f"bytes */{len(data)}"
    bad = _get(cluster, f"/v1/files/{file_id}", Range="lines=1-2")
    assert (bad.status_code, bad.json()["error"]["field"]) == (422, "Range")
    head = httpx.head(f"{cluster.url}/v1/files/{file_id}", headers=_headers(cluster.token))
    assert head.status_code == 200 and head.headers["content-length"] == str(len(data))


def test_a_deleted_file_is_gone_and_a_json_body_is_not_a_file(cluster: Cluster) -> None:
    file_id = _upload(cluster, b"hello").json()["id"]
    assert cluster.api("DELETE", f"/v1/files/{file_id}").json() == {"id": file_id, "deleted": True}
    assert cluster.api("GET", f"/v1/files/{file_id}").status_code == 404
    assert not (cluster.tmp / "home" / "files" / "objects" / file_id).exists()
    as_json = cluster.api("POST", "/v1/files", json={"data": "hello"})
    assert (as_json.status_code, as_json.json()["error"]["field"]) == (422, "body")
    assert cluster.api("GET", "/v1/files/f_nonsense").status_code == 404


def test_another_tenants_file_answers_404_and_cannot_be_put_in_a_task(cluster: Cluster) -> None:
    # Given a file of the default tenant, and a submit token of tenant acme
    file_id = _upload(cluster, b"secret").json()["id"]
    acme = cluster.api("POST", "/v1/tokens", json={"role": "submit", "tenant": "acme"}).json()["token"]
    # When acme reads, deletes, or submits a task naming it
    assert httpx.get(f"{cluster.url}/v1/files/{file_id}", headers=_headers(acme)).status_code == 404
    assert httpx.delete(f"{cluster.url}/v1/files/{file_id}", headers=_headers(acme)).status_code == 404
    task = {"capability": "digest", "input": {"file": {"$file": file_id}}, "placement_timeout_s": 5}
    submitted = httpx.post(f"{cluster.url}/v1/tasks", json=task, headers=_headers(acme))
    # Then the file is not there for acme (404s), and the submission is a 422 naming where it refers to it
    assert (submitted.status_code, submitted.json()["error"]["field"]) == (422, "input.file")
    # while acme's own file is acme's, and not the default tenant's read token's
    mine = _upload(cluster, b"acme's", token=acme).json()["id"]
    assert httpx.get(f"{cluster.url}/v1/files/{mine}", headers=_headers(acme)).content == b"acme's"
    reader = cluster.api("POST", "/v1/tokens", json={"role": "read", "tenant": "default"}).json()["token"]
    assert httpx.get(f"{cluster.url}/v1/files/{mine}", headers=_headers(reader)).status_code == 404
    assert _upload(cluster, b"x", token=reader).status_code == 403  # a read token cannot upload


def test_an_upload_past_max_file_bytes_is_refused_as_it_streams_naming_the_limit(
    tmp_path: Path, processes: Processes
) -> None:
    cluster = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}",
                      extra_args=["--request-limit", "max_file_bytes=1Mi"])  # fmt: skip
    cluster.start_controller()
    two_mib = os.urandom(2 * 1024 * 1024)

    def chunked_body() -> Any:  # chunked, no Content-Length: refused at the first chunk past the limit
        for _ in range(128):
            yield b"\0" * 65536

    declared = _upload(cluster, two_mib)
    chunked = httpx.post(f"{cluster.url}/v1/files", content=chunked_body(), timeout=60,
                         headers={**_headers(cluster.token), "Content-Type": "application/octet-stream"})  # fmt: skip
    form = httpx.post(
        f"{cluster.url}/v1/files", files={"file": ("f", two_mib)}, headers=_headers(cluster.token)
    )
    for resp in (declared, chunked, form):
        assert resp.status_code == 413, resp.text
        assert "max_file_bytes" in resp.json()["error"]["message"]
    # and nothing of them is kept, while a file within the limit still goes in
    ok = _upload(cluster, two_mib[: 1024 * 1024])
    assert ok.status_code == 201
    storage = cluster.tmp / "home" / "files"
    assert [p.name for p in (storage / "objects").iterdir()] == [ok.json()["id"]]
    assert list((storage / "tmp").iterdir()) == []


def test_a_task_reads_its_input_file_by_path_and_its_output_files_come_back_as_references(
    cluster: Cluster,
) -> None:
    # Given a worker serving the file handlers, and an uploaded file
    cluster.start_worker(APP, name="files")
    data = os.urandom(1024 * 1024 + 3)
    file_id = _upload(cluster, data).json()["id"]
    # When a task digests it, and another copies it into its output directory
    digest = cluster.result(cluster.submit("digest", {"file": {"$file": file_id}})["id"])
    copy = cluster.result(cluster.submit("copy", {"file": {"$file": file_id}, "as": "out.bin"})["id"])
    # Then the handler read the very bytes, and the copy's outputs are files of the same tenant, whole
    assert digest["state"] == "succeeded" and digest["output"] == {"sha256": _sha(data), "size": len(data)}
    assert copy["state"] == "succeeded", copy["error"]
    files = copy["output"]["files"]
    assert sorted(files) == ["notes/done.txt", "out.bin"] and copy["output"]["copied"] is True
    out = cluster.api("GET", f"/v1/files/{files['out.bin']['$file']}")
    assert out.content == data and out.headers["x-turnout-sha256"] == _sha(data)
    note = cluster.api("GET", f"/v1/files/{files['notes/done.txt']['$file']}").text
    assert note == f"copied by {copy['id']}\n"
    # and an output reference is an input as it stands: the next task digests the copy
    again = cluster.result(cluster.submit("digest", {"file": files["out.bin"]})["id"])
    assert again["output"] == {"sha256": _sha(data), "size": len(data)}


def test_a_task_whose_input_file_was_deleted_fails_naming_the_field(cluster: Cluster) -> None:
    # Given a task queued with a file, which is deleted before any worker takes the task
    file_id = _upload(cluster, b"soon gone").json()["id"]
    task = cluster.submit("digest", {"file": {"$file": file_id}}, placement_timeout_s=60)
    cluster.api("DELETE", f"/v1/files/{file_id}")
    # When a worker takes it
    cluster.start_worker(APP, name="files")
    done = cluster.result(task["id"])
    # Then it fails before its handler runs, saying which input and why
    assert done["state"] == "failed"
    assert (done["error"]["type"], done["error"]["field"]) == ("input_file_missing", "input.file")


COMMAND = """
import json, os, sys
files = json.loads(os.environ["TURNOUT_INPUT_FILES"])
data = json.loads(sys.stdin.readline())
path = data["file"]["path"]
assert files[data["file"]["$file"]] == path
with open(path, "rb") as src, open(os.path.join(os.environ["TURNOUT_OUTPUT_DIR"], "upper.txt"), "wb") as dst:
    dst.write(src.read().upper())
print(json.dumps({"event": "result", "data": {"read": path}}))
print(json.dumps({"event": "finish", "status": "completed"}))
"""


def test_a_command_worker_gets_its_input_paths_and_its_output_directory(
    cluster: Cluster, tmp_path: Path
) -> None:
    program = tmp_path / "upper.py"
    program.write_text(COMMAND)
    presets = tmp_path / "presets.yaml"
    presets.write_text(
        json.dumps({"models": {"upper": {"inference": {"command": [sys.executable, str(program)]}}}})
    )
    cluster.start_worker("--presets", str(presets), name="cmd")
    file_id = _upload(cluster, b"shout this").json()["id"]
    done = cluster.result(cluster.submit("upper", {"file": {"$file": file_id}})["id"])
    assert done["state"] == "succeeded", done["error"]
    assert done["output"]["read"].endswith(file_id)
    upper = done["output"]["files"]["upper.txt"]["$file"]
    assert cluster.api("GET", f"/v1/files/{upper}").content == b"SHOUT THIS"


def test_with_a_shared_storage_files_move_through_it_not_over_http(
    tmp_path: Path, processes: Processes
) -> None:
    # Given a controller and a worker that both mount one storage directory
    shared = tmp_path / "shared"
    cluster = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}",
                      extra_args=["--storage", str(shared)])  # fmt: skip
    cluster.start_controller()
    cluster.start_worker(APP, "--storage", str(shared), name="nfs")
    data = os.urandom(256 * 1024)
    file_id = _upload(cluster, data).json()["id"]
    # When a task digests an input and copies it out
    copy = cluster.result(cluster.submit("copy", {"file": {"$file": file_id}, "as": "out.bin"})["id"])
    # Then the worker wrote its output through the shared directory, and the controller found it there
    assert copy["state"] == "succeeded", copy["error"]
    out_id = copy["output"]["files"]["out.bin"]["$file"]
    assert (shared / "objects" / out_id).read_bytes() == data
    assert cluster.api("GET", f"/v1/files/{out_id}").headers["x-turnout-sha256"] == _sha(data)
    # and the handler read its input in place, from the shared directory (no copy was downloaded)
    where = cluster.result(cluster.submit("where", {"file": {"$file": file_id}})["id"])
    assert where["output"] == {
        "path": str(shared / "objects" / file_id),
        "output_dir_in": str(shared / "tmp"),
    }


def test_each_task_gets_an_output_directory_no_task_had_and_a_stopped_worker_leaves_none(
    tmp_path: Path, processes: Processes
) -> None:
    # Given a worker on a shared storage, whose tasks report their output directory
    shared = tmp_path / "shared"
    cluster = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}",
                      extra_args=["--storage", str(shared)])  # fmt: skip
    cluster.start_controller()
    worker = cluster.start_worker(APP, "--storage", str(shared), name="dirs")
    # When eight tasks run one after another, every other one leaving a file behind
    seen = []
    for i in range(8):
        task = cluster.result(cluster.submit("outdir", {"leave": i % 2 == 0})["id"])
        assert task["state"] == "succeeded", task["error"]
        seen.append(task["output"])
    # Then each had an empty directory of its own, in the storage's tmp/, that no other task was given
    assert all(out["was_empty"] for out in seen)
    dirs = [Path(out["output_dir"]) for out in seen]
    assert len(set(dirs)) == 8 and all(d.parent == shared / "tmp" for d in dirs)
    # and what the left files became are the tasks' outputs, not the next task's
    assert all(("files" in out) == (i % 2 == 0) for i, out in enumerate(seen))
    # When the worker stops, Then neither its tasks' directories nor those it made ahead are left
    os.killpg(worker.pid, signal.SIGTERM)
    worker.wait(timeout=30)
    assert list((shared / "tmp").iterdir()) == []


def test_files_expire_after_the_retention_the_config_sets(tmp_path: Path, processes: Processes) -> None:
    config = tmp_path / "turnout.yaml"
    config.write_text("file_retention_s: 3\n")  # room for a loaded host between the upload and the first read
    cluster = Cluster(
        tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}", extra_args=["--config", str(config)]
    )
    cluster.start_controller()
    file_id = _upload(cluster, b"brief").json()["id"]
    assert cluster.api("GET", f"/v1/files/{file_id}").status_code == 200  # there until its time is up
    _until(lambda: cluster.api("GET", f"/v1/files/{file_id}").status_code == 404)
    _until(lambda: not (tmp_path / "home" / "files" / "objects" / file_id).exists())


def test_the_cli_puts_gets_and_submits_files(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_worker(APP, name="files")
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(100_000))
    put = cluster.cli("file", "put", str(src))
    assert put.returncode == 0, put.stderr
    record = json.loads(put.stdout)
    got = cluster.cli("file", "get", record["id"], "-o", str(tmp_path / "back.bin"))
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes() and record["sha256"] in got.stderr
    run = cluster.cli("submit", "digest", "--file", f"file={src}", "--wait", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["output"] == {"sha256": _sha(src.read_bytes()), "size": 100_000}
    missing = cluster.cli("submit", "digest", "--file", f"file={tmp_path / 'nope'}")
    assert missing.returncode == 2 and "--file" in missing.stderr and "Traceback" not in missing.stderr


def test_the_direct_download_and_the_httpx_download_give_the_same_checked_bytes(
    cluster: Cluster, tmp_path: Path
) -> None:
    import asyncio

    from turnout.client import AsyncClient
    from turnout.files import download

    data = os.urandom(2 * 1024 * 1024 + 5)
    file_id = _upload(cluster, data).json()["id"]

    async def both() -> list[dict[str, Any]]:
        async with AsyncClient(cluster.url, cluster.token) as sdk:  # its own connection, a megabyte per read
            direct = await sdk.download(file_id, tmp_path / "direct.bin")
        async with httpx.AsyncClient(
            base_url=cluster.url, headers=_headers(cluster.token)
        ) as plain:  # httpx's stream
            streamed = await download(plain, file_id, tmp_path / "httpx.bin")
        return [direct, streamed]

    for got in asyncio.run(both()):
        assert (got["size"], got["sha256"]) == (len(data), _sha(data))
        assert Path(got["path"]).read_bytes() == data


def test_a_worker_reads_only_files_its_running_task_names_and_writes_only_for_a_live_attempt(
    cluster: Cluster,
) -> None:
    worker = cluster.api("POST", "/v1/tokens", json={"role": "worker", "tenant": "default"}).json()["token"]
    named = _upload(cluster, b"named").json()["id"]
    other = _upload(cluster, b"other").json()["id"]
    # Given a task (leased by a worker registered with that token) whose input names one of two files
    body = {"name": "hand", "host": "h", "cpu": 1, "memory": 2**30,
            "variants": [{"capability": "digest", "device": "cpu", "resources": {"cpu": 0.1}}]}  # fmt: skip
    reg = httpx.post(f"{cluster.url}/v1/workers/register", json=body, headers=_headers(worker)).json()
    worker_id, me = reg["id"], {**_headers(worker), "X-Worker-Secret": reg["secret"]}
    task = cluster.submit("digest", {"file": {"$file": named}})
    leased = httpx.post(f"{cluster.url}/v1/workers/{worker_id}/lease", json={"max_tasks": 1, "wait_s": 5},
                        headers=me, timeout=30).json()  # fmt: skip
    assert [t["id"] for t in leased["tasks"]] == [task["id"]]

    def get(file_id: str, headers: dict[str, str] = me, **params: str) -> httpx.Response:
        return httpx.get(
            f"{cluster.url}/v1/workers/{worker_id}/files/{file_id}", params=params, headers=headers
        )

    # Then it reads the file its task names, for that task only, on its own route with its secret
    assert get(named, task=task["id"]).content == b"named"
    assert get(other, task=task["id"]).status_code == 404
    assert get(named, task="t_0123456789abcdef01234567").status_code == 404
    missing_task = get(named)
    assert missing_task.status_code == 422
    assert get(named, _headers(worker), task=task["id"]).status_code == 403  # no secret: not this worker
    assert httpx.get(f"{cluster.url}/v1/files/{named}", headers=_headers(worker)).status_code == 403

    # and it writes an output for the attempt it runs, not for another
    def put(headers: dict[str, str] = me, **params: object) -> httpx.Response:
        return httpx.post(f"{cluster.url}/v1/workers/{worker_id}/files", params=params, content=b"out",
                          headers={**headers, "Content-Type": "application/octet-stream"})  # fmt: skip

    out = put(task=task["id"], attempt=1)
    assert out.status_code == 201
    assert cluster.api("GET", f"/v1/files/{out.json()['id']}").content == b"out"  # the task's tenant's
    assert put(task=task["id"], attempt=2).status_code == 409
    assert put().status_code == 422
    assert put(_headers(worker), task=task["id"], attempt=1).status_code == 403


def test_the_cli_deletes_a_file(cluster: Cluster, tmp_path: Path) -> None:
    src = tmp_path / "gone.txt"
    src.write_text("soon")
    file_id = json.loads(cluster.cli("file", "put", str(src)).stdout)["id"]
    deleted = cluster.cli("file", "delete", file_id)
    assert deleted.returncode == 0 and file_id in deleted.stdout
    assert cluster.api("GET", f"/v1/files/{file_id}").status_code == 404
    again = cluster.cli("file", "get", file_id, "-o", str(tmp_path / "x"))
    assert again.returncode == 2 and "not found" in again.stderr and "Traceback" not in again.stderr
