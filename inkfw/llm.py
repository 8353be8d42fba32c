"""The Python API: ``LLM(...).generate(...)`` over the speculative engine.

.. code-block:: python

    from inkfw import LLM, SamplingParams

    llm = LLM(model="checkpoints/inkling-tiny", mtp_depths=8)          # same options as the CLI
    outs = llm.generate(["def add(a, b):\\n"], SamplingParams(temperature=0), max_tokens=32)
    print(outs[0].text, outs[0].mean_acceptance_length)
    for delta in llm.stream("import os\\n", max_tokens=16):           # increments as they come
        print(delta.text, end="")

``LLM`` composes ``inkfw/conf/infer.yaml`` (:func:`~inkfw.speculative.factory.serving_config`, the
config ``scripts/infer.py`` uses) with its keyword options turned into Hydra overrides, and
builds the engine with :func:`~inkfw.speculative.factory.build_engine`:

* ``model``: a preset of ``inkfw/conf/model`` (``inkling-debug``) or a checkpoint directory
  (``model=inkling model.path=DIR``);
* ``mtp_depths`` -> ``mtp.depths``, ``num_speculative_tokens`` -> ``spec.num_tokens``;
* a config group given a string chooses its option (``drafter="ngram"``); a dict sets keys
  (``engine={"max_num_seqs": 4}``, ``kv={"num_blocks": 64}``); any other keyword sets that
  top-level key (``dtype="bfloat16"``, ``max_new_tokens=64``);
* ``overrides=[...]``: raw Hydra overrides, applied last (``["sampler.temperature=0.7"]``).

Every request gets its own :class:`SamplingParams` (temperature, top_k, top_p, seed); the
defaults come from ``inkfw/conf/sampler``. ``max_tokens`` and ``stop`` default to the config's
``max_new_tokens`` and ``stop``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from inkfw.errors import ConfigError
from inkfw.options import int_option
from inkfw.paths import config_dir
from inkfw.prompts import stop_strings
from inkfw.speculative.engine import Engine, Request
from inkfw.speculative.factory import build_engine, serving_config
from inkfw.speculative.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamOutput", "TextStream", "options_to_overrides"]

Prompt = str | Sequence[int]
REPLACEMENT_CHAR = "\ufffd"  # what a byte-level decoder shows for an unfinished UTF-8 sequence
_RENAMED = {"mtp_depths": "mtp.depths", "num_speculative_tokens": "spec.num_tokens"}


# ----------------------------------------------------------------------------- outputs
@dataclass
class RequestOutput:
    """One finished (or aborted / failed) request.

    ``finish_reason``: ``stop`` (EOS or a stop string), ``length`` (max_tokens or the model
    limit), ``abort`` (cancelled) or ``error`` (``error`` says why). ``text`` ends before a
    stop string that ended it; ``token_ids`` hold every token generated.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None = None
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    time_to_first_token_s: float | None = None
    latency_s: float | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 + accepted drafts / verify steps (0.0 before any step)."""
        return 1.0 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (0.0 without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def acceptance(self) -> dict[str, Any]:
        """The request's acceptance statistics (the server's ``inkfw`` field)."""
        return {
            "num_verify_steps": self.num_verify_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "time_to_first_token_s": self.time_to_first_token_s,
        }

    @classmethod
    def from_request(cls, r: Request, prompt: str | None = None) -> RequestOutput:
        ttft = r.first_token_time - r.arrival_time if r.first_token_time is not None else None
        latency = r.finish_time - r.arrival_time if r.finish_time is not None else None
        reason = r.finish_reason
        return cls(
            request_id=r.id,
            prompt=prompt,
            prompt_token_ids=list(r.prompt_token_ids),
            text=r.text,
            token_ids=list(r.output_token_ids),
            finish_reason=str(reason) if reason is not None else None,
            error=r.error,
            num_verify_steps=r.num_verify_steps,
            num_draft_tokens=r.num_draft_tokens,
            num_accepted_tokens=r.num_accepted_tokens,
            time_to_first_token_s=ttft,
            latency_s=latency,
        )


@dataclass
class StreamOutput:
    """One increment of one request: the text and token ids new since the last increment.

    ``index`` is the prompt's position in the call; the last increment of a request has
    ``finished`` True and carries the whole :class:`RequestOutput` in ``output``.
    """

    index: int
    request_id: int
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    output: RequestOutput | None = None


class TextStream:
    """Turns a request's growing output into text increments that are never taken back.

    While the request runs, the last ``len(longest stop string) - 1`` characters are held
    back (they may be the start of a stop string the final text ends before), and so is a
    trailing unfinished UTF-8 sequence. When it finishes, the rest of the final text is sent.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent_text = ""
        self.num_sent_tokens = 0

    def update(self, r: Request) -> tuple[str, list[int]]:
        """(new text, new token ids) of ``r`` since the last call."""
        ids = r.output_token_ids
        new_ids = list(ids[self.num_sent_tokens :])
        self.num_sent_tokens = len(ids)
        if self.tokenizer is None:
            return "", new_ids
        if r.finished:
            # the engine sets the final text (cut before a stop string), except for a failure
            text = self.tokenizer.decode(ids) if r.finish_reason == "error" else r.text
        else:
            text = self.tokenizer.decode(ids)
            if self.holdback:
                text = text[: max(0, len(text) - self.holdback)]
            text = text.rstrip(REPLACEMENT_CHAR)
        if len(text) <= len(self.sent_text) or not text.startswith(self.sent_text):
            return "", new_ids
        delta = text[len(self.sent_text) :]
        self.sent_text = text
        return delta, new_ids


