"""OpenAI-compatible HTTP server over the speculative engine (FastAPI + uvicorn).

The same program as the console script ``inkfw-serve`` (:func:`inkfw.entrypoints.serve_main`)."""

from inkfw.entrypoints import serve_main

if __name__ == "__main__":
    serve_main()
