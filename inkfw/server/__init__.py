"""An OpenAI-compatible server over the speculative engine (``scripts/serve.py``).

:func:`~inkfw.server.app.create_app` builds the FastAPI app around an :class:`~inkfw.llm.LLM`;
:func:`~inkfw.server.run.run_server` is the whole command as a function.
"""

from inkfw.server.app import create_app
from inkfw.server.run import run_server, server_options

__all__ = ["create_app", "run_server", "server_options"]
