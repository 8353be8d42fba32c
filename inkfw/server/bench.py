"""A bounded load run against the server on loopback (``scripts/bench_server.py``).

For each drafter of ``bench.drafters`` (e.g. ``mtp`` vs ``none``, plain decoding) the engine is
built, served on a free 127.0.0.1 port, warmed up with one request, and then, for every
concurrency of ``bench.concurrency``, ``bench.num_requests`` streaming completions are sent
with at most that many in flight (httpx). Per level it reports requests/s, output tokens/s,
p50/p99 time to first token, p50/p99 inter-token latency (the gap between successive streamed
chunks; with speculative decoding one chunk may hold several tokens) and p50 time per output
token ((last - first token time) / (tokens - 1)), all measured by the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict
from rich.console import Console
from rich.table import Table

from inkfw.errors import ConfigError
from inkfw.llm import LLM
from inkfw.options import int_option, is_int
from inkfw.presets import plain
from inkfw.speculative.factory import build_engine, serving_config


@dataclass
class RequestTiming:
    ttft_s: float
    gaps_s: list[float]
    num_tokens: int
    latency_s: float


@dataclass
class LevelResult:
    drafter: str
    concurrency: int
    num_requests: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    tpot_p50_s: float
    mean_acceptance_length: float | None


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs`` by linear interpolation (0.0 for no values)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def load_prompts(path: str | Path | None, count: int) -> list[str]:
    """``count`` prompts cycled from a prompts file's ``{"prompt": ...}`` lines."""
    if not path:
        raise ConfigError('bench.prompts_file is required (JSON lines with {"prompt": "..."}).')
    file = Path(str(path))
    if not file.is_file():
        raise ConfigError(f"bench.prompts_file={file}: file not found.")
    texts = [json.loads(line)["prompt"] for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise ConfigError(f"bench.prompts_file={file} holds no prompts.")
    return [texts[i % len(texts)] for i in range(count)]


async def _one(client, url: str, prompt: str, max_tokens: int) -> RequestTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    times: list[float] = []
    num_tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"the server answered {resp.status_code}: {await resp.aread()!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            ids = chunk["choices"][0].get("token_ids") or []
            if ids:
                times.append(time.perf_counter())
                num_tokens += len(ids)
    end = time.perf_counter()
    if not times:
        return RequestTiming(end - t0, [], 0, end - t0)
    return RequestTiming(times[0] - t0, [b - a for a, b in zip(times, times[1:])], num_tokens, end - t0)


async def _level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[list[RequestTiming], float]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def bounded(prompt: str) -> RequestTiming:
            async with gate:
                return await _one(client, url, prompt, max_tokens)

        t0 = time.perf_counter()
        timings = await asyncio.gather(*(bounded(p) for p in prompts))
        return list(timings), time.perf_counter() - t0


def _summary(
    drafter: str, concurrency: int, timings: list[RequestTiming], wall: float, tau: float | None
) -> LevelResult:
    ttfts = [t.ttft_s for t in timings]
    gaps = [g for t in timings for g in t.gaps_s]
    tpots = [(t.latency_s - t.ttft_s) / (t.num_tokens - 1) for t in timings if t.num_tokens > 1]
    tokens = sum(t.num_tokens for t in timings)
    return LevelResult(
        drafter,
        concurrency,
        len(timings),
        wall,
        len(timings) / wall,
        tokens / wall,
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
        percentile(gaps, 0.5),
        percentile(gaps, 0.99),
        percentile(tpots, 0.5) if tpots else 0.0,
        tau,
    )


def _options(cfg: Any) -> tuple[list[str], list[int], int, int]:
    b = cfg.get("bench") or {}
    drafters = list(plain(b.get("drafters")) or [])
    levels = list(plain(b.get("concurrency")) or [])
    n: Any = b.get("num_requests")
    max_tokens: Any = b.get("max_tokens")
    if not drafters or not all(isinstance(d, str) for d in drafters):
        raise ConfigError(f"bench.drafters must be a list of inkfw/conf/drafter options, got {drafters!r}.")
    if not levels or not all(is_int(c) and c >= 1 for c in levels):
        raise ConfigError(f"bench.concurrency must be a list of integers >= 1, got {levels!r}.")
    return drafters, levels, int_option(n, "bench.num_requests"), int_option(max_tokens, "bench.max_tokens")


def run_server_bench(cfg: DictConfig) -> list[LevelResult]:
    """Run the load levels of ``cfg.bench`` for every drafter; print and return the results."""
    from inkfw.server.app import create_app
    from inkfw.server.run import serve_in_thread

    drafters, levels, n, max_tokens = _options(cfg)
    prompts = load_prompts((cfg.get("bench") or {}).get("prompts_file"), n)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    console = Console(width=max(Console().width, 150))
    results: list[LevelResult] = []
    for drafter in drafters:
        variant = cfg.copy()
        with open_dict(variant):
            variant.drafter = serving_config([f"drafter={drafter}"]).drafter
        engine, tokenizer = build_engine(variant)
        if tokenizer is None:
            raise ConfigError("the server benchmark sends text prompts; the model needs a tokenizer.json.")
        llm = LLM.from_engine(engine, tokenizer, variant)
        llm.warmup()  # as scripts/serve.py does before it listens
        with serve_in_thread(create_app(llm)) as url:
            asyncio.run(_level(url, prompts[:1], 1, max_tokens))  # warm-up
            for c in levels:
                before = engine.metrics.num_steps, engine.metrics.num_accepted_tokens
                timings, wall = asyncio.run(_level(url, prompts, c, max_tokens))
                steps = engine.metrics.num_steps - before[0]
                tau = 1 + (engine.metrics.num_accepted_tokens - before[1]) / steps if steps else None
                results.append(_summary(drafter, c, timings, wall, tau))
                console.print(f"{drafter} concurrency {c}: {results[-1].requests_per_s:.2f} req/s", highlight=False)
    console.print(_table(results, cfg, max_tokens))
    out = (cfg.get("bench") or {}).get("output")
    if out:
        Path(str(out)).parent.mkdir(parents=True, exist_ok=True)
        Path(str(out)).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
        console.print(f"wrote {out}", highlight=False)
    return results


def _table(results: list[LevelResult], cfg: Any, max_tokens: int) -> Table:
    model = cfg.model.get("path") or cfg.model.get("name")
    table = Table(
        title=f"inkfw server on loopback: {model}, {results[0].num_requests if results else 0} "
        f"streamed requests of {max_tokens} tokens per level"
    )
    for col in (
        "drafter",
        "conc.",
        "req/s",
        "tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "accept. len",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.drafter,
            str(r.concurrency),
            f"{r.requests_per_s:.2f}",
            f"{r.output_tokens_per_s:.1f}",
            f"{1000 * r.ttft_p50_s:.0f} ms",
            f"{1000 * r.ttft_p99_s:.0f} ms",
            f"{1000 * r.itl_p50_s:.0f} ms",
            f"{1000 * r.itl_p99_s:.0f} ms",
            f"{1000 * r.tpot_p50_s:.1f} ms",
            f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length else "-",
        )
    return table
