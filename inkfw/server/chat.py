"""Chat messages -> prompt text.

A checkpoint that ships a chat template (``chat_template.jinja``, or the ``chat_template`` of
``tokenizer_config.json``, as Hugging Face checkpoints do) is rendered with it (Jinja, with
``messages``, ``add_generation_prompt=True``, ``bos_token`` and ``eos_token``). Otherwise the
plain template is used: every message as ``"<role>: <content>\\n\\n"``, then ``"assistant:"``.
For example ``[{"role": "user", "content": "Hi"}]`` becomes ``"user: Hi\\n\\nassistant:"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inkfw.errors import CheckpointError

PLAIN_ASSISTANT_PREFIX = "assistant:"


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The plain template (see the module docstring)."""
    return "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + PLAIN_ASSISTANT_PREFIX


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<eos>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """Renders chat messages as the checkpoint's template, or the plain one."""

    def __init__(self, source: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = None
        if source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(source)

    @classmethod
    def from_checkpoint(cls, path: str | Path | None) -> ChatTemplate:
        """The template a checkpoint directory ships, else the plain one."""
        if path is None:
            return cls()
        path = Path(path)
        jinja_file = path / "chat_template.jinja"
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{config_file}: not a readable JSON file ({exc}).") from exc
        source = None
        if jinja_file.is_file():
            source = jinja_file.read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    @property
    def is_plain(self) -> bool:
        return self._template is None

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            return plain_chat_prompt(messages)
        return self._template.render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
        )
