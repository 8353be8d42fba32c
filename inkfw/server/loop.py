"""One engine loop in a background thread, fed by a queue (docs/design.md §5).

HTTP handlers never touch the engine. They :meth:`EngineLoop.submit` a :class:`Submission`
with a :class:`Ticket` and read :class:`Event` objects from the ticket's asyncio queue;
:meth:`EngineLoop.abort` cancels a ticket (a client that went away). The loop thread:

1. takes every command waiting in the queue: new requests are added to the engine, so they
   join the running batch at the next step (continuous batching), and aborted ones are
   removed from the engine at once, which frees their KV blocks before the next step;
2. runs one engine step (blocking on the queue instead while the engine is idle);
3. sends each request its new text and tokens, and the finished ones their output.

A request the engine refuses (``ConfigError`` from ``add_request``) or fails (finish reason
``error``) gets an :class:`Event` with ``error`` set; the others carry on. An exception from
the engine itself fails the requests of that step's batch and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from inkfw.errors import InkfwError
from inkfw.llm import LLM, RequestOutput, TextStream
from inkfw.server.metrics import ServerMetrics
from inkfw.speculative.engine import Request
from inkfw.speculative.sampling import SamplingParams

_ids = itertools.count(1)


@dataclass
class Submission:
    """One request as the server accepted it."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    prompt: str | None = None


@dataclass
class Event:
    """New output of one request. The last one has ``finished`` set and ``output`` (or, for a
    request that was refused or failed, ``error``)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    output: RequestOutput | None = None
    error: str | None = None
    client_error: bool = False  # the request itself was bad (vs. the engine failing it)


class Ticket:
    """A handler's end of one request: events arrive on an asyncio queue of its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.id = next(_ids)
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.received = time.perf_counter()
        self.done = False

    def push(self, event: Event) -> None:
        """Hand ``event`` to the handler (from any thread); ignored once its loop has closed."""
        if event.finished:
            self.done = True
        with contextlib.suppress(RuntimeError):  # a closed event loop: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class _Active:
    ticket: Ticket
    request: Request
    prompt: str | None
    stream: TextStream
    last_output: float
    first: bool = True


class EngineLoop:
    """Owns ``llm.engine`` from its own thread (see the module docstring)."""

    def __init__(self, llm: LLM, metrics: ServerMetrics | None = None):
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self.commands: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self.active: dict[int, _Active] = {}
        self.thread = threading.Thread(target=self._run, name="inkfw-engine-loop", daemon=True)
        self.num_steps = 0
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ handler side
    def start(self) -> None:
        if self.metrics is not None:
            self.metrics.start_from(self.engine)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left and end the thread."""
        if self.thread.is_alive():
            self.commands.put(("stop", None, None))
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stopped.is_set()

    def submit(self, submission: Submission, ticket: Ticket) -> None:
        self.commands.put(("add", submission, ticket))

    def abort(self, ticket: Ticket) -> None:
        if not ticket.done:
            self.commands.put(("abort", ticket, None))

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                if not self._take_commands(block=idle):
                    break
                if self.engine.has_unfinished():
                    self._step()
                self._record()
        finally:
            for a in list(self.active.values()):
                self._abort(a.ticket)
            self._stopped.set()

    def _take_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one first when ``block``); False on stop."""
        try:
            command = self.commands.get() if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, a, b = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(a, b)
            elif kind == "abort":
                self._abort(a)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, sub: Submission, ticket: Ticket) -> None:
        try:
            r = self.engine.add_request(
                sub.prompt_token_ids, sub.sampling, max_new_tokens=sub.max_tokens, stop=sub.stop
            )
        except InkfwError as exc:
            ticket.push(Event(finished=True, error=str(exc), client_error=True))
            return
        except Exception as exc:  # a bug: fail this request, keep serving
            traceback.print_exc(file=sys.stderr)
            ticket.push(Event(finished=True, error=f"the engine could not add the request ({exc})."))
            return
        self.active[ticket.id] = _Active(
            ticket, r, sub.prompt, TextStream(self.llm.tokenizer, sub.stop), ticket.received
        )
        if self.metrics is not None:
            self.metrics.record_admitted(len(sub.prompt_token_ids))

    def _abort(self, ticket: Ticket) -> None:
        a = self.active.pop(ticket.id, None)
        if a is None:
            return
        try:
            self.engine.abort(a.request)
        except Exception:  # the engine's state may be broken after an error
            traceback.print_exc(file=sys.stderr)
        out = RequestOutput.from_request(a.request, a.prompt)
        if self.metrics is not None:
            self.metrics.record_finished("abort", time.perf_counter() - ticket.received)
        ticket.push(Event(finished=True, output=out))

    def _step(self) -> None:
        batch = [a for a in self.active.values() if not a.request.finished]
        try:
            self.engine.step()
            self.num_steps += 1
        except Exception as exc:  # fail the requests of this step, keep serving the next ones
            traceback.print_exc(file=sys.stderr)
            message = f"the engine failed while running this request ({type(exc).__name__}: {exc})."
            for a in batch:
                self.active.pop(a.ticket.id, None)
                with contextlib.suppress(Exception):  # the engine's state may be broken
                    self.engine.abort(a.request)
                a.ticket.push(Event(finished=True, error=message))
            return
        self._emit()

    def _emit(self) -> None:
        now = time.perf_counter()
        for key, a in list(self.active.items()):
            r = a.request
            text, ids = a.stream.update(r)
            if not ids and not text and not r.finished:
                continue
            if ids and self.metrics is not None:
                self.metrics.record_output(len(ids), a.first, now - a.last_output)
            if ids:
                a.first, a.last_output = False, now
            if not r.finished:
                a.ticket.push(Event(text=text, token_ids=ids))
                continue
            del self.active[key]
            out = RequestOutput.from_request(r, a.prompt)
            if self.metrics is not None:
                self.metrics.record_finished(out.finish_reason or "unknown", now - a.ticket.received)
            error = (r.error or "the engine failed this request.") if out.finish_reason == "error" else None
            a.ticket.push(Event(text=text, token_ids=ids, finished=True, output=out, error=error))

    def _record(self) -> None:
        if self.metrics is not None:
            self.metrics.record_engine(self.engine, num_queued=self.commands.qsize())
