"""The OpenAI-compatible HTTP app (FastAPI).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (with
``"stream": true`` as server-sent events, ending with ``data: [DONE]``), ``GET /health`` and
``GET /metrics`` (Prometheus text). Requests take ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k`` (an extension; -1 or 0: off),
``seed``, ``stop``, ``n`` (1 only) and ``stream_options.include_usage``; absent sampling
values take the server's ``inkfw/conf/sampler`` defaults (greedy), an absent ``max_tokens`` its
``max_new_tokens``. ``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids`` to
the choice (as in vLLM). Every response (in a stream: the chunk that finishes) carries an
``inkfw`` field with the request's acceptance statistics: ``num_verify_steps``,
``num_draft_tokens``, ``num_accepted_tokens``, ``mean_acceptance_length``,
``draft_acceptance_rate`` and ``time_to_first_token_s``.

A client that disconnects cancels its request (the engine frees its blocks before its next
step). With an ``api_key`` the ``/v1`` routes need ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from inkfw.llm import LLM
from inkfw.server.chat import ChatTemplate
from inkfw.server.loop import EngineLoop, Event, Submission, Ticket
from inkfw.server.metrics import ServerMetrics
from inkfw.server.protocol import (
    APIError,
    GenerationOptions,
    chat_body,
    chat_messages,
    check_model,
    completion_body,
    completion_prompt,
    generation_options,
    new_id,
    parse_body,
    sse,
    usage,
)

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks for a client that went away


class ServerState:
    """What the routes share: the model, the engine loop, metrics and options."""

    def __init__(
        self, llm: LLM, model_name: str, api_key: str | None, chat_template: ChatTemplate, metrics: ServerMetrics
    ):
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.chat_template = chat_template
        self.metrics = metrics
        self.loop = EngineLoop(llm, metrics)
        self.created = int(time.time())


def create_app(
    llm: LLM, model_name: str | None = None, api_key: str | None = None, chat_template: ChatTemplate | None = None
) -> FastAPI:
    """The app serving ``llm``'s engine under ``model_name`` (default :attr:`LLM.model_name`).
    The engine loop thread starts with the app and stops with it."""
    name = model_name or llm.model_name
    if chat_template is None:
        path = llm.config.get("model", {}).get("path") if llm.config is not None else None
        from inkfw.presets import resolve_path

        chat_template = ChatTemplate.from_checkpoint(resolve_path(path) if path else None)
    state = ServerState(llm, name, api_key or None, chat_template, ServerMetrics(name))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, state.loop.stop)

    app = FastAPI(title="inkfw", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.inkfw = state

    # ------------------------------------------------------------------ errors and auth
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    def authorize(request: Request) -> None:
        """401 unless the request brings the API key (when the server has one)."""
        if state.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), state.api_key.encode()):
            raise APIError(
                401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )

    # ------------------------------------------------------------------ plain routes
    @app.get("/health")
    async def health() -> Response:
        if not state.loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "inkfw",
                    "max_model_len": llm.max_model_len,
                }
            ],
        }

    # ------------------------------------------------------------------ generation
    def options(body: dict[str, Any], chat: bool) -> GenerationOptions:
        names = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
        return generation_options(body, llm.default_sampling, llm.default_max_tokens, names)

    def submission(prompt: str | list[int], opts: GenerationOptions) -> Submission:
        if isinstance(prompt, str):
            if llm.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send the prompt as a list of token ids.", "prompt")
            text, ids = prompt, list(llm.tokenizer.encode(prompt).ids)
        else:
            text, ids = None, prompt
        if not ids:
            raise APIError(400, "the prompt is empty (0 tokens).", "prompt")
        vocab = llm.engine.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise APIError(400, f"prompt token ids must lie in [0, {vocab}).", "prompt")
        if len(ids) >= llm.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {llm.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens (prompt + at least one new token must fit).",
                "prompt",
                "context_length_exceeded",
            )
        if opts.stop and llm.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer, but this model has none.", "stop")
        return Submission(ids, opts.sampling, opts.max_tokens, opts.stop, text)

    async def run(request: Request, sub: Submission, opts: GenerationOptions, chat: bool) -> Response:
        ticket = Ticket()
        state.loop.submit(sub, ticket)
        rid = new_id("chatcmpl" if chat else "cmpl")
        if opts.stream:
            return StreamingResponse(
                stream(ticket, rid, sub, opts, chat),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await complete(request, ticket, rid, opts, chat)

    async def complete(request: Request, ticket: Ticket, rid: str, opts: GenerationOptions, chat: bool) -> Response:
        """Wait for the request's last event, checking every DISCONNECT_POLL_S (whether or not
        events arrive meanwhile) that the client is still there."""
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    event = await asyncio.wait_for(ticket.events.get(), DISCONNECT_POLL_S)
                    if event.finished:
                        break
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() >= next_check:
                    if await request.is_disconnected():
                        state.loop.abort(ticket)
                        return Response(status_code=499)
                    next_check = time.monotonic() + DISCONNECT_POLL_S
        except asyncio.CancelledError:
            state.loop.abort(ticket)
            raise
        if event.error is not None:
            raise failed(event)
        assert event.output is not None
        make = chat_body if chat else completion_body
        return JSONResponse(make(rid, state.model_name, event.output, opts.return_token_ids))

    def failed(event: Event) -> APIError:
        if event.client_error:
            return APIError(400, event.error or "bad request.")
        return APIError(
            500, event.error or "the engine failed this request.", kind="internal_error", code="engine_error"
        )

    async def stream(
        ticket: Ticket, rid: str, sub: Submission, opts: GenerationOptions, chat: bool
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        num_tokens = 0

        def chunk(
            text: str, ids: list[int], reason: str | None, extra: dict[str, Any] | None = None, role: bool = False
        ) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
                if text and not role:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            if opts.return_token_ids:
                choice["token_ids"] = ids
            body = {"id": rid, "object": kind, "created": created, "model": state.model_name, "choices": [choice]}
            body.update(extra or {})
            return body

        try:
            if chat:
                yield sse(chunk("", [], None, role=True))
            while True:
                event = await ticket.events.get()
                if event.error is not None:
                    err = failed(event)
                    yield sse(err.body())
                    break
                num_tokens += len(event.token_ids)
                if not event.finished:
                    if event.text or (opts.return_token_ids and event.token_ids):
                        yield sse(chunk(event.text, event.token_ids, None))
                    continue
                out = event.output
                assert out is not None
                yield sse(chunk(event.text, event.token_ids, out.finish_reason, {"inkfw": out.acceptance()}))
                if opts.include_usage:
                    yield sse(
                        {
                            "id": rid,
                            "object": kind,
                            "created": created,
                            "model": state.model_name,
                            "choices": [],
                            "usage": usage(len(sub.prompt_token_ids), num_tokens),
                        }
                    )
                break
            yield sse("[DONE]")
        finally:
            if not ticket.done:  # the client went away (or the stream was closed): cancel
                state.loop.abort(ticket)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body = parse_body(await request.body())
        check_model(body, state.model_name)
        prompt = completion_prompt(body)
        opts = options(body, chat=False)
        return await run(request, submission(prompt, opts), opts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = parse_body(await request.body())
        check_model(body, state.model_name)
        messages = chat_messages(body)
        opts = options(body, chat=True)
        try:
            prompt = state.chat_template.render(messages)
        except Exception as exc:  # a template error names what is wrong with the messages
            raise APIError(400, f"the chat template failed on these messages ({exc}).", "messages") from exc
        if not prompt:
            raise APIError(400, "the chat prompt is empty.", "messages")
        return await run(request, submission(prompt, opts), opts, chat=True)

    return app
