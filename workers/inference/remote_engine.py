"""Engine servers (vLLM, SGLang, TGI, llama.cpp) driven over HTTP behind the engine loop's
surface, so nothing above the worker knows which engine answered.

Responsible for, on a thread of its own running an asyncio loop with one httpx client:
- keeping each server's requests open up to its concurrency, the rest waiting most
  urgent first (priority, then arrival), each on the server its affinity key ranks first
  among those up (`engine_routing`);
- a server answering 429/502/503/504 or dropping the connection: backing it off
  (Retry-After, else exponential with jitter) and sending the request again later, to it
  or another server; never failing the job for it;
- a refusal that is the request's own (400, 422, any other answer): failing the job with
  the server's message; a server silent past the timeout: failing the job;
- abort (cancel, release): cancelling the request's task, which closes its connection
  (vLLM and our API abort a request whose client went away);
- a streamed job's text relayed to its token stream as the server's chunks bring it
  (`remote_stream`), a stream cut short sent again without relaying twice;
- handing every finished, failed or aborted request back through the finished queue, as
  `EngineLoop` does, and the engine gauges.

The servers themselves (where, how to reach them, the model's card) are
`remote_servers.RemoteEngine`'s.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from core import metrics
from core.messages import JobMessage
from storage.token_streams import STARTED, StreamEntry
from workers.engine import SamplingParams
from workers.inference.engine_loop import WAKE, EngineRequest, FinishedRequest
from workers.inference.engine_routing import (
    ServerState,
    backoff_s,
    parse_retry_after,
    pick_server,
)
from workers.inference.remote_requests import (
    RemoteOutput,
    check_response,
    error_message,
    request_of,
)
from workers.inference.remote_servers import RemoteEngine
from workers.inference.remote_stream import (
    StreamAssembler,
    StreamError,
    is_streamable,
    streamed,
)
from workers.inference.sampling import Prompt

logger = logging.getLogger(__name__)

# Answers that say "not now" rather than "not this request": the request is sent again.
RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
# How often the gauges are refreshed, and the longest the loop sleeps.
STATS_INTERVAL_S = 1.0
# Seconds to open a connection before the server counts as unreachable (backed off).
CONNECT_TIMEOUT_S = 10.0
# Streams of one request cut before their finish, sent again, before its job fails.
MAX_STREAM_CUTS = 3


@dataclass(slots=True)
class _Request:
    """One job's request, waiting or running."""

    rank: int  # priority rank: 0 runs first
    seq: int  # arrival order within a rank
    request_id: str
    route_key: bytes
    path: str
    payload: dict[str, Any]
    num_attempts: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    # Asked with `stream` (remote_stream): its text handed to the token stream so far,
    # over every attempt, when the first came, and how many of its streams were cut.
    stream: bool = False
    published: str = ""
    first_token_time: float | None = None
    num_cuts: int = 0

    @property
    def order(self) -> tuple[int, int]:
        """Its place in the waiting line."""
        return self.rank, self.seq


