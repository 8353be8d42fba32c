"""``scripts/serve.py`` as a function: build the engine of ``inkfw/conf/serve.yaml`` and serve it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from inkfw.errors import ConfigError
from inkfw.llm import LLM, request_defaults
from inkfw.speculative.factory import build_engine


@dataclass
class ServerOptions:
    host: str
    port: int
    api_key: str | None
    model_name: str | None
    log_level: str


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def server_options(cfg: Any) -> ServerOptions:
    """The ``server`` node, checked (one sentence per bad value)."""
    node = cfg.get("server") or {}
    host = node.get("host", "127.0.0.1")
    port = node.get("port", 8000)
    api_key = node.get("api_key")
    model_name = node.get("model_name")
    log_level = node.get("log_level", "warning")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"server.host must be a host name or address, got {host!r}.")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"server.port must be an integer in [0, 65535], got {port!r}.")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ConfigError("server.api_key must be null or a non-empty string.")
    if model_name is not None and (not isinstance(model_name, str) or not model_name):
        raise ConfigError(f"server.model_name must be null or a non-empty string, got {model_name!r}.")
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"server.log_level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}.")
    return ServerOptions(host, port, api_key, model_name, log_level)


def run_server(cfg: Any) -> None:
    """Build the engine of ``cfg`` and serve it until interrupted."""
    import uvicorn

    from inkfw.server.app import create_app

    opts = server_options(cfg)
    request_defaults(cfg)  # a bad max_new_tokens or stop fails before the model loads
    engine, tokenizer = build_engine(cfg)
    llm = LLM.from_engine(engine, tokenizer, cfg)
    if engine.warmup_work:  # before listening: no request pays for compiles, nor for k chosen unmeasured
        seconds = llm.warmup()
        print(
            f"inkfw: warmed up in {seconds:.1f} s ({', '.join(engine.warmup_work)}; "
            f"batches 1-{engine.config.max_num_seqs})",
            flush=True,
        )
    app = create_app(llm, model_name=opts.model_name, api_key=opts.api_key)
    name = app.state.inkfw.model_name
    print(
        f"inkfw: serving {name!r} (max_model_len {llm.max_model_len}) at http://{opts.host}:{opts.port}/v1", flush=True
    )
    uvicorn.run(app, host=opts.host, port=opts.port, log_level=opts.log_level)


@contextmanager
def serve_in_thread(
    app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", timeout: float = 30.0
) -> Iterator[str]:
    """Serve ``app`` with uvicorn from a background thread; yields its base URL
    (``http://host:port``, a free port when ``port`` is 0) and stops it on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="inkfw-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