# ----------------------------------------------------------------------------- options
def _config_groups() -> set[str]:
    """The Hydra config groups (folders of the config directory)."""
    return {p.name for p in config_dir().iterdir() if p.is_dir() and any(p.glob("*.yaml"))}


def _model_presets() -> set[str]:
    return {p.stem for p in (config_dir() / "model").glob("*.yaml")}


def _hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (strings quoted and escaped)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"option value {value!r} is not a finite number.")
        return repr(value)
    if isinstance(value, (str, Path)):
        # Hydra's quoted strings: backslashes are literal except in a run that precedes a quote,
        # an interpolation or the end, which is doubled; quotes and ``${`` are escaped
        text = re.sub(r"(\\+)(?='|\$\{|$)", lambda m: m.group(1) * 2, str(value))
        return "'" + text.replace("'", "\\'").replace("${", "\\${") + "'"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    raise ConfigError(f"option value {value!r} of type {type(value).__name__} cannot be passed to the config.")


def _flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        out: list[tuple[str, Any]] = []
        for k, v in value.items():
            out += _flatten(f"{prefix}.{k}", v)
        return out
    return [(prefix, value)]


def options_to_overrides(model: str | Path | None = None, **options: Any) -> list[str]:
    """Hydra overrides for :class:`LLM`'s keyword options (see the module docstring)."""
    groups = _config_groups()
    overrides: list[str] = []
    if model is not None:
        name = str(model)
        if name in _model_presets():
            overrides.append(f"model={name}")
        else:
            overrides += ["model=inkling", f"model.path={_hydra_value(name)}"]
    for key, value in options.items():
        key = _RENAMED.get(key, key)
        if key in groups and isinstance(value, str):
            overrides.append(f"{key}={value}")
        else:
            overrides += [f"{k}={_hydra_value(v)}" for k, v in _flatten(key, value)]
    return overrides


def request_defaults(config: Any) -> tuple[int, list[str]]:
    """(max_tokens, stop strings) of requests that give none: the config's ``max_new_tokens``
    (default 64) and ``stop``, checked (one sentence for a bad one)."""
    return int_option(config.get("max_new_tokens", 64), "max_new_tokens"), stop_strings(config.get("stop"))


