"""The OpenAI-compatible server, driven by the real ``openai`` client over loopback.

One server (shipped checkpoint, all 8 MTP depths, an API key) runs for the module on a free
127.0.0.1 port; its greedy outputs must equal the offline ``LLM.generate`` of the same engine.
A second, small-KV server checks that an engine failure fails one request alone.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from helpers.cuda_graphs import RecordedCudaGraphs
from inkfw.errors import ConfigError
from inkfw.llm import LLM, SamplingParams
from inkfw.server.app import create_app
from inkfw.server.chat import plain_chat_prompt
from inkfw.server.run import serve_in_thread

API_KEY = "test-key"
MODEL = "inkling-tiny"
PROMPTS = [
    "def add(a, b):\n",
    "import os\n",
    'class Queue:\n    """A first-in, first-out queue."""\n\n    def __init__(self):\n',
    "for i in range(10):\n",
    "# utilities\n\ndef read_file(path):\n    with open(path) as f:\n",
    "x = [",
]
LENGTHS = (5, 12, 24)
LONG = 1500  # more tokens than any test waits for (the "import os" prompt never stops by itself)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="checkpoints/inkling-tiny", mtp_depths=8)


CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def reference(llm):
    """Offline greedy outputs {(prompt, max_tokens): RequestOutput}, computed before serving
    (the server's engine loop owns the engine while it runs)."""
    ref = {}
    for n in LENGTHS:
        for p, out in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(temperature=0.0), max_tokens=n)):
            ref[p, n] = out
    ref["chat"] = llm.generate(plain_chat_prompt(CHAT), SamplingParams(temperature=0.0), max_tokens=12)[0]
    return ref


@pytest.fixture(scope="module")
def server(llm, reference):
    app = create_app(llm, api_key=API_KEY)
    with serve_in_thread(app) as url:
        yield url, app.state.inkfw


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _metrics(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of the Prometheus text at ``url``/metrics."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in values.items():
        series, _, rest = key.partition("{")
        got = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if series == name and all(got.get(k) == v for k, v in labels.items()):
            total += value
    return total


def _wait_idle(state, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while state.loop.active or state.llm.engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- basics
def test_models_health_and_greedy_completions_equal_offline(server, client, reference):
    url, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}

    ref = reference[PROMPTS[0], 24]
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.text == ref.text and choice.model_extra["token_ids"] == ref.token_ids
    assert choice.finish_reason == ref.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 24)
    stats = r.model_extra["inkfw"]
    assert stats["num_accepted_tokens"] > 0  # the shipped depths do accept drafts
    assert stats["mean_acceptance_length"] == pytest.approx(
        1 + stats["num_accepted_tokens"] / stats["num_verify_steps"]
    )

    # streamed: the same text, in more than one piece, usage last
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == ref.text and len(texts) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert finals[0].model_extra["inkfw"]["num_verify_steps"] == stats["num_verify_steps"]

    # a token-id prompt gives the same as its text
    r = client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text


def test_chat_uses_the_plain_template_stream_and_not(server, client, reference):
    messages = CHAT
    assert plain_chat_prompt(messages) == "system: You write Python.\n\nuser: def add(a, b):\n\nassistant:"
    ref = reference["chat"]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.model_extra["inkfw"]["num_verify_steps"] > 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_sampling_options(server, client, reference):
    ref = reference[PROMPTS[1], 24]
    assert ref.text.count("import") >= 2
    stop = "import"
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref.text[: ref.text.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop, stream=True
        )
    )
    assert streamed == r.choices[0].text  # held-back text never leaks a stop string's start

    # a seed makes a sampled request reproducible; top_k=1 is greedy
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    greedy = (
        client.completions.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, extra_body={"top_k": 1}
        )
        .choices[0]
        .text
    )
    assert greedy == reference[PROMPTS[2], 24].text[: len(greedy)] and greedy


