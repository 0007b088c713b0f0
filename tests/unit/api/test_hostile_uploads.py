"""Hostile uploads: names and filenames checked at upload, a full disk answered 507 with
nothing left behind, and every download answerable whatever its stored name."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

import storage.files
from storage.files import FileStore, FileWriter, create_file
from tests.unit.api.test_requests_refused import assert_error_shape
from tests.utils.api import TenantKey

BOUNDARY = b"b0undary"
LINE = b'{"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def multipart(*, name: bytes = b"file", filename: bytes | None = b"in.jsonl",
              content: bytes = LINE, purpose: bytes = b"batch") -> bytes:
    """A form with `purpose` and one file part, its Content-Disposition as given."""
    disposition = b'form-data; name="' + name + b'"'
    if filename is not None:
        disposition += b'; filename="' + filename + b'"'
    return (b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
            + purpose + b"\r\n--" + BOUNDARY + b"\r\nContent-Disposition: " + disposition
            + b"\r\nContent-Type: application/octet-stream\r\n\r\n" + content
            + b"\r\n--" + BOUNDARY + b"--\r\n")


def post_form(client: TestClient, tenant: TenantKey, body: bytes) -> Any:
    return client.post("/v1/files", content=body, headers=tenant.headers | {
        "Content-Type": "multipart/form-data; boundary=" + BOUNDARY.decode()})


def store_root(client: TestClient) -> Path:
    app: Any = client.app
    return FileStore.from_settings(app.state.resources.settings).root


def assert_nothing_stored(client: TestClient, tenant: TenantKey) -> None:
    assert client.get("/v1/files", headers=tenant.headers).json()["data"] == []
    assert sorted(p.name for p in store_root(client).iterdir()) == []


# (Content-Disposition name, filename): each must be a 400 naming what is wrong.
BAD_NAMES = [
    (b"fi\xffle", b"in.jsonl"),
    (b"file", b"in\xff.jsonl"),
    (b"file", b"in\xc3.jsonl"),
    (b"file", b"a\x01b.jsonl"),
    (b"file", b"a\x7fb.jsonl"),
    (b"file", "a\u0085b.jsonl".encode()),
    (b"file", b"a\tb.jsonl"),
    (b"file", b"x" * 256),
    (b"f\x02", b"in.jsonl"),
]


@pytest.mark.parametrize(("name", "filename"), BAD_NAMES)
def test_bad_part_names_and_filenames_are_400(
    client: TestClient, acme: TenantKey, name: bytes, filename: bytes,
) -> None:
    response = post_form(client, acme, multipart(name=name, filename=filename))
    assert response.status_code == 400, response.text
    error = assert_error_shape(response.json())
    assert error["code"] == "invalid_upload"
    assert_nothing_stored(client, acme)


def test_part_headers_are_bounded(client: TestClient, acme: TenantKey) -> None:
    body = multipart().replace(b"Content-Type: application/octet-stream",
                               b"X-Pad: " + b"p" * 100_000)
    response = post_form(client, acme, body)
    assert response.status_code == 400, response.text
    assert_nothing_stored(client, acme)


def test_a_non_ascii_name_is_kept_and_downloaded_per_rfc_6266(
    client: TestClient, acme: TenantKey,
) -> None:
    name = "r\u00e9sum\u00e9 \"1\".jsonl"
    response = post_form(client, acme, multipart(filename=name.replace('"', "%22").encode()))
    assert response.status_code == 200, response.text
    file = response.json()
    download = client.get(f"/v1/files/{file['id']}/content", headers=acme.headers)
    assert download.status_code == 200
    assert download.content == LINE
    disposition = download.headers["content-disposition"]
    assert disposition.startswith('attachment; filename="')
    assert "filename*=UTF-8''r%C3%A9sum%C3%A9" in disposition


@pytest.mark.parametrize("stored", ["a\x01b.jsonl", "a\r\nX-Evil: 1.jsonl", "\u65e5\u672c.jsonl"])
def test_a_download_answers_whatever_name_a_row_holds(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session], stored: str,
) -> None:
    """Rows written before names were checked: the download still answers, header safe."""
    store = FileStore(store_root(client))
    with store.writer("file-old") as writer:
        writer.write(LINE)
        num_bytes = writer.commit()
    with sessions() as session:
        create_file(session, file_id="file-old", tenant_id=acme.tenant_id, filename=stored,
                    purpose="batch", num_bytes=num_bytes)
        session.commit()
    download = client.get("/v1/files/file-old/content", headers=acme.headers)
    assert download.status_code == 200
    assert download.content == LINE
    assert all(" " <= c <= "~" for c in download.headers["content-disposition"])
    assert "x-evil" not in download.headers


@pytest.mark.parametrize(("code", "status"), [(errno.ENOSPC, 507), (errno.EDQUOT, 507),
                                              (errno.EIO, 503)])
def test_a_store_failure_while_writing_is_507_or_503_and_leaves_nothing(
    client: TestClient, acme: TenantKey, monkeypatch: pytest.MonkeyPatch, code: int,
    status: int,
) -> None:
    def full(self: FileWriter, data: bytes) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(FileWriter, "write", full)
    response = post_form(client, acme, multipart())
    assert response.status_code == status, response.text
    error = assert_error_shape(response.json())
    assert error["code"] == ("insufficient_storage" if status == 507
                             else "service_unavailable")
    assert str(store_root(client)) not in error["message"]
    assert_nothing_stored(client, acme)


def test_a_full_disk_at_the_fsync_leaves_no_part_file(
    client: TestClient, acme: TenantKey, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tail of the file meets the full disk when it is flushed, after every write
    went through."""
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.files.os, "fsync", full)
    response = post_form(client, acme, multipart())
    assert response.status_code == 507, response.text
    assert_nothing_stored(client, acme)


def test_a_writer_whose_close_fails_still_removes_its_part_file(tmp_path: Path) -> None:
    class FullDisk:
        def write(self, data: bytes) -> int:
            return len(data)

        def close(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    store = FileStore(tmp_path)
    writer = store.writer("file-x")
    writer.write(b"data")
    real = writer._handle
    assert real is not None
    real.close()
    writer._handle = FullDisk()  # type: ignore[assignment]
    writer.abort()
    assert list(tmp_path.iterdir()) == []
