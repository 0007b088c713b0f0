"""The hostile-input sweep's cases: bodies, headers, callback URLs, uploads, batch lines.

Each is something a client can send that is not a request the service should run: the
sweep (`test_hostile_sweep.py`) checks that every one is answered below 500, leaves no
traceback, and stores nothing.
"""

from __future__ import annotations

import json
from typing import Any

from tests.unit.api.conftest import MODEL
from tests.unit.api.hostile_cases import (
    CHAT_ONLY_STRICT_CASES,
    CHAT_TEXT_CASES,
    JOB_TEXT_CASES,
    PROMPT_TEXT_CASES,
    STRICT_CASES,
    encode,
)
from tests.unit.callbacks.test_ssrf_forms import HOSTS

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4}
TEXT: dict[str, Any] = {"model": MODEL, "prompt": "Once", "max_tokens": 4}


def _deep(depth: int, opener: str, closer: str) -> str:
    return opener * depth + closer * depth


def _nested_bodies() -> list[bytes]:
    """Bodies nested past the bound: in the body's root, in a field, in every encoding."""
    bodies = []
    for depth in (65, 200, 1_000, 5_000, 100_000):
        for opener, closer in (("[", "]"), ('{"a":', "}"), ('[{"a":', "}]")):
            deep = _deep(depth, opener, closer)
            bodies.append(deep.encode())
            bodies.append(f'{{"model": "{MODEL}", "metadata": {deep}}}'.encode())
    unclosed = '{"model": "m", "messages": ' + "[" * 50_000
    bodies += [unclosed.encode(), unclosed.encode("utf-16"),
               ('{"a": ' + _deep(2_000, "[", "]") + "}").encode("utf-32"),
               ('{"a": ' + _deep(2_000, "[", "]") + "}").encode("utf-16-be")]
    return bodies


def _malformed_bodies() -> list[bytes]:
    """Not JSON, not an object, or JSON at the edges of what parsers take."""
    return [
        b"", b" ", b"null", b"true", b"0", b'"text"', b"[]", b"[1, 2]", b"{", b"}",
        b'{"model": ', b'{"model": "m",}', b"{'model': 'm'}", b'{"model": NaN}',
        b'{"max_tokens": 1e999999}', b'{"max_tokens": -1e999999}',
        b'{"max_tokens": ' + b"9" * 5_000 + b"}", b'{"a": "\\ud800"}', b'{"a": "\\u0000"}',
        b'{"a": "\x00"}', b'{"a": "\x1f"}', b"\xff\xfe\xfd", b"\xef\xbb\xbf{}",
        b'{"a": "\xc3"}', b'{"a": 1}' * 3, b'{"model": "m"} trailing',
        b'{"' + b"k" * 200_000 + b'": 1}', b'{"model": "' + b"m" * 300_000 + b'"}',
        b"{" + b",".join(b'"k%d": %d' % (i, i) for i in range(20_000)) + b"}",
        b'{"model": "m", "model": 5}', b"\x00" * 64, b"[" + b"0," * 300_000 + b"0]",
    ]


def _field_bodies(base: dict[str, Any], cases: list[tuple[dict[str, Any], str]]
                  ) -> list[bytes]:
    return [encode(base | patch) for patch, _ in cases]


