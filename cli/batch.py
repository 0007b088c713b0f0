"""`batchinfer batch run|list|get|cancel`: bulk jobs from a JSONL file, over the HTTP API.

`run` uploads the file, creates the batch, shows a live progress bar (completed, failed,
total, rate, ETA) and, once the batch ends, writes the output and error files. Ctrl-C
leaves the batch running on the service; `--batch-id` reattaches to it later.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# `batchinfer up` keeps its development tenant's key here, under the data directory.
DEV_KEY_FILE = "dev-api-key"
TERMINAL_STATUSES = ("completed", "failed", "expired", "cancelled")
# Seconds between two looks at a running batch.
POLL_INTERVAL_S = 1.0


def add_batch_parser(sub: Any) -> None:
    """Register `batch` and its actions on the `batchinfer` subparsers."""
    batch = sub.add_parser("batch", help="bulk jobs from a JSONL file (OpenAI Batch format)")
    actions = batch.add_subparsers(dest="batch_command", required=True, metavar="ACTION")

    run = actions.add_parser("run", help="upload, run and wait; write results")
    run.add_argument("input", nargs="?", type=Path,
                     help="requests.jsonl (not needed with --batch-id)")
    run.add_argument("-o", "--output", type=Path, required=True, help="results.jsonl")
    run.add_argument("--errors", type=Path, default=None,
                     help="error lines (default: <output>.errors.jsonl)")
    run.add_argument("--batch-id", default=None, help="reattach to a running batch")
    run.add_argument("--priority", choices=["high", "normal", "low"], default=None,
                     help="queue priority of the batch's jobs (default low)")
    run.add_argument("--model", default=None, help="run every request on this model")
    run.add_argument("--completion-window", default="24h",
                     help="how long the batch may take before it expires (default 24h)")
    run.add_argument("--poll-interval", type=float, default=POLL_INTERVAL_S,
                     help=f"seconds between two looks at the batch (default {POLL_INTERVAL_S:g})")
    run.set_defaults(func=cmd_run)

    list_ = actions.add_parser("list", help="recent batches")
    list_.add_argument("--limit", type=int, default=20, help="how many, newest first (default 20)")
    list_.set_defaults(func=cmd_list)
    for name, func, help_text in (("get", cmd_get, "print a batch object"),
                                  ("cancel", cmd_cancel, "cancel a batch")):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("batch_id", help="the batch's id (batch_...)")
        action.set_defaults(func=func)
    for action in (run, list_, *(actions.choices[n] for n in ("get", "cancel"))):
        add_service_options(action)


def add_service_options(action: Any) -> None:
    """--url and --api-key on one action, whose errors then print as one line (exit 1)."""
    action.add_argument("--url", default=None,
                        help="service URL (default $BATCHINFER_URL, else the settings' "
                             "api_host:api_port, http://127.0.0.1:8000)")
    action.add_argument("--api-key", default=None,
                        help="default $BATCHINFER_API_KEY, else the dev-api-key file `batchinfer "
                             "up` wrote in the data directory")
    action.set_defaults(func=_reporting_errors(action.get_default("func")))


def _reporting_errors(func: Callable[[argparse.Namespace], int]
                      ) -> Callable[[argparse.Namespace], int]:
    """`func`, with the service's error answers and connection failures as one line, exit 1."""

    def run(args: argparse.Namespace) -> int:
        import httpx

        from cli.batch_client import BatchAPIError

        command = f"batchinfer {args.command} {getattr(args, f'{args.command}_command')}"
        try:
            return func(args)
        except httpx.TransportError as e:
            url, source = service_url(args)
            print(f"{command}: cannot reach the service at {url} (from {source}): {e}",
                  file=sys.stderr)
            return 1
        except (BatchAPIError, httpx.HTTPError) as e:
            print(f"{command}: {e}", file=sys.stderr)
            return 1

    run.__doc__ = func.__doc__
    return run


def service_url(args: argparse.Namespace) -> tuple[str, str]:
    """The service's URL and the setting it came from, for messages that name both."""
    from core.settings import get_settings

    if args.url:
        return args.url, "--url"
    if os.environ.get("BATCHINFER_URL"):
        return os.environ["BATCHINFER_URL"], "BATCHINFER_URL"
    settings = get_settings()
    return (f"http://{settings.api_host}:{settings.api_port}",
            "the settings' api_host and api_port; set BATCHINFER_URL or pass --url")


