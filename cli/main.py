"""`batchinfer`: the one command line for every role.

Each subcommand imports its role only when it runs, so an API process never loads torch
and a worker never loads FastAPI.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.engine.config import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from core.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    if logging.getLogger().level > logging.DEBUG:
        # kafka-python narrates every connection and metadata refresh at INFO.
        logging.getLogger("kafka").setLevel(logging.WARNING)


def _override_env(**values: object) -> None:
    """Put CLI options into BATCHINFER_* so get_settings() and child processes see them."""
    from core.settings import get_settings

    for name, value in values.items():
        if value is not None:
            os.environ[f"BATCHINFER_{name.upper()}"] = str(value)
    get_settings.cache_clear()


def _add_kv_cache_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="what the KV cache stores: the model's dtype (auto) or e4m3 bytes "
                             "(fp8: twice the sequences of bf16; default: "
                             "$BATCHINFER_ENGINE_KV_CACHE_DTYPE, else auto)")


class _ModelOption(argparse.Action):
    """`--model X`: a new served model, named by the --served-model-name right after it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        namespace.served = [*(getattr(namespace, "served", None) or []), (values, None)]


class _ServedNameOption(argparse.Action):
    """`--served-model-name Y`: the name of the --model just before it; anything else is an
    error, so a name never lands on another model by position."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        served = list(getattr(namespace, "served", None) or [])
        if not served:
            parser.error(f"--served-model-name {values} names the --model just before it; "
                         "put --model PATH|NAME first")
        model, name = served[-1]
        if name is not None:
            parser.error(f"--model {model} is already served as {name!r}; give each --model "
                         "at most one --served-model-name, right after it")
        served[-1] = (model, values)
        namespace.served = served


def served_models_of(served: list[tuple[str, str | None]] | None) -> list[tuple[str, str]]:
    """(model, served name) per --model, in order; a model without a name is served under
    what --model said (its path or known name)."""
    pairs = [(model, name if name is not None else model) for model, name in served or []]
    for model, name in pairs:
        if not model.strip() or not name.strip():
            raise ValueError("--model and --served-model-name must not be empty")
    seen = [name for _, name in pairs]
    duplicates = sorted({name for name in seen if seen.count(name) > 1})
    if duplicates:
        raise ValueError(f"served model name(s) {', '.join(duplicates)} given twice; each "
                         "model needs its own --served-model-name")
    return pairs


class _EngineUrlOfModel(argparse.Action):
    """`--engine-url` of `up`: belongs to the `--model` given before it (repeatable)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        models = getattr(namespace, "served", None) or []
        if not models:
            parser.error("--engine-url belongs to the --model before it; give --model first")
        urls: list[tuple[int, str]] = getattr(namespace, self.dest, None) or []
        urls.append((len(models) - 1, str(values)))
        setattr(namespace, self.dest, urls)


def engine_urls_of(served: list[tuple[str, str]],
                   urls: list[tuple[int, str]] | None) -> dict[str, list[str]]:
    """Served name → the engine servers its --engine-url options named (models without
    any are loaded by their workers)."""
    by_name: dict[str, list[str]] = {}
    for index, url in urls or []:
        by_name.setdefault(served[index][1], []).append(url)
    return by_name


def cmd_up(args: argparse.Namespace) -> int:
    """Run the whole service on this machine (embedded default)."""
    served = served_models_of(args.served)
    _override_env(api_port=args.port, data_dir=args.data_dir, api_processes=args.api_processes,
                  engine_kv_cache_dtype=args.kv_cache_dtype)
    from scheduler.embedded import run_embedded

    return run_embedded(num_workers=args.workers, max_workers=args.max_workers, host=args.host,
                        models=served or None,
                        engine_urls=engine_urls_of(served, args.engine_url))


def cmd_api(args: argparse.Namespace) -> int:
    """Serve the HTTP API with uvicorn."""
    _override_env(api_host=args.host, api_port=args.port)
    from api.serve import serve
    from core.settings import get_settings

    serve(get_settings())
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """Run one inference worker until SIGTERM."""
    if args.served_model_name is not None and args.model is None:
        raise ValueError("--served-model-name names the --model given with it; add --model")
    if args.engine_url and args.model is None:
        raise ValueError("--engine-url serves the --model its servers know; add --model")
    _override_env(model=args.model, served_model_name=args.served_model_name,
                  engine_urls=",".join(args.engine_url) if args.engine_url else None,
                  engine_kv_cache_dtype=args.kv_cache_dtype)
    from core.settings import get_settings
    from workers.inference import run_worker

    run_worker(get_settings())
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    """Migrate the database schema up or down."""
    from core.settings import get_settings
    from storage.migrate import downgrade, upgrade

    url = args.database_url or get_settings().database_url
    if args.action == "upgrade":
        upgrade(url, revision=args.revision or "head")
        print(f"database upgraded to {args.revision or 'head'}")
    else:
        downgrade(url, revision=args.revision or "base")
        print(f"database downgraded to {args.revision or 'base'}")
    return 0


