"""The API's shape: one operation id per operation in the OpenAPI document, made without a warning, and
routes that reach state only through the controller (api/service.py, the database thread, is the one
module of the API that holds the store)."""

from __future__ import annotations

import re
import warnings
from collections import Counter
from pathlib import Path

from tests.inprocess.conftest import Served
from turnout.api.app import create_app
from turnout.runtime import build_controller

API_DIR = Path(__file__).resolve().parents[2] / "src" / "turnout" / "api"
HTTP_METHODS = {"get", "put", "post", "delete", "head", "patch", "options"}


def test_every_operation_has_an_operation_id_of_its_own(served: Served) -> None:
    doc = served.call("GET", "/openapi.json").json()
    ids = [op["operationId"] for item in doc["paths"].values() for m, op in item.items() if m in HTTP_METHODS]
    assert [i for i, n in Counter(ids).items() if n > 1] == []
    heads = {path for path, item in doc["paths"].items() if "head" in item}
    assert heads == {"/v1/files/{file_id}", "/v1/workers/{worker_id}/files/{file_id}"}


def test_the_openapi_document_is_made_without_warnings(tmp_path: Path) -> None:
    parts = build_controller(db="memory://", home=tmp_path / "home")
    app = create_app(parts.service)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate operation id
        app.openapi()


def test_no_route_module_reaches_into_the_store() -> None:
    offenders = []
    for module in sorted(API_DIR.glob("*.py")):
        if module.name == "service.py":
            continue
        for n, line in enumerate(module.read_text().splitlines(), 1):
            if re.search(r"\.store\b", line) and not line.lstrip().startswith(("from ", "import ")):
                offenders.append(f"{module.name}:{n}: {line.strip()}")
    assert offenders == []