class RemoteEngineLoop:
    """`EngineLoop`'s surface over engine servers (see the module docstring)."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine
        self.failure: BaseException | None = None
        self._outbox: queue.SimpleQueue[FinishedRequest] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="remote-engine", daemon=True)
        self._started = threading.Event()
        self._seq = itertools.count()
        # Touched on the loop's thread only.
        self._waiting: list[_Request] = []  # most urgent first
        self._running: dict[str, _Request] = {}
        self._is_stopping = False
        self._wakeup: asyncio.Event | None = None
        self._client: httpx.AsyncClient | None = None
        self._num_output_tokens = 0
        self._last_stats = (time.monotonic(), 0)
        # Streamed jobs' text, as the servers' chunks bring it (see `add`).
        self.token_sink: Callable[[list[StreamEntry]], None] | None = None

    def start(self) -> None:
        """Start the loop's thread (and its client)."""
        self._thread.start()
        self._started.wait(30)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel what runs (closing its connections) and end the thread."""
        self._call(self._stop_now)
        self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        """False once the loop's thread died of an unexpected error."""
        return self.failure is None

    def add(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int,
            *, stream: bool = False, job: JobMessage | None = None,
            tools: list[dict[str, Any]] | None = None, n: int = 1,
            tenant_weight: float = 1.0) -> None:
        """Queue `job`'s request (prompt and params were checked by the caller; the
        request carries the job's own fields, see remote_requests, `tools` and `n`
        included). A streamed job is asked with `stream` and its text goes to
        `token_sink` as the server's chunks bring it, unless it has tools, logprobs or
        more than one choice (remote_stream): then its text comes whole when the answer
        does. (`tenant_weight` is the in-process engine's: a server orders requests by
        its own policy.)"""
        if job is None:
            raise ValueError("an engine server runs jobs: pass job=")
        try:
            path, payload = request_of(job, model=self.engine.config.model,
                                       send_priority=self.engine.config.send_priority)
        except ValueError as e:
            self._outbox.put(FinishedRequest(request_id, error=str(e)))
            return
        is_streamed = stream and is_streamable(payload)
        request = _Request(priority, next(self._seq), request_id, job.affinity_key(), path,
                           streamed(payload) if is_streamed else payload, stream=is_streamed)
        if is_streamed:
            self._publish([StreamEntry(request_id, event=STARTED)])
        self._call(self._enqueue, request)

    def add_all(self, requests: Sequence[EngineRequest]) -> None:
        """Queue requests (see `add`); the dispatcher sends them by priority, and the
        server orders what it holds by its own policy."""
        for r in requests:
            self.add(r.request_id, r.prompt, r.params, r.priority, stream=r.stream,
                     job=r.job, tools=r.tools, n=r.n, tenant_weight=r.tenant_weight)

    def watch(self, request_id: str) -> None:
        """Followers of a job on an engine server get its text when it finishes."""

    def abort(self, request_id: str) -> None:
        """Abort a request; a FinishedRequest with `aborted=True` follows if it was live."""
        self._call(self._abort, request_id)

    def wake(self) -> None:
        """End a `take_finished` wait now, with nothing finished."""
        self._outbox.put(WAKE)

    def take_finished(self, timeout: float = 0.0) -> list[FinishedRequest]:
        """Everything finished since the last call; waits up to `timeout` for the first."""
        finished: list[FinishedRequest] = []
        try:
            finished.append(
                self._outbox.get(timeout=timeout) if timeout > 0 else self._outbox.get_nowait())
        except queue.Empty:
            return finished
        while True:
            try:
                finished.append(self._outbox.get_nowait())
            except queue.Empty:
                return [done for done in finished if done is not WAKE]

    def _call(self, function: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:
            pass  # the loop is closed: the worker is past its drain, nothing runs

    # --- on the loop's thread ------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as e:  # reported to the poll thread, which stops the worker
            logger.exception("engine server client failed; the worker will stop")
            self.failure = e
        finally:
            self._started.set()
            self._loop.close()

    async def _main(self) -> None:
        self._wakeup = asyncio.Event()
        timeout = httpx.Timeout(self.engine.config.timeout_s, connect=CONNECT_TIMEOUT_S)
        total = sum(server.max_concurrency for server in self.engine.servers)
        limits = httpx.Limits(max_connections=total, max_keepalive_connections=total)
        async with httpx.AsyncClient(timeout=timeout, limits=limits,
                                     headers=self.engine.headers) as client:
            self._client = client
            self._started.set()
            while not self._is_stopping:
                self._wakeup.clear()
                sleep_s = min(self._dispatch(), STATS_INTERVAL_S)
                self._refresh_gauges()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=sleep_s)
                except TimeoutError:
                    pass
            tasks = [r.task for r in self._running.values() if r.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _stop_now(self) -> None:
        self._is_stopping = True
        self._poke()

    def _poke(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _enqueue(self, request: _Request) -> None:
        bisect.insort(self._waiting, request, key=lambda r: r.order)
        self._poke()

    def _abort(self, request_id: str) -> None:
        request = self._running.pop(request_id, None)
        if request is not None and request.task is not None:
            request.task.cancel()  # closes its connection: the server stops generating
        else:
            waiting = [r for r in self._waiting if r.request_id == request_id]
            if not waiting:
                return  # finished already (its FinishedRequest is on its way)
            self._waiting.remove(waiting[0])
        self._outbox.put(FinishedRequest(request_id, aborted=True))

    def _dispatch(self) -> float:
        """Send what may go now, most urgent first; seconds until a backing-off server is
        due again (STATS_INTERVAL_S when none is)."""
        now = time.monotonic()
        kept: list[_Request] = []
        for request in self._waiting:
            server = pick_server(request.route_key, self.engine.servers, now)
            if server is None or not server.has_room:
                kept.append(request)  # waits for its server: its prefix cache is there
                continue
            server.num_running += 1
            request.task = asyncio.get_running_loop().create_task(self._send(request, server))
            self._running[request.request_id] = request
        self._waiting = kept
        due = [s.down_until - now for s in self.engine.servers if not s.is_up(now)]
        return max(min(due), 0.001) if due else STATS_INTERVAL_S

    async def _send(self, request: _Request, server: ServerState) -> None:
        assert self._client is not None
        request.num_attempts += 1
        outcome: FinishedRequest | None = None
        try:
            if request.stream:
                outcome = await self._stream(request, server)
            else:
                response = await self._client.post(server.url + request.path,
                                                   json=request.payload)
                outcome = self._outcome(request, server, response)
        except (httpx.ReadTimeout, httpx.WriteTimeout):
            outcome = FinishedRequest(request.request_id, error=(
                f"the engine server {server.url} did not answer within "
                f"{self.engine.config.timeout_s:g} s (engine_url_timeout_s)"))
        except httpx.TransportError as e:  # refused, reset, dropped: the server's trouble
            self._retry(request, server, reason="connection", detail=repr(e))
        except StreamError as e:
            outcome = FinishedRequest(request.request_id, error=str(e))
        except Exception as e:  # an answer no check foresaw: the job fails, never hangs
            logger.exception("job %s: the answer of %s could not be read", request.request_id,
                             server.url)
            outcome = FinishedRequest(request.request_id, error=(
                f"the engine server's answer could not be read: {e!r}"))
        finally:
            server.num_running -= 1
            self._poke()
        if outcome is not None and self._running.pop(request.request_id, None) is not None:
            self._outbox.put(outcome)

    def _outcome(self, request: _Request, server: ServerState,
                 response: httpx.Response) -> FinishedRequest | None:
        status = response.status_code
        if status in RETRY_STATUSES:
            self._retry(request, server, reason=str(status), detail=response.text[:200],
                        retry_after_s=parse_retry_after(response.headers.get("retry-after")))
            return None
        server.succeeded()
        try:
            payload = response.json()
        except ValueError:
            payload = None
        if status != 200:
            message = error_message(status, payload, response.text)
            logger.info("job %s refused by %s: %s", request.request_id, server.url, message)
            return FinishedRequest(request.request_id, error=message)
        try:
            output = RemoteOutput(request.request_id, check_response(payload))
        except ValueError as e:
            return FinishedRequest(request.request_id, error=str(e))
        return self._finished(output)

    def _finished(self, output: RemoteOutput) -> FinishedRequest:
        """A whole answer, finished now and counted."""
        output.metrics.finish_time = time.time()
        self._num_output_tokens += output.num_output_tokens
        return FinishedRequest(output.request_id, output=output)

    async def _stream(self, request: _Request, server: ServerState) -> FinishedRequest | None:
        """Send a streamed request and hand its text on as it comes; its outcome, or None
        when it is to be sent again.

        A stream cut before its finish (the connection dropped, or the body ended) is sent
        again like a dropped answer, at most MAX_STREAM_CUTS times. The text already handed
        on is not handed on twice, and the new answer must begin with it: one that does
        not (a sampled job's, or a server batching differently) fails the job rather
        than join two answers in the client's stream."""
        assert self._client is not None
        assembler = StreamAssembler(is_chat=request.path == "/chat/completions")
        is_streaming = False
        try:
            async with self._client.stream("POST", server.url + request.path,
                                           json=request.payload) as response:
                if response.status_code != 200 or not response.headers.get(
                        "content-type", "").startswith("text/event-stream"):
                    # A refusal, or a server that answered whole (it ignores `stream`).
                    await response.aread()
                    return self._whole_answer(request, server, response)
                server.succeeded()
                is_streaming = True
                async for line in response.aiter_lines():  # to the end: the connection is kept
                    if assembler.feed_line(line):
                        self._publish_text(request, assembler.text)
        except httpx.TransportError as e:
            if not is_streaming:
                raise  # never answered: the server's trouble, sent again as any request
            if not assembler.is_complete:
                return self._cut(request, server, detail=repr(e))
        if not assembler.is_complete:
            return self._cut(request, server, detail="the stream ended before its finish")
        output = RemoteOutput(request.request_id, check_response(assembler.answer()))
        return self._end_stream(request, output)

    def _whole_answer(self, request: _Request, server: ServerState,
                      response: httpx.Response) -> FinishedRequest | None:
        """A streamed request answered without a stream: its outcome, its text handed on."""
        outcome = self._outcome(request, server, response)
        if outcome is None or not isinstance(outcome.output, RemoteOutput):
            return outcome
        self._publish_text(request, outcome.output.text)
        self._publish_finish(request, outcome.output)
        return outcome

    def _end_stream(self, request: _Request, output: RemoteOutput) -> FinishedRequest:
        """A streamed answer come to its finish: the stream's last entry, the outcome."""
        self._publish_finish(request, output)
        return self._finished(output)

    def _publish_finish(self, request: _Request, output: RemoteOutput) -> None:
        self._publish([StreamEntry(request.request_id, offset=len(request.published),
                                   finish_reason=output.finish_reason or "stop")])
        output.metrics.first_token_time = request.first_token_time

    def _cut(self, request: _Request, server: ServerState, *,
             detail: str) -> FinishedRequest | None:
        """A stream cut before its finish: sent again (None), or failed after too many."""
        request.num_cuts += 1
        if request.num_cuts > MAX_STREAM_CUTS:
            return FinishedRequest(request.request_id, error=(
                f"the engine server {server.url} cut the stream {request.num_cuts} times "
                f"before its end ({detail})"))
        self._retry(request, server, reason="connection", detail=detail)
        return None

    def _publish_text(self, request: _Request, text: str) -> None:
        """Hand on what `text` (the answer so far) holds beyond what was handed on;
        StreamError when it does not go on from it (see `_stream`)."""
        published = request.published
        if not (text.startswith(published) or published.startswith(text)):
            raise StreamError(
                "the engine server's answer, asked again after its stream was cut, does not "
                "continue the text already streamed")
        if len(text) <= len(published):
            return
        if request.first_token_time is None:
            request.first_token_time = time.time()
        self._publish([StreamEntry(request.request_id, offset=len(published),
                                   text=text[len(published):])])
        request.published = text

    def _publish(self, entries: list[StreamEntry]) -> None:
        if self.token_sink is not None:
            self.token_sink(entries)

    def _retry(self, request: _Request, server: ServerState, *, reason: str, detail: str,
               retry_after_s: float | None = None) -> None:
        """Back `server` off and put the request back in line where it was."""
        now = time.monotonic()
        if server.is_up(now):  # the first of its requests to fail sets the back-off
            delay = backoff_s(server.num_failures + 1, base_s=self.engine.config.backoff_s,
                              max_s=self.engine.config.backoff_max_s,
                              retry_after_s=retry_after_s)
            server.failed(delay, now)
            log = logger.warning if server.num_failures == 1 else logger.info
            log("engine server %s answered %s (%s): backing off %.2f s", server.url, reason,
                detail, delay)
        metrics.ENGINE_SERVER_RETRIES.labels(reason).inc()
        if request.request_id in self._running:  # not aborted meanwhile
            del self._running[request.request_id]
            request.task = None
            bisect.insort(self._waiting, request, key=lambda r: r.order)

    def _refresh_gauges(self) -> None:
        now = time.monotonic()
        last_at, last_tokens = self._last_stats
        if now - last_at < STATS_INTERVAL_S:
            return
        metrics.ENGINE_RUNNING_SEQS.set(len(self._running))
        metrics.ENGINE_WAITING_SEQS.set(len(self._waiting))
        metrics.ENGINE_TOKENS_PER_SECOND.set(
            (self._num_output_tokens - last_tokens) / (now - last_at))
        self._last_stats = (now, self._num_output_tokens)
