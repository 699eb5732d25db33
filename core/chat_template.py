"""Chat templates: a conversation rendered into the target's prompt text by the target's own Jinja template.

The verifier's target defines the conversation format, so the verifier publishes its template (from the GGUF
metadata ``tokenizer.chat_template``, an HF ``tokenizer_config.json``, or ``tandem serve --chat-template FILE``)
in Health, and clients render prompts with it. Rendering follows the Hugging Face convention (``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``, ``tojson``, ``strftime_now``) in a
sandboxed Jinja environment, so a template cannot reach Python objects: it is data from the server, not code.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

from .errors import TandemError


class TemplateError(TandemError, ValueError):
    """The template cannot render this conversation (its own ``raise_exception``, or a template error)."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError as JinjaError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(
            x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
        ) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except JinjaError as e:
            raise TemplateError(f"chat template does not compile: {e}") from None
        self._jinja_error = JinjaError
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    def render(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, tools: Sequence[dict] | None = None
    ) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools else None,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except self._jinja_error as e:  # includes the sandbox's SecurityError
            raise TemplateError(f"chat template failed: {e}") from None