# ----------------------------------------------------------------------------- load
def test_32_concurrent_streams_complete_and_greedy_ones_are_exact(server, reference, llm):
    url, state = server
    jobs = []
    for i in range(32):
        prompt, n = PROMPTS[i % len(PROMPTS)], LENGTHS[i % len(LENGTHS)]
        greedy = i % 2 == 0
        jobs.append((prompt, n, greedy, i))

    async def one(client: AsyncOpenAI, prompt: str, n: int, greedy: bool, seed: int):
        extra = {"temperature": 0.0} if greedy else {"temperature": 0.9, "seed": seed}
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, stream=True, extra_body={"return_token_ids": True}, **extra
        )
        text, ids, reasons = "", [], []
        async for chunk in stream:
            c = chunk.choices[0]
            text += c.text
            ids += c.model_extra["token_ids"]
            reasons.append(c.finish_reason)
        return text, ids, reasons

    async def run_all():
        async with AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, *job) for job in jobs))

    results = asyncio.run(run_all())
    assert len(results) == 32
    for (prompt, n, greedy, _), (text, ids, reasons) in zip(jobs, results):
        assert reasons[-1] in ("length", "stop") and all(r is None for r in reasons[:-1])
        assert text == llm.tokenizer.decode(ids)  # every piece arrived, once, in order
        if reasons[-1] == "length":
            assert len(ids) == n
        if greedy:
            ref = reference[prompt, n]
            assert (text, ids) == (ref.text, ref.token_ids)
    _wait_idle(state)
    values = _metrics(url)
    assert _metric(values, "inkfw:num_requests_running") == 0
    assert _metric(values, "inkfw:num_requests_waiting") == 0
    # per-position acceptance adds up to the accepted tokens (docs/design.md §6)
    accepted = _metric(values, "inkfw:spec_decode_num_accepted_tokens_total")
    assert accepted > 0
    assert _metric(values, "inkfw:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert _metric(values, "inkfw:spec_decode_num_draft_tokens_total") >= accepted
    assert _metric(values, "inkfw:time_to_first_token_seconds_count") >= 32
    assert _metric(values, "inkfw:inter_token_latency_seconds_count") > 0
    assert _metric(values, "inkfw:generation_tokens_total") >= sum(len(r[1]) for r in results)


def test_a_disconnect_cancels_and_frees_the_blocks(server):
    url, state = server
    engine = state.llm.engine
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = _metric(_metrics(url), "inkfw:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": LONG, "temperature": 0, "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(3)) if line.startswith("data:")]
        assert got
        assert engine.running and not engine.kv.is_whole()  # it runs and holds blocks
    # the client has gone: the request is aborted and its blocks are free
    _wait_idle(state)
    assert engine.kv.is_whole()
    values = _metrics(url)
    assert _metric(values, "inkfw:num_requests_running") == 0
    assert _metric(values, "inkfw:kv_cache_usage_perc") == 0
    assert _metric(values, "inkfw:request_success_total", finished_reason="abort") == before + 1

    # a non-streaming client that times out is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=dict(body, stream=False), headers=headers, timeout=0.5)
    _wait_idle(state)
    assert engine.kv.is_whole()
    assert _metric(_metrics(url), "inkfw:request_success_total", finished_reason="abort") == before + 2


# ----------------------------------------------------------------------------- bad requests
BAD_REQUESTS = [
    pytest.param({"prompt": "x", "max_tokens": -3}, 400, "max_tokens", id="max_tokens-negative"),
    pytest.param({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", id="max_tokens-zero"),
    pytest.param({"prompt": "x", "max_tokens": 2.5}, 422, "max_tokens", id="max_tokens-float"),
    pytest.param({"prompt": "x", "max_tokens": "8"}, 422, "max_tokens", id="max_tokens-string"),
    pytest.param({"prompt": "x", "max_tokens": True}, 422, "max_tokens", id="max_tokens-bool"),
    pytest.param({"prompt": [7] * 3000}, 400, "prompt", id="prompt-over-limit"),
    pytest.param({"prompt": "x " * 4000}, 400, "prompt", id="text-prompt-over-limit"),
    pytest.param({"prompt": ""}, 400, "prompt", id="prompt-empty"),
    pytest.param({"prompt": []}, 400, "prompt", id="prompt-empty-list"),
    pytest.param({"model": "gpt-4", "prompt": "x"}, 404, "model", id="unknown-model"),
    pytest.param({"prompt": "x", "temperature": -0.5}, 400, "temperature", id="temperature-negative"),
    pytest.param({"prompt": "x", "stop": ["ok", 3]}, 422, "stop", id="stop-not-strings"),
    pytest.param({"prompt": "x", "stop": {"a": 1}}, 422, "stop", id="stop-object"),
    pytest.param({"prompt": "x", "n": 2}, 400, "n", id="n-2"),
    pytest.param({"prompt": "x", "top_p": 0}, 400, "top_p", id="top_p-0"),
    pytest.param({"prompt": [9999999]}, 400, "prompt", id="token-out-of-vocab"),
]


@pytest.mark.parametrize("body, status, param", BAD_REQUESTS)
def test_bad_completion_requests_get_openai_errors(server, body, status, param):
    url, _ = server
    resp = httpx.post(
        url + "/v1/completions", json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_malformed_json_auth_and_chat_errors_then_still_serving(server, client, reference):
    url, _ = server
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    resp = httpx.post(url + "/v1/completions", content=b'{"prompt": "x", ', headers=auth)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = httpx.post(url + "/v1/chat/completions", content=b"[1, 2]", headers=auth)
    assert resp.status_code == 400
    for body, status in [
        ({"messages": "hi"}, 422),
        ({"messages": []}, 400),
        ({"messages": [{"content": "x"}]}, 422),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, 400),
    ]:
        resp = httpx.post(url + "/v1/chat/completions", json=body, headers=auth)
        assert resp.status_code == status, (body, resp.text)
    resp = httpx.get(url + "/v1/nothing-here", headers=auth)
    assert resp.status_code == 404 and "error" in resp.json()

    # the API key: none or a wrong one -> 401 (the openai client raises AuthenticationError)
    assert httpx.get(url + "/v1/models").status_code == 401
    resp = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Basic " + API_KEY})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    bad = OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert httpx.get(url + "/health").status_code == 200  # health and metrics need no key
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)

    # and it keeps serving, exactly
    ref = reference[PROMPTS[3], 12]
    assert (
        client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0).choices[0].text
        == ref.text
    )


def test_an_engine_failure_fails_that_request_alone(reference):
    """A request that outgrows a 4-block KV pool fails (500 / an error event); a request
    running beside it completes exactly."""
    small = LLM(model="checkpoints/inkling-tiny", mtp_depths=8, kv={"num_blocks": 4})
    with serve_in_thread(create_app(small)) as url:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def both():
            big = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=200, temperature=0)
            ok = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
            return await asyncio.gather(big, ok, return_exceptions=True)

        big, ok = asyncio.run(both())
        assert isinstance(big, openai.InternalServerError)
        assert "KV cache blocks" in big.body["message"]
        assert ok.choices[0].text == reference[PROMPTS[0], 12].text

        # streamed: the failure arrives as an error event
        with httpx.stream(
            "POST", url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 200, "stream": True}
        ) as resp:
            events = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert "KV cache blocks" in events[-1]["error"]["message"]
        assert small.engine.kv.is_whole()