def client_of(args: argparse.Namespace) -> Any:
    """A client of the service named by --url/--api-key, their variables or `up`'s files."""
    from cli.batch_client import BatchClient
    from core.settings import get_settings

    settings = get_settings()
    # One line per poll would bury the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    url, _ = service_url(args)
    key = args.api_key or os.environ.get("BATCHINFER_API_KEY")
    dev_key_path = settings.data_dir.resolve() / DEV_KEY_FILE
    if not key and dev_key_path.exists():
        key = dev_key_path.read_text().strip()
    if not key:
        raise ValueError(f"no API key: pass --api-key, set BATCHINFER_API_KEY, or point "
                         f"--data-dir (BATCHINFER_DATA_DIR) at the data directory of "
                         f"`batchinfer up` (looked for {dev_key_path})")
    return BatchClient(url, key)


def cmd_list(args: argparse.Namespace) -> int:
    """Print recent batches: a table on a terminal, tab-separated lines when piped."""
    from rich.console import Console
    from rich.table import Column, Table

    with client_of(args) as client:
        page = client.list_batches(limit=args.limit)
    header = ("id", "status", "completed", "failed", "total", "model", "created", "eta")
    rows = []
    for batch in page["data"]:
        counts = batch.get("request_counts") or {}
        rows.append((batch["id"], batch["status"], str(counts.get("completed", 0)),
                     str(counts.get("failed", 0)), str(counts.get("total", 0)),
                     batch.get("model") or "",
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(batch["created_at"])),
                     _clock(batch.get("estimated_completion_at"))))
    console = Console()
    if not console.is_terminal:
        for row in (header, *rows):
            print("\t".join(row))
        return 0
    # Ids are what users copy into the next command: never cut short.
    table = Table(Column(header[0], no_wrap=True), *header[1:5],
                  Column(header[5], overflow="fold"), header[6], header[7])
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return 0


def _clock(at: float | None) -> str:
    """A unix time as local `YYYY-MM-DD HH:MM:SS`, or '' for None."""
    return "" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def cmd_get(args: argparse.Namespace) -> int:
    """Print one batch object as JSON."""
    with client_of(args) as client:
        print(json.dumps(client.get_batch(args.batch_id), indent=2))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a batch; print its object."""
    with client_of(args) as client:
        print(json.dumps(client.cancel_batch(args.batch_id), indent=2))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Upload and create (or reattach), follow progress, write the results."""
    from rich.console import Console

    from cli.batch_client import endpoint_of

    console = Console(stderr=True)
    # Where the results go is checked before anything runs: found out after the batch,
    # a wrong path cost the whole run.
    for path, flag in ((args.output, "-o"), (args.errors, "--errors")):
        if path is not None and (path.is_dir() or not path.parent.is_dir()):
            raise ValueError(f"{flag} {path}: " + ("is a directory" if path.is_dir()
                                                    else f"no directory {path.parent}"))
    if args.input is not None and not args.input.is_file():
        raise ValueError(f"{args.input}: " + ("is a directory" if args.input.is_dir()
                                               else "no such file"))
    with client_of(args) as client:
        if args.batch_id:
            batch = client.get_batch(args.batch_id)
            console.print(f"reattached to {batch['id']} ({batch['status']})")
        else:
            if args.input is None:
                raise ValueError("give the requests file, or --batch-id to reattach")
            file = client.upload(args.input)
            console.print(f"uploaded {args.input} as {file['id']} ({file['bytes']} bytes)")
            batch = client.create_batch(
                input_file_id=file["id"], endpoint=endpoint_of(args.input),
                completion_window=args.completion_window, priority=args.priority,
                model=args.model)
            console.print(f"batch {batch['id']} created; if interrupted, reattach with "
                          f"--batch-id {batch['id']}")
        try:
            batch = follow(client, batch, console=console, poll_interval_s=args.poll_interval)
        except KeyboardInterrupt:
            console.print(f"\ninterrupted; batch {batch['id']} keeps running. Reattach with: "
                          f"batchinfer batch run -o {args.output} --batch-id {batch['id']}")
            return 130
        return write_results(client, batch, output=args.output, errors=args.errors,
                             console=console)


def next_look(client: Any, batch_id: str, *, interval_s: float) -> dict[str, Any]:
    """The batch an interval from now, or as soon as it ends: the service holds the read
    open for the interval and answers when the batch ends. An answer that came early
    without an end (a service that does not wait) is followed by the rest of the
    interval's sleep, so the pace never exceeds one look per interval."""
    started = time.monotonic()
    batch: dict[str, Any] = client.get_batch(batch_id, wait=interval_s)
    if batch["status"] not in TERMINAL_STATUSES:
        time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    return batch


