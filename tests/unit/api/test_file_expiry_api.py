"""`expires_after` on uploads and `output_expires_after` on batches: validation and effect."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from openai.types import FileObject
from sqlalchemy.orm import Session, sessionmaker

from storage.batches import get_batch
from storage.files import File
from storage.models import utcnow
from tests.unit.api.test_files_batches_api import CONTENT, create
from tests.utils.api import TenantKey


def upload(client: TestClient, tenant: TenantKey, **fields: str) -> Any:
    """POST /v1/files with extra form fields, named as the openai client flattens them."""
    return client.post("/v1/files", headers=tenant.headers, data={"purpose": "batch", **fields},
                       files={"file": ("in.jsonl", CONTENT, "application/jsonl")})


def test_upload_with_expires_after_sets_expires_at(client: TestClient, acme: TenantKey) -> None:
    response = upload(client, acme, **{"expires_after[anchor]": "created_at",
                                       "expires_after[seconds]": "3600"})
    assert response.status_code == 200, response.text
    file = FileObject.model_validate(response.json())
    assert file.expires_at == file.created_at + 3600
    got = client.get(f"/v1/files/{file.id}", headers=acme.headers).json()
    assert got["expires_at"] == file.expires_at


def test_expires_after_as_one_json_field_sets_expires_at(client: TestClient,
                                                          acme: TenantKey) -> None:
    """As a hand-written curl sends it: ignored, the file would have lived for good."""
    response = upload(client, acme,
                      expires_after='{"anchor": "created_at", "seconds": 7200}')
    assert response.status_code == 200, response.text
    file = FileObject.model_validate(response.json())
    assert file.expires_at == file.created_at + 7200


@pytest.mark.parametrize(("fields", "param"), [
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"},
     "expires_after.seconds"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
     "expires_after.seconds"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"},
     "expires_after.seconds"),
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
     "expires_after.anchor"),
    ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
    ({"expires_after": '{"anchor": "created_at", "seconds": 10}'}, "expires_after.seconds"),
    ({"expires_after": "3600"}, "expires_after"),
    ({"expires_after": "in an hour"}, "expires_after"),
    ({"expires_after": "{}"}, "expires_after.anchor"),
    ({"expires_after": "null"}, "expires_after"),
    ({"expires_after": "[]"}, "expires_after"),
    ({"expires_after": "false"}, "expires_after"),
    ({"expires_after": '{"anchor": "created_at", "seconds": 3600}',
      "expires_after[seconds]": "3600"}, "expires_after"),
])
def test_bad_expires_after_is_refused_naming_the_field(
        client: TestClient, acme: TenantKey, fields: dict[str, str], param: str) -> None:
    response = upload(client, acme, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert client.get("/v1/files", headers=acme.headers).json()["data"] == []


def test_expired_file_is_not_found_anywhere(client: TestClient, acme: TenantKey,
                                            sessions: sessionmaker[Session]) -> None:
    file_id = upload(client, acme).json()["id"]
    with sessions() as session:
        session.execute(sa.update(File).where(File.id == file_id)
                        .values(expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
        assert client.get(path, headers=acme.headers).status_code == 404
    assert client.delete(f"/v1/files/{file_id}", headers=acme.headers).status_code == 404
    assert client.get("/v1/files", headers=acme.headers).json()["data"] == []
    refused = create(client, acme, file_id)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "input_file_id"


def test_batch_stores_output_expires_after(client: TestClient, acme: TenantKey,
                                           sessions: sessionmaker[Session]) -> None:
    file_id = upload(client, acme).json()["id"]
    response = create(client, acme, file_id,
                      output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert response.status_code == 200, response.text
    with sessions() as session:
        batch = get_batch(session, batch_id=response.json()["id"])
        assert batch is not None and batch.output_expires_after_s == 7200
    for bad, param in (({"anchor": "created_at", "seconds": 60},
                        "output_expires_after.seconds"),
                       ({"anchor": "now", "seconds": 7200}, "output_expires_after.anchor"),
                       ({"seconds": 7200}, "output_expires_after.anchor")):
        refused = create(client, acme, file_id, output_expires_after=bad)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