def test_serve_warms_up_before_it_listens(monkeypatch, capsys):
    """``scripts/serve.py`` with adaptive k measures its step costs at every batch it can run
    before uvicorn starts listening, and says how long that took."""
    import uvicorn

    from inkfw.server.run import run_server
    from inkfw.speculative.factory import serving_config

    served = {}

    def listen(app, **_):  # in place of uvicorn.run: what the server would serve
        served["engine"] = app.state.inkfw.llm.engine

    monkeypatch.setattr(uvicorn, "run", listen)
    cfg = serving_config(["model=inkling-debug", "spec.num_tokens=auto", "engine.max_num_seqs=2"])
    run_server(cfg)
    engine = served["engine"]
    assert engine.adaptive is not None and all(engine.adaptive.has_costs(b) for b in (1, 2))
    said = capsys.readouterr().out
    assert engine.metrics.num_steps == 0 and re.search(
        r"warmed up in \d+\.\d s \(adaptive k's step costs measured;", said
    )


def test_concurrent_streams_served_from_cuda_graphs_are_exact(monkeypatch, reference):
    """On a GPU the server replays its steps as CUDA graphs (``engine.cuda_graphs``, on there by
    default): here through the CPU stand-in that replays recorded ops without Python
    (helpers.cuda_graphs). Greedy streams arriving together, batched in buckets as they come and
    go, emit exactly the offline eager engine's tokens."""
    graphs = RecordedCudaGraphs(monkeypatch)
    captured = LLM(model="checkpoints/inkling-tiny", mtp_depths=8, engine={"cuda_graphs": True})
    assert captured.engine.cuda_graphs
    jobs = [(PROMPTS[i % len(PROMPTS)], LENGTHS[i % len(LENGTHS)]) for i in range(8)]
    with serve_in_thread(create_app(captured)) as url:

        async def run_all():
            async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
                return await asyncio.gather(
                    *(
                        client.completions.create(
                            model=MODEL, prompt=p, max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
                        )
                        for p, n in jobs
                    )
                )

        results = asyncio.run(run_all())
    for (prompt, n), result in zip(jobs, results):
        choice = result.choices[0]
        assert (choice.text, choice.model_extra["token_ids"]) == (
            reference[prompt, n].text,
            reference[prompt, n].token_ids,
        )
    assert graphs.replays > 0 and captured.engine.kv.is_whole()


def test_a_bad_default_request_option_stops_serve_before_the_model_loads(monkeypatch):
    """``scripts/serve.py max_new_tokens=abc`` served, and every request without max_tokens then
    got 64 tokens; now it is one sentence before anything is built."""
    from inkfw.server import run as server_run
    from inkfw.speculative.factory import serving_config

    def never(*_, **__):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(server_run, "build_engine", never)
    with pytest.raises(ConfigError, match=r"^max_new_tokens must be an integer >= 1, got 'abc'\.$"):
        server_run.run_server(serving_config(["model=inkling-debug", "max_new_tokens=abc"]))