def follow(client: Any, batch: dict[str, Any], *, console: Any,
           poll_interval_s: float) -> dict[str, Any]:
    """Poll until the batch ends, drawing a progress bar; returns the final object."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]{task.description:<11}"), BarColumn(),
        TextColumn("{task.fields[counts]}"), TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(), console=console, transient=False)
    rate = RateMeter()
    with progress:
        task = progress.add_task(batch["status"], total=None, counts="", rate="")
        while True:
            counts = batch.get("request_counts") or {}
            total = int(counts.get("total") or 0)
            completed, failed = int(counts.get("completed") or 0), int(counts.get("failed") or 0)
            rate.observe(completed + failed)
            progress.update(task, description=batch["status"], total=total or None,
                            completed=completed + failed,
                            counts=f"{completed} ok · {failed} failed / {total}",
                            rate=rate.describe(
                                remaining=total - completed - failed,
                                estimated_completion_at=batch.get("estimated_completion_at")))
            if batch["status"] in TERMINAL_STATUSES:
                return batch
            batch = next_look(client, batch["id"], interval_s=poll_interval_s)


class RateMeter:
    """Requests per second since the first observation, and the ETA it implies."""

    def __init__(self) -> None:
        self._first: tuple[float, int] | None = None
        self._last: tuple[float, int] | None = None

    def observe(self, num_done: int, *, at: float | None = None) -> None:
        """Record how many requests are done now."""
        now = time.monotonic() if at is None else at
        if self._first is None:
            self._first = (now, num_done)
        self._last = (now, num_done)

    @property
    def per_s(self) -> float | None:
        """Requests finished per second since the first observation (None: too early)."""
        if self._first is None or self._last is None or self._last[0] <= self._first[0]:
            return None
        return (self._last[1] - self._first[1]) / (self._last[0] - self._first[0])

    def describe(self, *, remaining: int, estimated_completion_at: float | None = None,
                 now: float | None = None) -> str:
        """`12.3 req/s · ETA 0:01:05`, or '' before there is a rate or an estimate.

        The service's `estimated_completion_at` (unix time) is preferred: it knows the work
        queued ahead of the batch and the whole fleet's pace, where the rate seen here only
        knows this batch's own recent progress (and is 0 while the batch waits its turn).
        """
        per_s = self.per_s
        rate = f"{per_s:.1f} req/s · " if per_s and per_s > 0 else ""
        if estimated_completion_at is not None:
            eta_s = int(max(0.0, estimated_completion_at - (time.time() if now is None else now)))
        elif per_s and per_s > 0:
            eta_s = int(max(remaining, 0) / per_s)
        else:
            return ""
        return f"{rate}ETA {eta_s // 3600}:{eta_s // 60 % 60:02d}:{eta_s % 60:02d}"


def write_results(client: Any, batch: dict[str, Any], *, output: Path, errors: Path | None,
                  console: Any) -> int:
    """Download output and error files; print what happened. 0 only for `completed` with
    no failed line (a script checking the exit code must see lines that failed)."""
    counts = batch.get("request_counts") or {}
    if batch["status"] == "failed":
        console.print(f"batch {batch['id']} failed validation; nothing ran:")
        for error in (batch.get("errors") or {}).get("data") or []:
            message = str(error.get("message"))
            where = f"line {error['line']}: " if error.get("line") else ""
            if message.startswith(where):  # the service's messages name their line
                where = ""
            console.print(f"  {where}{message} ({error.get('code')})", markup=False)
        return 1
    errors = errors or output.with_name(output.stem + ".errors.jsonl")
    if batch.get("output_file_id"):
        client.download(batch["output_file_id"], output)
        console.print(f"wrote {counts.get('completed', 0)} result(s) to {output}")
    if batch.get("error_file_id"):
        client.download(batch["error_file_id"], errors)
        console.print(f"wrote {counts.get('failed', 0)} error line(s) to {errors}")
    console.print(f"batch {batch['id']} {batch['status']}")
    return 0 if batch["status"] == "completed" and not counts.get("failed") else 1


def main(argv: list[str] | None = None) -> int:
    """Run `batch ...` on its own (the same as `batchinfer batch ...`)."""
    parser = argparse.ArgumentParser(prog="batchinfer")
    add_batch_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
