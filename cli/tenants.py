"""`batchinfer tenants set-limits|show`: token budgets and fair-share weights, on the database.

Like `keys`, these act on the configured database directly (operator commands, no API
key). API processes and the scheduler pick new limits up within
`tenant_limits_refresh_s`; workers read weights as often.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_tenants_parser(sub: Any) -> None:
    """Register `tenants` and its actions on the `batchinfer` subparsers."""
    tenants = sub.add_parser("tenants", help="tenants' token budgets and fair-share weights")
    actions = tenants.add_subparsers(dest="tenants_command", required=True, metavar="ACTION")
    limits = actions.add_parser(
        "set-limits", help="set a tenant's tokens per minute/day (0 removes one) and weight")
    limits.add_argument("--tenant", required=True, help="tenant name (as in `keys create`)")
    limits.add_argument("--model", default=None,
                        help="budgets for this served model only (default: all models)")
    limits.add_argument(
        "--tokens-per-minute", type=int, default=None,
        help="prompt + completion tokens a minute, refilled continuously (0: no limit)")
    limits.add_argument("--tokens-per-day", type=int, default=None,
                        help="prompt + completion tokens per UTC day (0: no limit)")
    limits.add_argument("--weight", type=float, default=None,
                        help="share of a priority's capacity against other tenants (default 1)")
    limits.set_defaults(func=cmd_set_limits)
    show = actions.add_parser("show", help="print tenants' limits (one tenant's with --tenant)")
    show.add_argument("--tenant", default=None, help="tenant name")
    show.set_defaults(func=cmd_show)


def cmd_set_limits(args: argparse.Namespace) -> int:
    """Write one tenant's limits row; print the tenant's limits after."""
    from cli.main import _operator_session
    from storage.tenant_limits import ALL_MODELS, set_limits
    from storage.tenants import tenant_by_name

    if args.tokens_per_minute is None and args.tokens_per_day is None and args.weight is None:
        raise ValueError("give --tokens-per-minute, --tokens-per-day or --weight")
    with _operator_session() as session:
        tenant = tenant_by_name(session, name=args.tenant)
        if tenant is None:
            raise ValueError(f"no tenant named {args.tenant!r}")
        set_limits(session, tenant_id=tenant.id, model=args.model or ALL_MODELS,
                   tokens_per_minute=args.tokens_per_minute,
                   tokens_per_day=args.tokens_per_day, weight=args.weight)
        session.commit()
    return cmd_show(argparse.Namespace(tenant=args.tenant))


def cmd_show(args: argparse.Namespace) -> int:
    """Print a table: tenant, model, tokens/minute, tokens/day, weight."""
    from sqlalchemy import select

    from cli.main import _operator_session
    from storage.models import Tenant, TenantLimit

    with _operator_session() as session:
        query = (select(Tenant.name, Tenant.id, TenantLimit)
                 .join(TenantLimit, TenantLimit.tenant_id == Tenant.id, isouter=True)
                 .order_by(Tenant.name, TenantLimit.model))
        if args.tenant is not None:
            query = query.where(Tenant.name == args.tenant)
        rows = []
        for name, tenant_id, limit in session.execute(query):
            if limit is None:
                rows.append((name, tenant_id, "*", "-", "-", "1"))
            else:
                rows.append((name, tenant_id, limit.model, _count(limit.tokens_per_minute),
                             _count(limit.tokens_per_day),
                             f"{limit.weight:g}" if limit.model == "*" else "-"))
    if args.tenant is not None and not rows:
        raise ValueError(f"no tenant named {args.tenant!r}")
    header = ("TENANT", "ID", "MODEL", "TOKENS/MIN", "TOKENS/DAY", "WEIGHT")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip())
    return 0


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"