def require_database(settings: Settings) -> None:
    """ValueError naming where it looked when the SQLite database is not there: an operator
    command never creates one (it would be empty, and a stray `.data/` besides)."""
    url = settings.database_url
    if not url.startswith("sqlite:///"):
        return
    path = Path(url.removeprefix("sqlite:///"))
    if not path.is_file():
        source = ("--data-dir or BATCHINFER_DATA_DIR" if os.environ.get("BATCHINFER_DATA_DIR")
                  else f"the default, .data under {Path.cwd()}")
        raise ValueError(f"no database at {path} (data directory from {source}); run this "
                         "where `batchinfer up` ran, or pass --data-dir (or set "
                         "BATCHINFER_DATA_DIR or BATCHINFER_DATABASE_URL)")


@contextlib.contextmanager
def _operator_session() -> Iterator[Session]:
    """A session on the configured database for one operator command; the engine goes after."""
    from core.settings import get_settings
    from storage.db import create_db_engine, session_factory

    settings = get_settings()
    require_database(settings)
    engine = create_db_engine(settings.database_url)
    try:
        with session_factory(engine)() as session:
            yield session
    finally:
        engine.dispose()


def cmd_keys_create(args: argparse.Namespace) -> int:
    """Create an API key for a tenant (and the tenant, when new); print the key."""
    from storage.tenants import create_api_key, create_tenant, tenant_by_name
    from storage.webhook_secrets import ensure_webhook_secret

    with _operator_session() as session:
        tenant = tenant_by_name(session, name=args.tenant)
        if tenant is None:
            tenant = create_tenant(session, name=args.tenant)
        api_key, key = create_api_key(session, tenant_id=tenant.id)
        webhook_secret = ensure_webhook_secret(session, tenant_id=tenant.id).secret
        session.commit()
    print(f"tenant: {tenant.name} ({tenant.id})", file=sys.stderr)
    print(f"key id: {api_key.id} (revoke with `batchinfer keys revoke {api_key.id}`)",
          file=sys.stderr)
    print(f"Webhook secret: {webhook_secret}", file=sys.stderr)
    print(key)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    """Print every key's id, prefix, tenant, creation and revocation (never the key)."""
    from storage.tenants import list_api_keys, tenant_by_name

    with _operator_session() as session:
        tenant_id = None
        if args.tenant is not None:
            tenant = tenant_by_name(session, name=args.tenant)
            if tenant is None:
                raise ValueError(f"no tenant named {args.tenant!r}")
            tenant_id = tenant.id
        rows = [(k.id, f"{k.prefix}...", t.name, k.created_at.isoformat(timespec="seconds"),
                 "live" if k.revoked_at is None
                 else f"revoked {k.revoked_at.isoformat(timespec='seconds')}")
                for k, t in list_api_keys(session, tenant_id=tenant_id)]
    header = ("ID", "PREFIX", "TENANT", "CREATED", "STATE")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip())
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    """Revoke a key named by id, prefix or the key itself."""
    from api.key_cache import MAX_AGE_S
    from storage.tenants import find_api_key, revoke_api_key

    with _operator_session() as session:
        api_key = find_api_key(session, ref=args.key)
        newly = revoke_api_key(session, key_id=api_key.id)
        session.commit()
        name, revoked_at = f"{api_key.id} ({api_key.prefix}...)", api_key.revoked_at
    assert revoked_at is not None
    if newly:  # API processes trust a live key they saw for up to MAX_AGE_S
        print(f"revoked {name}; every API process refuses it within {MAX_AGE_S:g} s")
    else:
        print(f"{name} was already revoked at {revoked_at.isoformat(timespec='seconds')}")
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    """The scheduler role: re-publish stale queued jobs and advance batches."""
    from core.settings import get_settings
    from scheduler.role import run_scheduler

    return run_scheduler(get_settings(), once=args.once)


