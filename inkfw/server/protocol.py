"""OpenAI request checking and response bodies.

Bad requests raise :class:`APIError`, which the app turns into OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``:

* 400 ``invalid_request_error``: malformed JSON, a value out of range (``max_tokens`` < 1,
  ``temperature`` < 0, ``top_p`` outside (0, 1], ``n`` != 1, ...), an empty prompt, a prompt at
  or over the model's limit;
* 401 ``invalid_api_key``: a missing or wrong ``Authorization: Bearer`` key;
* 404 ``model_not_found``: a ``model`` other than the one served;
* 422 ``invalid_request_error``: a value of the wrong type (``max_tokens`` not an integer,
  ``stop`` entries that are not strings, ``messages`` that are not a list of messages, ...).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from inkfw.llm import RequestOutput
from inkfw.options import is_int, is_number
from inkfw.speculative.sampling import SamplingParams

MAX_SEED = 2**64


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _wrong_type(param: str, expected: str, value: Any) -> APIError:
    return APIError(422, f"'{param}' must be {expected}, got {json.dumps(value)}.", param)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; 400 when it is not one."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}).") from exc
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object.")
    return body


def check_model(body: dict[str, Any], served: str) -> None:
    """404 for a ``model`` other than the served one (absent: the served one)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    if model != served:
        raise APIError(
            404, f"The model '{model}' does not exist; this server serves '{served}'.", "model", "model_not_found"
        )


@dataclass
class GenerationOptions:
    """What a completion or chat request asks of the engine."""

    sampling: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def _optional_number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value) or not math.isfinite(value):
        raise _wrong_type(name, "a number", value)
    return float(value)


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _wrong_type(name, "true or false", value)
    return value


def generation_options(
    body: dict[str, Any],
    defaults: SamplingParams,
    default_max_tokens: int,
    max_tokens_names: tuple[str, ...] = ("max_tokens",),
) -> GenerationOptions:
    """Sampling, length, stop and streaming options of ``body``, checked (see the module
    docstring); absent ones take the server's defaults."""
    n = body.get("n")
    if n is not None:
        if not is_int(n):
            raise _wrong_type("n", "an integer", n)
        if n != 1:
            raise APIError(400, f"only n=1 is supported, got n={n}.", "n")
    for name in ("best_of",):
        value = body.get(name)
        if value is not None and value != 1:
            raise APIError(400, f"'{name}' is not supported (only 1), got {json.dumps(value)}.", name)
    if body.get("echo"):
        raise APIError(400, "'echo' is not supported.", "echo")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise APIError(400, "log probabilities are not supported.", "logprobs")

    max_tokens = default_max_tokens
    for name in max_tokens_names:
        value = body.get(name)
        if value is None:
            continue
        if not is_int(value):
            raise _wrong_type(name, "an integer", value)
        if value < 1:
            raise APIError(400, f"'{name}' must be at least 1, got {value}.", name)
        max_tokens = value

    temperature = _optional_number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise APIError(400, f"'temperature' must be >= 0 (0: greedy), got {body['temperature']}.", "temperature")
    top_p = _optional_number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise APIError(400, f"'top_p' must lie in (0, 1], got {body['top_p']}.", "top_p")
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k):
            raise _wrong_type("top_k", "an integer", top_k)
        if top_k < -1:
            raise APIError(400, f"'top_k' must be -1, 0 (off) or a positive integer, got {top_k}.", "top_k")
        top_k = top_k if top_k > 0 else None
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise _wrong_type("seed", "an integer", seed)
        if not 0 <= seed < MAX_SEED:
            raise APIError(400, f"'seed' must lie in [0, 2**64), got {seed}.", "seed")
    sampling = SamplingParams(
        temperature=defaults.temperature if temperature is None else temperature,
        top_k=defaults.top_k if "top_k" not in body else top_k,
        top_p=defaults.top_p if top_p is None else top_p,
        seed=seed,
    )

    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list):
        if not all(isinstance(s, str) for s in stop):
            raise _wrong_type("stop", "a string or a list of strings", stop)
        stops = list(stop)
    else:
        raise _wrong_type("stop", "a string or a list of strings", stop)
    if any(s == "" for s in stops):
        raise APIError(400, "'stop' strings must not be empty.", "stop")

    stream = _optional_bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _wrong_type("stream_options", "an object", stream_options)
        include_usage = _optional_bool(stream_options, "include_usage")
    return GenerationOptions(
        sampling, max_tokens, stops, stream, include_usage, _optional_bool(body, "return_token_ids")
    )


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """The one prompt of a completion request: a string or a list of token ids."""
    if "prompt" not in body:
        raise APIError(400, "'prompt' is required.", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "the prompt is empty.", "prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "the prompt is empty.", "prompt")
        if all(is_int(t) for t in prompt):
            return list(prompt)
        if all(isinstance(p, (str, list)) for p in prompt):
            raise APIError(400, f"only one prompt per request is supported, got {len(prompt)}.", "prompt")
    raise _wrong_type("prompt", "a string or a list of token ids", prompt)


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` with string contents (text parts joined)."""
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "'messages' is required.", "messages")
    if not isinstance(messages, list):
        raise _wrong_type("messages", "a list of messages", messages)
    if not messages:
        raise APIError(400, "'messages' is empty.", "messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _wrong_type(where, "an object with a string 'role'", m)
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.content: only text parts are supported.", where)
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise _wrong_type(f"{where}.content", "a string or a list of text parts", content)
        out.append({"role": m["role"], "content": content})
    return out


# ----------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def completion_body(rid: str, model: str, out: RequestOutput, return_token_ids: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
    if return_token_ids:
        choice["prompt_token_ids"], choice["token_ids"] = out.prompt_token_ids, out.token_ids
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(len(out.prompt_token_ids), len(out.token_ids)),
        "inkfw": out.acceptance(),
    }


def chat_body(rid: str, model: str, out: RequestOutput, return_token_ids: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": None,
        "finish_reason": out.finish_reason,
    }
    if return_token_ids:
        choice["prompt_token_ids"], choice["token_ids"] = out.prompt_token_ids, out.token_ids
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(len(out.prompt_token_ids), len(out.token_ids)),
        "inkfw": out.acceptance(),
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
