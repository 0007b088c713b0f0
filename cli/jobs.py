"""`batchinfer jobs list|get|cancel|wait`: single jobs over the HTTP API, beside `batch`.

`list` prints a table on a terminal and tab-separated lines when piped; `get`, `cancel`
and `wait` print the job object as JSON. `wait` long-polls until the job ends and exits 0
only when it succeeded.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from cli.batch import add_service_options, client_of

TERMINAL_STATUSES = ("succeeded", "failed", "cancelled", "expired")
# Seconds the service holds one long-poll open; `wait` asks again until its own timeout.
LONG_POLL_S = 30.0


def add_jobs_parser(sub: Any) -> None:
    """Register `jobs` and its actions on the `batchinfer` subparsers."""
    jobs = sub.add_parser("jobs", help="single jobs: list, show, cancel, wait")
    actions = jobs.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    list_ = actions.add_parser("list", help="recent jobs, newest first")
    list_.add_argument("--limit", type=int, default=20, help="how many (default 20)")
    list_.add_argument("--status", default=None,
                       help="only jobs in this state (queued, running, succeeded, failed, ...)")
    list_.add_argument("--model", default=None, help="only jobs for this served model")
    list_.add_argument("--batch-id", default=None, help="only the jobs of this batch")
    list_.set_defaults(func=cmd_list)
    for name, func, help_text in (("get", cmd_get, "print a job as JSON"),
                                  ("cancel", cmd_cancel, "cancel a queued or running job"),
                                  ("wait", cmd_wait, "wait until a job ends; print it")):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("job_id", help="the job's id, as POST /v1/jobs answered it")
        action.set_defaults(func=func)
    actions.choices["wait"].add_argument(
        "--timeout", type=float, default=None,
        help="give up after this many seconds, exit 1 (default: wait as long as it takes)")
    for action in actions.choices.values():
        add_service_options(action)


def cmd_list(args: argparse.Namespace) -> int:
    """Print recent jobs: id, status, model, priority, created."""
    filters = {name: value for name, value in (("status", args.status), ("model", args.model),
                                               ("batch_id", args.batch_id)) if value}
    with client_of(args) as client:
        page = client.list_jobs(limit=args.limit, filters=filters)
    rows = [(job["id"], job["status"], job.get("model") or "", job.get("priority") or "",
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["created_at"])))
            for job in page["data"]]
    header = ("ID", "STATUS", "MODEL", "PRIORITY", "CREATED")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip())
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    """Print one job as JSON."""
    with client_of(args) as client:
        print(json.dumps(client.get_job(args.job_id), indent=2))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a job; print it."""
    with client_of(args) as client:
        print(json.dumps(client.cancel_job(args.job_id), indent=2))
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    """Long-poll until the job ends (or --timeout); print it; 0 only if it succeeded."""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    with client_of(args) as client:
        while True:
            left = LONG_POLL_S if deadline is None else deadline - time.monotonic()
            job: dict[str, Any] = client.get_job(args.job_id, wait=max(0.0, min(LONG_POLL_S,
                                                                                 left)))
            if job["status"] in TERMINAL_STATUSES or (deadline is not None
                                                      and time.monotonic() >= deadline):
                break
    print(json.dumps(job, indent=2))
    return 0 if job["status"] == "succeeded" else 1
