"""The engine stepping on its own thread, fed and drained through thread-safe queues.

Responsible for: owning the `LLMEngine` once started (no other thread touches it), taking
new requests and aborts from the poll thread between steps, so new jobs join the running
batch at the next step instead of waiting for a batch to fill; handing every finished,
refused or aborted request back through a queue; refreshing the engine gauges; for
streamed requests only, handing each step's new text to `token_sink` in one call per
step (see `watch`); a request with several choices (`n`) run as that many engine
requests sharing the prompt's KV blocks, and handed back as one; a request with a schema
not compiled lately held back while its grammar compiles on a thread of its own, so the
running batch keeps stepping (a 5,000-property schema takes ~0.85 s on two cores).

Why a thread: a step takes from milliseconds (GPU) to seconds (CPU), and the Kafka poll
loop must keep polling, committing and reacting to rebalances meanwhile. torch releases
the GIL inside its kernels, so the two threads share a core well.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from core import metrics
from core.deadlines import DEFAULT_DUE_S
from core.messages import JobMessage
from storage.token_streams import STARTED, StreamEntry
from workers.engine import EngineStats, LLMEngine, RequestOutput, SamplingParams
from workers.inference.grammar_compiles import Compiled, GrammarCompiles, grammar_key
from workers.inference.remote_requests import RemoteOutput
from workers.inference.sampling import Prompt

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often the engine gauges are refreshed.
STATS_INTERVAL_S = 1.0
# Deadlines within this long of reaching the engine order a job before those without one.
DEADLINE_HORIZON_S = DEFAULT_DUE_S
# How long the idle engine thread waits for a request before refreshing the gauges (`stop`
# wakes it at once): waking twenty times a second cost an idle worker ~4 ms of CPU a second.
IDLE_WAIT_S = STATS_INTERVAL_S


def built_on_a_passing_thread(build: Callable[[], T]) -> T:
    """`build()` run on a thread of its own that has ended when this returns.

    Why: OpenMP (torch's CPU thread pool) keeps a team of helper threads for each OS thread
    that ran a parallel op, and once a process's teams hold more threads than it has cores,
    libgomp stops spin-waiting between ops (its "throttled" mode): the engine's helpers then
    sleep after every op and are woken at the next. A model loaded on the poll thread and
    stepped on the engine thread left two teams: a SmolLM2 prefill step took 81-85 ms there
    against 72-77 ms on the thread that loaded it (2 cores). Loaded on a thread that then
    ended, whose team ends with it: 71-73 ms.
    """
    box: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            box.append(build())
        except BaseException as e:  # handed to the caller
            failure.append(e)

    # Daemon: a Ctrl-C during a long load ends the process without waiting for it.
    thread = threading.Thread(target=run, name="engine-build", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return box[0]


def engine_deadline(deadline: float | None, now: float) -> float | None:
    """The deadline a job is ordered by within its priority in the engine: its own when
    it falls within `DEADLINE_HORIZON_S` of `now`, else None (seconds since the epoch).

    The engine runs deadlines first (earliest first), then the rest by tenants' fair
    share (by weight over tokens), then arrival. Example at now = 0: a 30-minute deadline
    (1,800) runs before a job without one; that job and a 2 h or 24 h batch window's
    lines (7,200, 86,400: None here) share by tenant. A far-off window ordering first would
    let one tenant's 24 h batch run before every other tenant's job (or, ordered after
    jobs without one, a 2 h window before a 24 h one: still one tenant's batch ahead of
    another's), whatever their shares.
    """
    if deadline is not None and deadline - now <= DEADLINE_HORIZON_S:
        return deadline
    return None


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request for `add_all`, with `add`'s arguments."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int
    stream: bool = False
    job: JobMessage | None = None
    tools: list[dict[str, Any]] | None = None
    n: int = 1
    tenant_weight: float = 1.0
    # The chat template's own variables (a request's `chat_template_kwargs`).
    template_kwargs: dict[str, Any] | None = None


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int
    stream: bool = False
    deadline: float | None = None
    tools: list[dict[str, Any]] | None = None
    n: int = 1
    tenant: str | None = None
    tenant_weight: float = 1.0
    template_kwargs: dict[str, Any] | None = None


@dataclass(slots=True)
class _Choices:
    """The engine requests of one request with n choices: choice 0 runs under the
    request's own id and i > 0 under `<id>#<i>`. The others join once choice 0 has its
    prompt in the KV pool, so they take its full blocks from the prefix cache instead of
    computing the same prompt n times in one step."""

    add: _Add
    pending: list[str]  # ids of choices not yet in the engine
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    error: str | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Watch:
    request_id: str


@dataclass(slots=True)
class FinishedRequest:
    """A request that left the engine: finished (`output`), refused (`error`) or aborted."""

    request_id: str
    output: RequestOutput | RemoteOutput | None = None
    error: str | None = None
    aborted: bool = False
    # With n choices: every choice's output, choice 0 (`output`) first.
    choices: list[RequestOutput] | None = None


# Put in the finished queue by `wake`, taken out by `take_finished`.
WAKE = FinishedRequest("")


class EngineLoop:
    """Runs `engine.step()` continuously on a background thread (see module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[list[_Add] | _Abort | _Watch | Compiled | None] = (
            queue.SimpleQueue())  # None: stop
        self._compiles: GrammarCompiles[_Add] = GrammarCompiles(
            lambda params: engine.compile_grammar(params), self._inbox.put)
        self._outbox: queue.SimpleQueue[FinishedRequest] = queue.SimpleQueue()
        self._live_ids: set[str] = set()  # touched by the engine thread only
        # Requests with n > 1 by their own id, and each choice's id -> that id.
        self._choices: dict[str, _Choices] = {}
        self._choice_of: dict[str, str] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.failure: BaseException | None = None
        self._last_stats_at = 0.0
        self._last_stats: EngineStats | None = None
        # Streaming (engine thread only): characters of text each live request has handed
        # out so far, and for the watched ones, how many of those are published.
        self._num_emitted_chars: dict[str, int] = {}
        self._num_published_chars: dict[str, int] = {}
        self._entries: list[StreamEntry] = []
        # Takes each step's entries of watched requests (set before start; called on the
        # engine thread, so it must only hand them on, e.g. to a TokenPublisher's queue).
        self.token_sink: Callable[[list[StreamEntry]], None] | None = None

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Ask the thread to finish its current step and end; wait up to `timeout`."""
        self._stopping.set()
        self._inbox.put(None)
        self._compiles.shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread still in a step after %.0f s", timeout or 0)

    @property
    def is_healthy(self) -> bool:
        """False once the engine thread died of an unexpected error."""
        return self.failure is None

    def add(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int,
            *, stream: bool = False, job: JobMessage | None = None,
            tools: list[dict[str, Any]] | None = None, n: int = 1,
            tenant_weight: float = 1.0) -> None:
        """Queue a request; it joins the running batch at the engine's next step. With
        `stream`, its text goes to `token_sink` step by step (n = 1 only). (`job` is for
        an engine server, which sends the job's own fields; this engine takes its deadline
        and tenant, which order it within its priority, the tenant by `tenant_weight`.)
        `tools` are rendered into a chat prompt. With `n` > 1 its FinishedRequest carries
        every choice (`choices`)."""
        self.add_all([EngineRequest(request_id, prompt, params, priority, stream=stream,
                                    job=job, tools=tools, n=n, tenant_weight=tenant_weight)])

    def add_all(self, requests: Sequence[EngineRequest]) -> None:
        """Queue requests that reach the engine in the same step (see `add`), so that it
        orders them all by urgency: added one by one, the first could start, and a
        batch's first lines finish, before a more urgent one behind them had arrived."""
        now = time.time()
        adds = [_Add(r.request_id, r.prompt, r.params, r.priority, r.stream and r.n == 1,
                     None if r.job is None else engine_deadline(r.job.deadline, now),
                     r.tools, r.n, None if r.job is None else r.job.tenant_id,
                     r.tenant_weight, r.template_kwargs) for r in requests]
        if adds:
            self._inbox.put(adds)

    def watch(self, request_id: str) -> None:
        """Stream a live request from now on: its text so far, then step by step."""
        self._inbox.put(_Watch(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request; a FinishedRequest with `aborted=True` follows if it was live."""
        self._inbox.put(_Abort(request_id))

    def wake(self) -> None:
        """End a `take_finished` wait now, with nothing finished (safe from a signal
        handler: SimpleQueue.put is reentrant)."""
        self._outbox.put(WAKE)

    def take_finished(self, timeout: float = 0.0) -> list[FinishedRequest]:
        """Everything finished since the last call; waits up to `timeout` for the first."""
        finished: list[FinishedRequest] = []
        try:
            finished.append(
                self._outbox.get(timeout=timeout) if timeout > 0 else self._outbox.get_nowait()
            )
        except queue.Empty:
            return finished
        while True:
            try:
                finished.append(self._outbox.get_nowait())
            except queue.Empty:
                return [done for done in finished if done is not WAKE]

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                finished: list[FinishedRequest] = []
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._note_text(output)
                        if output.request_id in self._choice_of:
                            self._note_choice(output)
                        elif output.finished:
                            self._live_ids.discard(output.request_id)
                            finished.append(FinishedRequest(output.request_id, output=output))
                # A streamed request's last text goes to the sink before the request is
                # handed back: whoever waits on the finish has seen all of its stream.
                self._flush_entries()
                for done in finished:
                    self._outbox.put(done)
                self._refresh_gauges()
        except BaseException as e:  # reported to the poll thread, which stops the worker
            logger.exception("engine thread failed; the worker will stop")
            self.failure = e

    def _apply_commands(self, *, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, list):
                for add in command:
                    self._apply(add)
            elif command is not None:
                self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Add | _Abort | _Watch | Compiled) -> None:
        if isinstance(command, Compiled):
            held = self._compiles.finished(command)
            if held is None:
                return  # aborted meanwhile
            if command.error is not None:
                self._outbox.put(FinishedRequest(command.request_id, error=command.error))
            else:
                self._start(held)
            return
        if isinstance(command, _Abort | _Watch) and (
                held := self._compiles.held(command.request_id)) is not None:
            if isinstance(command, _Abort):
                self._compiles.release(command.request_id)
                self._outbox.put(FinishedRequest(command.request_id, aborted=True))
            elif held.n == 1:  # watched: streams from its first token
                self._compiles.replace(command.request_id, replace(held, stream=True))
            return
        if isinstance(command, _Watch):
            # Text streams for one choice; n choices come whole with the result.
            if (command.request_id in self._live_ids
                    and command.request_id not in self._choices
                    and command.request_id not in self._num_published_chars):
                self._start_streaming(command.request_id)
            return
        if isinstance(command, _Abort):
            if command.request_id in self._choices:
                self._abort_choices(command.request_id)
            elif command.request_id in self._live_ids:
                self.engine.abort(command.request_id)
                self._live_ids.discard(command.request_id)
                self._forget_text(command.request_id)
                self._outbox.put(FinishedRequest(command.request_id, aborted=True))
            return
        key = grammar_key(command.params)
        if key is not None and not self._compiles.is_compiled(key):
            self._compiles.hold(command.request_id, command, command.params, key)
            return
        self._start(command)

    def _start(self, command: _Add) -> None:
        if command.n > 1:
            self._add_choices(command)
            return
        self._add_one(command)

    def _add_one(self, command: _Add) -> bool:
        """Put one engine request in; False (its FinishedRequest sent) when refused."""
        # Only what is set: an embedding engine (same loop) takes neither tools nor kwargs.
        extras: dict[str, Any] = {}
        if command.tools:
            extras["tools"] = command.tools
        if command.template_kwargs:
            extras["chat_template_kwargs"] = command.template_kwargs
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    priority=command.priority, deadline=command.deadline,
                                    tenant=command.tenant,
                                    tenant_weight=command.tenant_weight, **extras)
        except ValueError as e:
            # Bad input for this request only (too long a prompt, unknown template...).
            if command.request_id in self._choice_of:
                self._choice_failed(command.request_id, str(e))
            else:
                self._outbox.put(FinishedRequest(command.request_id, error=str(e)))
            return False
        self._live_ids.add(command.request_id)
        self._num_emitted_chars[command.request_id] = 0
        if command.stream:
            self._start_streaming(command.request_id)
        return True

    def _add_choices(self, command: _Add) -> None:
        ids = [command.request_id] + [f"{command.request_id}#{i}" for i in range(1, command.n)]
        self._choices[command.request_id] = _Choices(command, pending=ids[1:])
        for choice_id in ids:
            self._choice_of[choice_id] = command.request_id
        self._add_one(command)

    def _start_pending_choices(self, request_id: str) -> None:
        """Put the other choices in: choice 0's prompt blocks are in the pool now."""
        group = self._choices[request_id]
        pending, group.pending = group.pending, []
        for index, choice_id in enumerate(pending, start=1):
            params = group.add.params
            # A seeded request stays reproducible, each choice with its own draw.
            seed = None if params.seed is None else params.seed + index
            if not self._add_one(replace(group.add, request_id=choice_id,
                                         params=replace(params, seed=seed), n=1)):
                return

    def _note_choice(self, output: RequestOutput) -> None:
        request_id = self._choice_of[output.request_id]
        group = self._choices[request_id]
        if group.pending and output.request_id == request_id:
            self._start_pending_choices(request_id)
            if request_id not in self._choices:
                return  # a choice was refused: the request failed whole
        if output.finished:
            self._live_ids.discard(output.request_id)
            group.outputs[output.request_id] = output
            self._finish_choices_if_done(request_id)

    def _choice_failed(self, choice_id: str, error: str) -> None:
        request_id = self._choice_of[choice_id]
        group = self._choices[request_id]
        group.error = group.error or error
        group.pending = []
        for other in [c for c, r in self._choice_of.items() if r == request_id]:
            if other in self._live_ids:
                self.engine.abort(other)
                self._live_ids.discard(other)
                self._forget_text(other)
        self._finish_choices_if_done(request_id, failed=True)

    def _abort_choices(self, request_id: str) -> None:
        for choice_id in [c for c, r in self._choice_of.items() if r == request_id]:
            if choice_id in self._live_ids:
                self.engine.abort(choice_id)
                self._live_ids.discard(choice_id)
                self._forget_text(choice_id)
            self._choice_of.pop(choice_id, None)
        self._choices.pop(request_id, None)
        self._outbox.put(FinishedRequest(request_id, aborted=True))

    def _finish_choices_if_done(self, request_id: str, *, failed: bool = False) -> None:
        group = self._choices[request_id]
        n = group.add.n
        if not failed and (group.pending or len(group.outputs) < n):
            return
        ids = [request_id] + [f"{request_id}#{i}" for i in range(1, n)]
        for choice_id in ids:
            self._choice_of.pop(choice_id, None)
        del self._choices[request_id]
        if group.error is not None:
            self._outbox.put(FinishedRequest(request_id, error=group.error))
            return
        choices = [group.outputs[choice_id] for choice_id in ids]
        self._outbox.put(FinishedRequest(request_id, output=choices[0], choices=choices))

    def _start_streaming(self, request_id: str) -> None:
        self._num_published_chars[request_id] = 0
        self._entries.append(StreamEntry(request_id, event=STARTED))

    def _note_text(self, output: RequestOutput) -> None:
        """Count the text a request handed out; for a watched one, queue what is new.

        Every request is counted (one dict update), so one watched late gets its text so
        far in its first entry: `output.text[:emitted]` is everything handed out, as the
        detokenizer hands out text only ever appended to (a stop string is trimmed from
        text held back, never from text handed out).
        """
        request_id = output.request_id
        # An embedding engine's outputs (same loop, duck-typed) carry no text.
        delta_text: str = getattr(output, "delta_text", "")
        emitted = self._num_emitted_chars.get(request_id, 0) + len(delta_text)
        self._num_emitted_chars[request_id] = emitted
        published = self._num_published_chars.get(request_id)
        if published is not None:
            text = output.text[published:emitted] if emitted > published else ""
            finish_reason = output.finish_reason if output.finished else None
            if text or finish_reason is not None:
                self._entries.append(StreamEntry(request_id, offset=published, text=text,
                                                 finish_reason=finish_reason))
                self._num_published_chars[request_id] = published + len(text)
        if output.finished:
            self._forget_text(request_id)

    def _forget_text(self, request_id: str) -> None:
        self._num_emitted_chars.pop(request_id, None)
        self._num_published_chars.pop(request_id, None)

    def _flush_entries(self) -> None:
        """Hand this step's entries to the sink in one call (none: nothing is done)."""
        if not self._entries:
            return
        entries, self._entries = self._entries, []
        if self.token_sink is not None:
            self.token_sink(entries)

    def _refresh_gauges(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_at < STATS_INTERVAL_S:
            return
        stats = self.engine.stats(work_left=False)
        metrics.ENGINE_RUNNING_SEQS.set(stats.num_running)
        metrics.ENGINE_WAITING_SEQS.set(stats.num_waiting)
        num_blocks = stats.num_kv_blocks_used + stats.num_kv_blocks_free
        metrics.KV_CACHE_USAGE.set(stats.num_kv_blocks_used / num_blocks if num_blocks else 0.0)
        last = self._last_stats
        if last is not None:
            elapsed = now - self._last_stats_at
            generated = stats.num_generated_tokens - last.num_generated_tokens
            metrics.ENGINE_TOKENS_PER_SECOND.set(generated / elapsed if elapsed > 0 else 0.0)
            hits = stats.num_prefix_cache_hit_tokens - last.num_prefix_cache_hit_tokens
            metrics.PREFIX_CACHE_HIT_TOKENS.inc(max(0, hits))
            metrics.ENGINE_PREEMPTIONS.inc(max(0, stats.num_preemptions - last.num_preemptions))
        else:
            metrics.PREFIX_CACHE_HIT_TOKENS.inc(stats.num_prefix_cache_hit_tokens)
            metrics.ENGINE_PREEMPTIONS.inc(stats.num_preemptions)
        self._last_stats, self._last_stats_at = stats, now
