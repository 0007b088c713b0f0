"""The batch CLI's pure parts: argument parsing, endpoint detection, rate and ETA, the
pace of its looks at a running batch."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import pytest

from cli.batch import RateMeter, add_batch_parser, cmd_run, next_look
from cli.batch_client import DEFAULT_ENDPOINT, BatchClient, endpoint_of


def parse(*argv: str) -> argparse.Namespace:
    """Parse `batch ...` arguments as `batchinfer` would."""
    parser = argparse.ArgumentParser(prog="batchinfer")
    add_batch_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["batch", *argv])


def test_run_takes_a_file_or_a_batch_id() -> None:
    args = parse("run", "in.jsonl", "-o", "out.jsonl", "--priority", "normal", "--model", "m",
                 "--url", "http://h:1", "--api-key", "k")
    assert args.func.__doc__ == cmd_run.__doc__
    assert (args.input, args.output, args.priority, args.model, args.url, args.api_key) == (
        Path("in.jsonl"), Path("out.jsonl"), "normal", "m", "http://h:1", "k")
    args = parse("run", "-o", "out.jsonl", "--batch-id", "batch_1")
    assert args.input is None and args.batch_id == "batch_1"


def test_list_get_cancel_parse() -> None:
    assert parse("list", "--limit", "5").limit == 5
    assert parse("get", "batch_1").batch_id == "batch_1"
    assert parse("cancel", "batch_1", "--url", "http://x").url == "http://x"


def test_unreachable_service_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("get", "batch_1", "--url", "http://127.0.0.1:9", "--api-key", "k")
    assert args.func(args) == 1
    assert capsys.readouterr().err.startswith("batchinfer batch get: ")


def test_endpoint_comes_from_the_first_request(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('\n{"custom_id": "a", "url": "/v1/completions"}\n')
    assert endpoint_of(path) == "/v1/completions"
    path.write_text("not json\n")
    assert endpoint_of(path) == DEFAULT_ENDPOINT


def test_rate_and_eta_from_observations() -> None:
    meter = RateMeter()
    meter.observe(100, at=10.0)
    assert meter.describe(remaining=50) == ""
    meter.observe(150, at=20.0)
    assert meter.per_s == 5.0
    assert meter.describe(remaining=3600 * 5) == "5.0 req/s · ETA 1:00:00"


def test_the_services_estimate_outranks_the_local_rate() -> None:
    """The service knows the work queued ahead; a batch still waiting its turn has no
    local rate at all."""
    meter = RateMeter()
    assert meter.describe(remaining=10, estimated_completion_at=1000.0 + 125, now=1000.0) == (
        "ETA 0:02:05"
    )
    meter.observe(0, at=0.0)
    meter.observe(50, at=10.0)
    assert meter.describe(remaining=50, estimated_completion_at=1000.0 + 3600,
                          now=1000.0) == "5.0 req/s · ETA 1:00:00"


def test_each_look_asks_the_service_to_wait_and_keeps_the_pace() -> None:
    """A look asks for `wait=interval`; an ended batch returns at once; a service that
    answers early without an end (one that ignores `wait`) costs the rest of the interval
    in a sleep, so the CLI never looks more than once an interval."""
    statuses = iter(["in_progress", "completed"])
    asked: list[str | None] = []

    def service(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params.get("wait"))
        return httpx.Response(200, json={"id": "batch_a", "status": next(statuses)})

    with BatchClient("http://service", "key", transport=httpx.MockTransport(service)) as client:
        started = time.monotonic()
        assert next_look(client, "batch_a", interval_s=0.3)["status"] == "in_progress"
        assert time.monotonic() - started >= 0.3
        started = time.monotonic()
        assert next_look(client, "batch_a", interval_s=5.0)["status"] == "completed"
        assert time.monotonic() - started < 1.0
    assert asked == ["0.3", "5.0"]


class _Files:
    """What write_results downloads through: each file id's bytes land at the path."""

    def download(self, file_id: str, path: Path) -> None:
        path.write_text(file_id)


@pytest.mark.parametrize(("status", "failed", "code"), [
    ("completed", 0, 0), ("completed", 1, 1), ("cancelled", 0, 1), ("expired", 0, 1)])
def test_the_exit_code_says_whether_every_line_succeeded(
        tmp_path: Path, status: str, failed: int, code: int) -> None:
    """A completed batch with failed lines exits 1: scripts checking it must see them."""
    from rich.console import Console

    from cli.batch import write_results

    batch = {"id": "batch_1", "status": status, "output_file_id": "out",
             "error_file_id": "err" if failed else None,
             "request_counts": {"total": 2, "completed": 2 - failed, "failed": failed}}
    out = tmp_path / "out.jsonl"
    assert write_results(_Files(), batch, output=out, errors=None,
                         console=Console(quiet=True)) == code
    assert out.read_text() == "out"


def test_a_failed_validation_names_each_line_once(tmp_path: Path) -> None:
    from rich.console import Console

    from cli.batch import write_results

    console = Console(record=True, width=200)
    batch = {"id": "batch_1", "status": "failed", "errors": {"data": [
        {"line": 2, "code": "invalid_url", "message": "line 2: url must be ..."},
        {"line": 3, "code": "invalid_json", "message": "not JSON"}]}}
    assert write_results(_Files(), batch, output=tmp_path / "o", errors=None,
                         console=console) == 1
    text = console.export_text()
    assert "  line 2: url must be ... (invalid_url)" in text and "line 2: line 2" not in text
    assert "  line 3: not JSON (invalid_json)" in text


def test_bad_paths_and_urls_are_one_line_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An output path that is a directory (a traceback once, after the whole batch had
    run), an input that is a directory, a URL that is none: exit 2, one line, no upload
    (the service here is unreachable: reaching it would say so instead)."""
    from cli.main import main

    requests = tmp_path / "in.jsonl"
    requests.write_text('{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}\n')
    service = ["--url", "http://127.0.0.1:9", "--api-key", "k"]
    cases = [
        (["batch", "run", str(requests), "-o", str(tmp_path), *service], "is a directory"),
        (["batch", "run", str(requests), "-o", str(tmp_path / "no" / "out.jsonl"), *service],
         "no directory"),
        (["batch", "run", str(tmp_path), "-o", str(tmp_path / "out.jsonl"), *service],
         "is a directory"),
        (["batch", "get", "batch_1", "--url", "http://[::1", "--api-key", "k"], "not a URL"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert not list(tmp_path.glob("*.part"))