def cmd_callbacks(args: argparse.Namespace) -> int:
    """Run the webhook delivery worker (Celery, with its dispatcher beat) until SIGTERM."""
    from core.settings import get_settings
    from workers.callbacks.app import run_callbacks

    run_callbacks(get_settings())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="batchinfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", default=None,
                        help="DEBUG, INFO, WARNING... (default: settings.log_level)")
    parser.add_argument("--data-dir", dest="global_data_dir", default=None, metavar="DIR",
                        help="the data directory of `batchinfer up` (SQLite database, dev API "
                             "key) that keys and the clients read (default "
                             "$BATCHINFER_DATA_DIR, else .data here)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run broker, Redis, SQLite, API and workers on this machine")
    up.add_argument("--port", type=int, default=None, help="API port (default 8000)")
    up.add_argument("--host", default="127.0.0.1", help="API bind address")
    up.add_argument("--workers", type=int, default=1,
                    help="inference worker processes; with --max-workers, the fewest")
    up.add_argument("--max-workers", type=int, default=None,
                    help="scale workers between --workers and this by Kafka lag "
                         "(default: a fixed --workers)")
    up.add_argument("--api-processes", type=int, default=None, metavar="N",
                    help="API processes sharing the port (default 1; one process serves at "
                         "most about one core)")
    up.add_argument("--data-dir", default=None, help="SQLite, Redis dump, files (default .data)")
    up.add_argument("--model", action=_ModelOption, dest="served", default=None,
                    metavar="PATH|NAME",
                    help="model to serve: a Hugging Face directory, a .gguf file, or a known "
                         "name (pulled when missing); repeat for several (default "
                         "smollm2-135m-instruct)")
    up.add_argument("--served-model-name", action=_ServedNameOption, dest="served",
                    metavar="NAME",
                    help="the name clients use for the --model just before it (default: "
                         "what that --model says)")
    up.add_argument("--engine-url", action=_EngineUrlOfModel, default=None, metavar="URL",
                    help="serve the --model before it through this OpenAI-compatible engine "
                         "server (vLLM, SGLang, TGI, llama.cpp: http://host:port/v1) instead of "
                         "loading it; repeat for several servers of that model")
    _add_kv_cache_dtype(up)
    up.set_defaults(func=cmd_up)

    api = sub.add_parser("api", help="serve the HTTP API")
    api.add_argument("--host", default=None, help="bind address (default: settings.api_host)")
    api.add_argument("--port", type=int, default=None,
                     help="port (default: settings.api_port, 8000)")
    api.set_defaults(func=cmd_api)

    worker = sub.add_parser("worker", help="run an inference worker")
    worker.add_argument("--model", default=None, metavar="PATH|NAME",
                        help="model to load: a Hugging Face directory, a .gguf file or a "
                             "prepared name (default: settings.model)")
    worker.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the name clients use for it (default: what --model says)")
    worker.add_argument("--engine-url", action="append", default=None, metavar="URL",
                        help="drive this OpenAI-compatible engine server (vLLM, SGLang, TGI, "
                             "llama.cpp: http://host:port/v1), which serves --model by that "
                             "name, instead of loading the model; repeat for several servers")
    _add_kv_cache_dtype(worker)
    worker.set_defaults(func=cmd_worker)
    sub.add_parser("callbacks", help="run the webhook delivery worker").set_defaults(
        func=cmd_callbacks)

    db = sub.add_parser("db", help="database schema migrations")
    db.add_argument("action", choices=["upgrade", "downgrade"],
                    help="upgrade to --revision (default head) or downgrade to it (base)")
    db.add_argument("--revision", default=None, help="target (default head / base)")
    db.add_argument("--database-url", default=None, help="default: settings.database_url")
    db.set_defaults(func=cmd_db)

    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = keys_sub.add_parser("create", help="create a key for a tenant; prints it once")
    create.add_argument("--tenant", required=True, help="tenant name (created when new)")
    create.set_defaults(func=cmd_keys_create)
    listing = keys_sub.add_parser("list", help="list keys: id, prefix, tenant, state")
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys_sub.add_parser(
        "revoke", help="revoke a key; every API process refuses it within about a second")
    revoke.add_argument("key", help="its id (key_...), its prefix as listed, or the key")
    revoke.set_defaults(func=cmd_keys_revoke)

    from cli.models import add_models_parser

    add_models_parser(sub)

    reconcile = sub.add_parser(
        "reconcile", help="scheduler role: re-publish jobs stuck in queued, advance batches")
    reconcile.add_argument("--once", action="store_true", help="one pass of each, then exit")
    reconcile.set_defaults(func=cmd_reconcile)

    # The batch client imports only argparse-level code until one of its actions runs.
    from cli.batch import add_batch_parser

    add_batch_parser(sub)
    from cli.jobs import add_jobs_parser

    add_jobs_parser(sub)
    from cli.tenants import add_tenants_parser

    add_tenants_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("batchinfer")
    except PackageNotFoundError:
        return "unknown (not installed)"


def command_of(args: argparse.Namespace) -> str:
    """The command as typed, with its action: `models prepare`, `keys list`, `up`."""
    action = getattr(args, f"{args.command}_command", None)
    return f"{args.command} {action}" if action else args.command


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `batchinfer` console script."""
    args = build_parser().parse_args(argv)
    from core.settings import get_settings

    if args.global_data_dir is not None:
        _override_env(data_dir=Path(args.global_data_dir).resolve())
    try:
        level = args.log_level or get_settings().log_level
        _configure_logging(level)
        func: Callable[[argparse.Namespace], int] = args.func
        code = func(args)
        sys.stdout.flush()  # here, where a reader that left is handled, not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader left (`| head`): quietly, and with stdout pointed where a last flush at
        # exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError, RuntimeError) as e:
        # What a user can act on, without a traceback (which --log-level DEBUG shows): a
        # bad argument, a path that is missing or a directory, a service that is down.
        logging.getLogger(__name__).debug("%s failed", args.command, exc_info=True)
        print(f"batchinfer {command_of(args)}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