def _chat_field_bodies() -> list[bytes]:
    """Valid JSON objects with one field wrong, and then some."""
    bodies = _field_bodies(CHAT, CHAT_TEXT_CASES + STRICT_CASES + CHAT_ONLY_STRICT_CASES)
    extra: list[dict[str, Any]] = [
        {"messages": []}, {"messages": None}, {"messages": "hi"}, {"messages": [None]},
        {"messages": [[]]}, {"messages": [{"role": "user"}]}, {"model": ""},
        {"model": None}, {"model": ["m"]}, {"model": "m" * 10_000}, {"model": "no-such"},
        {"n": 129}, {"stream": True, "stream_options": "x"}, {"stop": ["a"] * 1000},
        {"logit_bias": {str(i): 1 for i in range(5_000)}},
        {"temperature": -1}, {"top_p": 2}, {"seed": 2**70}, {"priority": "urgent"},
        {"priority": None}, {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
        {"tools": [{"type": "function"}]}, {"cache_key": "k" * 10_000},
        {"metadata": {f"k{i}": "v" for i in range(100)}}, {"metadata": {"k": "v" * 10_000}},
        {"metadata": {"k" * 1000: "v"}}, {"metadata": []}, {"metadata": {"k": 1}},
        {"user": "u" * 100_000}, {"callback_url": "javascript:alert(1)"},
        {"callback_url": "http://" + "a" * 3_000 + ".com/"}, {"callback_url": 5},
        {"callback_url": "http://user:pw@example.com/"}, {"callback_url": "http://[::1"},
        {"callback_url": "http://exa mple.com/"}, {"callback_url": "http://ex\x00.com/"},
        {"callback_url": "https://example.com:99999/"}, {"callback_url": "//example.com/"},
    ]
    return bodies + [encode(CHAT | patch) for patch in extra]


def _callback_bodies() -> list[bytes]:
    """Every private spelling of `test_ssrf_forms`, as a job's callback URL."""
    return [encode(CHAT | {"callback_url": f"http://{host}/hook"}) for host in HOSTS]


def job_bodies() -> list[bytes]:
    """For POST /v1/jobs."""
    return (_nested_bodies() + _malformed_bodies() + _chat_field_bodies()
            + _field_bodies(CHAT, JOB_TEXT_CASES) + _field_bodies(TEXT, PROMPT_TEXT_CASES)
            + _callback_bodies())


def endpoint_bodies() -> list[tuple[str, bytes]]:
    """For the other JSON routes: (path, body)."""
    cases = [(path, body) for path in ("/v1/chat/completions", "/v1/completions",
                                       "/v1/embeddings", "/v1/batches")
             for body in _nested_bodies()[:9] + _malformed_bodies()[:30]]
    cases += [("/v1/completions", body) for body in _field_bodies(TEXT, PROMPT_TEXT_CASES)]
    cases += [("/v1/batches", encode(body)) for body in (
        {"input_file_id": "file-" + "x" * 100, "endpoint": "/v1/chat/completions",
         "completion_window": "24h"},
        {"input_file_id": "../../etc/passwd", "endpoint": "/v1/chat/completions",
         "completion_window": "24h"},
        {"input_file_id": "file-none", "endpoint": "/v1/evil", "completion_window": "24h"},
        {"input_file_id": "file-none", "endpoint": "/v1/chat/completions",
         "completion_window": "9999999999999999999h"},
        {"input_file_id": "file-none", "endpoint": "/v1/chat/completions",
         "completion_window": "24h", "metadata": {"k": "\ud800"}},
    )]
    return cases


def header_cases() -> list[dict[str, str] | list[tuple[bytes, bytes]]]:
    """Headers for POST /v1/jobs with a valid body (a key is added where none is given)."""
    return [
        {"Content-Type": "text/plain"}, {"Content-Type": "application/json; charset=utf-16"},
        {"Content-Type": "multipart/form-data"}, {"Content-Type": "application/x-www-form-"
                                                  "urlencoded"},
        {"Content-Type": "\x7f"}, {"Content-Type": "application/json" + ";" * 1000},
        {"Idempotency-Key": ""}, {"Idempotency-Key": "k" * 201},
        {"Idempotency-Key": "k" * 8_000}, {"Idempotency-Key": "a\x01b"},
        {"Authorization": "Bearer"}, {"Authorization": "Bearer "},
        {"Authorization": "Basic YTpi"}, {"Authorization": "Bearer " + "b" * 8_000},
        {"Authorization": "Bearer bi_" + "\x7f" * 40}, {"Authorization": "bearer"},
        {"Authorization": "Bearer bi_not-a-key"},
        [(b"authorization", b"Bearer bi_\xff\xfe"), (b"content-type", b"application/json")],
        [(b"content-type", b"application/json\xff")],
        [(b"idempotency-key", b"\xff" * 10), (b"content-type", b"application/json")],
    ]


def upload_forms() -> list[tuple[bytes, bytes]]:
    """(Content-Type, body) for POST /v1/files that must be refused."""
    boundary = b"bnd"
    ok_type = b"multipart/form-data; boundary=bnd"

    def part(disposition: bytes, content: bytes) -> bytes:
        return (b"--bnd\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + content
                + b"\r\n")

    purpose = part(b'form-data; name="purpose"', b"batch")
    line = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
                       "body": CHAT}).encode()
    names = [b"fi\xffle", b"", b"\x00", b"a" * 300, b"f\x1b[31m"]
    filenames = [b"\xff.jsonl", b"a\x01b.jsonl", b"a\x7f", b"a" * 300, b"\xc3",
                 b"a\r\nb", b"\xed\xa0\x80.jsonl"]
    forms = [(ok_type, purpose + part(b'form-data; name="' + n + b'"; filename="in.jsonl"',
                                      line) + b"--bnd--\r\n") for n in names]
    forms += [(ok_type, purpose + part(b'form-data; name="file"; filename="' + f + b'"', line)
               + b"--bnd--\r\n") for f in filenames]
    forms += [
        (b"multipart/form-data", purpose),
        (b"multipart/form-data; boundary=", purpose),
        (ok_type, b""), (ok_type, b"--bnd\r\n"), (ok_type, purpose),
        (ok_type, purpose + b"--bnd--\r\n"),
        (ok_type, part(b'form-data; name="purpose"', b"fine-tune")
         + part(b'form-data; name="file"; filename="a"', line) + b"--bnd--\r\n"),
        (ok_type, part(b'form-data; name="purpose"', b"\xff")
         + part(b'form-data; name="file"; filename="a"', line) + b"--bnd--\r\n"),
        (ok_type, purpose + part(b'form-data; name="file"; filename="a"', line)
         + part(b'form-data; name="file"; filename="b"', line) + b"--bnd--\r\n"),
        (ok_type, purpose + b"".join(part(b'form-data; name="f%d"' % i, b"v")
                                     for i in range(40)) + b"--bnd--\r\n"),
        (ok_type, purpose + part(b'form-data; name="x"', b"v" * 10_000) + b"--bnd--\r\n"),
        (ok_type, b"--bnd\r\nX-Pad: " + b"p" * 50_000 + b"\r\n\r\nx\r\n--bnd--\r\n"),
        (b"application/json", line),
    ]
    assert boundary
    return forms


def batch_lines() -> list[bytes]:
    """Lines of a batch input file that validation must name, one by one."""
    def line(body: Any, **fields: Any) -> bytes:
        item = {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
                "body": body} | fields
        return json.dumps(item, ensure_ascii=True).encode()

    lines = [b"[" * 100_000 + b"]" * 100_000, b'{"custom_id": ' + b"[" * 5_000,
             line({"model": MODEL, "messages": [], "metadata": json.loads(
                 _deep(100, "[", "]"))}),
             b"not json", b"null", b"[]", b'"s"', b"\xff\xfe", b"{}", line(None),
             line(CHAT, custom_id=""), line(CHAT, custom_id=5), line(CHAT, method="GET"),
             line(CHAT, url="/v1/embeddings"), line(CHAT | {"stream": True}),
             line(CHAT, custom_id="\ud800"), line({"model": MODEL})]
    lines += [line(CHAT | patch) for patch, _ in CHAT_TEXT_CASES + STRICT_CASES
              + CHAT_ONLY_STRICT_CASES]
    return lines
