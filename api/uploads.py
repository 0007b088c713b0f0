"""Streaming `multipart/form-data` uploads: the file part goes straight to the file store.

Responsible for: parsing the request body as it arrives (python-multipart's push parser),
writing the `file` part's bytes into a FileWriter chunk by chunk — never buffering the
file, never spooling it to a temporary copy first — collecting the small text fields
(`purpose`, ...) with a size cap, refusing part names and filenames that are not UTF-8,
are too long or hold control characters (and part headers past a size cap), and
enforcing the file size limit while the bytes flow, so an oversized upload is refused as
soon as it passes the limit.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from storage.files import FileWriter

# Text fields are a few bytes (`purpose=batch`); anything bigger is a malformed request.
MAX_FIELD_BYTES = 4096
MAX_FIELDS = 16
# A part's headers (Content-Disposition with its name and filename, Content-Type) are a
# few hundred bytes; the upload's body limit is the file's, hundreds of MB.
MAX_PART_HEADER_BYTES = 16 * 1024
# Longest part name and filename, in characters (the files table keeps 255).
MAX_NAME_CHARS = 255
DEFAULT_FILENAME = "upload.jsonl"
# C0 controls, DEL and C1 controls: a filename is echoed in a download's header, where
# they are invalid (the connection was dropped on every download of `a\x01b.jsonl`).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class UploadError(ValueError):
    """The body is not the multipart form this endpoint expects."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class UploadedForm:
    """What the form held besides the file's bytes (already in the writer)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None


class _FormReader:
    """python-multipart callbacks: route each part to the writer or a field buffer."""

    def __init__(self, writer: FileWriter, *, file_field: str) -> None:
        self.writer = writer
        self.file_field = file_field
        self.form = UploadedForm()
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._num_header_bytes = 0
        self._field_name: str | None = None
        self._field_value = bytearray()
        self._is_file = False

    def callbacks(self) -> dict[str, object]:
        """The callback table MultipartParser expects."""
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": lambda data, start, end: self._add_header_bytes(
                self._header_name, data[start:end]),
            "on_header_value": lambda data, start, end: self._add_header_bytes(
                self._header_value, data[start:end]),
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
        }

    def _add_header_bytes(self, buffer: bytearray, data: bytes) -> None:
        """Keep part header bytes, bounded per part."""
        buffer.extend(data)
        self._num_header_bytes += len(data)
        if self._num_header_bytes > MAX_PART_HEADER_BYTES:
            raise UploadError(f"a form part's headers are longer than {MAX_PART_HEADER_BYTES} "
                              "bytes")

    def on_part_begin(self) -> None:
        """Reset per-part state."""
        self._headers = {}
        self._num_header_bytes = 0
        self._field_name, self._is_file = None, False
        self._field_value.clear()

    def on_header_end(self) -> None:
        """Keep one finished header line."""
        self._headers[self._header_name.decode("latin-1").lower()] = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def on_headers_finished(self) -> None:
        """Decide from Content-Disposition whether this part is the file or a field."""
        _, params = parse_options_header(self._headers.get("content-disposition", b""))
        name = form_text(params.get(b"name", b""), "a form part's name")
        if not name:
            raise UploadError("a form part has no name in its Content-Disposition header")
        self._field_name = name
        if name == self.file_field:
            if self.form.filename is not None:
                raise UploadError(f"send exactly one '{self.file_field}' part",
                                  param=self.file_field)
            self._is_file = True
            filename = form_text(params.get(b"filename", b""), "the filename", param=name)
            self.form.filename = filename or DEFAULT_FILENAME
        elif len(self.form.fields) >= MAX_FIELDS:
            raise UploadError(f"the form has more than {MAX_FIELDS} fields")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        """Stream file bytes to the writer; buffer (bounded) field bytes."""
        if self._is_file:
            self.writer.write(data[start:end])
            return
        self._field_value.extend(data[start:end])
        if len(self._field_value) > MAX_FIELD_BYTES:
            raise UploadError(f"form field '{self._field_name}' is longer than "
                              f"{MAX_FIELD_BYTES} bytes", param=self._field_name)

    def on_part_end(self) -> None:
        """Store a finished text field."""
        if not self._is_file and self._field_name is not None:
            try:
                self.form.fields[self._field_name] = self._field_value.decode()
            except UnicodeDecodeError as e:
                raise UploadError(f"form field '{self._field_name}' is not UTF-8",
                                  param=self._field_name) from e


def form_text(raw: bytes, what: str, *, param: str | None = None) -> str:
    """A part name or filename as text; UploadError unless it is UTF-8 of at most
    MAX_NAME_CHARS characters without control characters."""
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise UploadError(f"{what} is not valid UTF-8", param=param) from e
    if len(text) > MAX_NAME_CHARS:
        raise UploadError(f"{what} is longer than {MAX_NAME_CHARS} characters", param=param)
    if _CONTROL.search(text):
        raise UploadError(f"{what} holds a control character", param=param)
    return text


async def read_multipart(
    content_type: str | None, stream: AsyncIterator[bytes], writer: FileWriter, *,
    file_field: str = "file",
) -> UploadedForm:
    """Parse a multipart body from `stream`, writing the `file_field` part into `writer`.

    Raises UploadError for a body that is not a well-formed form with that part, and lets
    FileTooLarge from the writer through. The caller commits or aborts the writer.
    """
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise UploadError("send the file as multipart/form-data (with a boundary)")
    reader = _FormReader(writer, file_field=file_field)
    try:
        parser = MultipartParser(boundary, reader.callbacks())  # type: ignore[arg-type]
        async for chunk in stream:
            parser.write(chunk)
        parser.finalize()
    except MultipartParseError as e:
        raise UploadError(f"the multipart body is malformed: {e}") from e
    if parser.state != MultipartState.END:
        raise UploadError("the multipart body ended before its closing boundary")
    if reader.form.filename is None:
        raise UploadError(f"the form has no '{file_field}' part", param=file_field)
    return reader.form