# ----------------------------------------------------------------------------- the API
class LLM:
    """A speculative engine behind a small ``generate`` / ``stream`` API (module docstring)."""

    default_max_tokens: int  # max_tokens of requests that give none (the config's max_new_tokens)
    default_stop: list[str]  # stop strings of requests that give none (the config's stop)

    def __init__(self, model: str | Path | None = None, *, overrides: Sequence[str] = (), **options: Any):
        self.config: DictConfig = serving_config(options_to_overrides(model, **options) + list(overrides))
        self.default_max_tokens, self.default_stop = request_defaults(self.config)
        seed = int_option(self.config.get("seed", 0), "seed", 0)
        self.engine, self.tokenizer = build_engine(self.config)
        if self.engine.adaptive is not None:  # k is chosen by measured step costs (compiles stay lazy)
            self.warmup()
        torch.manual_seed(seed)

    @classmethod
    def from_engine(cls, engine: Engine, tokenizer=None, config: DictConfig | None = None) -> LLM:
        """An ``LLM`` around an engine built elsewhere (e.g. by ``scripts/serve.py``)."""
        llm = cls.__new__(cls)
        llm.config = config if config is not None else serving_config()
        llm.default_max_tokens, llm.default_stop = request_defaults(llm.config)
        llm.engine, llm.tokenizer = engine, tokenizer
        return llm

    def warmup(self) -> float:
        """Warm the engine up for every batch it can run, 1 .. ``engine.max_num_seqs``
        (:meth:`Engine.warmup`): compile or capture its step shapes and, with
        ``spec.num_tokens=auto``, measure the step costs adaptive k chooses by. Returns the
        seconds spent (also in ``engine.warmup_s``), 0 for an engine with nothing to warm
        (:attr:`Engine.needs_warmup`: eager at a fixed k). ``LLM(...)`` runs it with
        ``spec.num_tokens=auto``, whose choices need the costs; otherwise a compiled engine
        compiles each shape at its first use, as ``scripts/infer.py`` does. An ``LLM`` made
        :meth:`from_engine` leaves it to its caller (``scripts/serve.py`` runs it before it
        listens)."""
        if not self.engine.needs_warmup:
            return 0.0
        return self.engine.warmup(range(1, self.engine.config.max_num_seqs + 1))

    # ------------------------------------------------------------------ properties
    @property
    def model_name(self) -> str:
        """The name the server reports: the checkpoint folder's name, else the preset's."""
        node = self.config.get("model")
        path = node.get("path") if node is not None else None
        if path:
            return Path(str(path)).name
        return str(node.get("name") if node is not None else "inkfw")

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def default_sampling(self) -> SamplingParams:
        return self.engine.sampler.defaults

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a text or token-id prompt; bad input -> ConfigError."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(
                    "a text prompt needs a tokenizer, but the model has no tokenizer.json; pass token ids instead."
                )
            return prompt, list(self.tokenizer.encode(prompt).ids)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.reshape(-1).tolist()
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ConfigError("a prompt must be a string or a list of integer token ids.")
        return None, ids

    def _normalise(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, torch.Tensor):
            rows = prompts.tolist()
            return [rows] if prompts.dim() == 1 else list(rows)
        items: list[Any] = list(prompts)
        if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return [items]  # one token-id prompt
        return items

    def _params(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ConfigError(f"give one SamplingParams or a list of {n} (one per prompt), got {len(params)}.")
        return params

    def add_requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        max_tokens: int | None = None,
        stop: Sequence[str] | str | None = None,
    ) -> list[tuple[str | None, Request]]:
        """Queue ``prompts`` on the engine; all or none (bad input raises ConfigError)."""
        items = self._normalise(prompts)
        params = self._params(sampling_params, len(items))
        max_tokens = self.default_max_tokens if max_tokens is None else int_option(max_tokens, "max_tokens")
        stop_list = self.default_stop if stop is None else stop_strings(stop)
        if stop_list and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer, but the model has no tokenizer.json.")
        encoded = [self.encode(p) for p in items]
        added: list[tuple[str | None, Request]] = []
        try:
            for (text, ids), p in zip(encoded, params):
                added.append((text, self.engine.add_request(ids, p, max_new_tokens=max_tokens, stop=stop_list)))
        except BaseException:
            for _, r in added:
                self.engine.abort(r)
            raise
        return added

    def _step(self, requests: Sequence[Request]) -> None:
        try:
            self.engine.step()
        except BaseException:
            for r in requests:
                self.engine.abort(r)
            raise

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_tokens: int | None = None,
        stop: Sequence[str] | str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a list of either), all
        batched together; one :class:`RequestOutput` per prompt, in order."""
        added = self.add_requests(prompts, sampling_params, max_tokens, stop)
        requests = [r for _, r in added]
        while any(not r.finished for r in requests):
            self._step(requests)
        return [RequestOutput.from_request(r, text) for text, r in added]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_tokens: int | None = None,
        stop: Sequence[str] | str | None = None,
    ) -> Iterator[StreamOutput]:
        """Like :meth:`generate`, but yields each request's increments after every engine step.
        Closing the iterator early aborts the requests still running."""
        added = self.add_requests(prompts, sampling_params, max_tokens, stop)
        requests = [r for _, r in added]
        stop_list = list(requests[0].stop) if requests else []
        streams = [TextStream(self.tokenizer, stop_list) for _ in requests]
        done = [False] * len(requests)
        try:
            while not all(done):
                if any(not r.finished for r in requests):
                    self._step(requests)
                for i, ((text, r), ts) in enumerate(zip(added, streams)):
                    if done[i]:
                        continue
                    delta, ids = ts.update(r)
                    if r.finished:
                        done[i] = True
                        out = RequestOutput.from_request(r, text)
                        yield StreamOutput(i, r.id, delta, ids, True, out.finish_reason, out)
                    elif ids:
                        yield StreamOutput(i, r.id, delta, ids)
        finally:
            for r in requests:
                if not r.finished:
                    self.engine.abort(r)

    def __repr__(self) -> str:
        return f"LLM(model={self.model_name!r}, max_model_len={self.max_model_len})"
