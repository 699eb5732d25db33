"""The OpenAI chat-completions wire format: request validation and response shapes (pydantic), nothing else.

The gateway converts these to domain calls (``EdgeClient.generate``) at its boundary; engines never see them.
Responses carry OpenAI's ``usage`` plus Tandem's speculative statistics under ``tandem``.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.core.sampling import Sampling
from tandem.edge.client import GenerationStats
from tandem.edge.text import MAX_STOP_CHARS


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``. Unknown fields are ignored (clients send many); fields Tandem cannot honour
    (``n`` > 1, tools) are rejected with a 400 instead of being silently dropped."""
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request")
    tools: list | None = Field(None, max_length=0, description="tool calling is not supported")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings are limited to {MAX_STOP_CHARS} characters")
        return stops

    def chat_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def sampling(self) -> Sampling:
        """No seed: fresh entropy on the verifier for every session; a seed pins the output (core.sampling)."""
        return Sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed)


def error(message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def tandem_stats(s: GenerationStats) -> dict:
    """Tandem's speculative statistics, the extra field next to ``usage``."""
    return {"tau": round(s.tau, 3), "verify_forwards": s.rounds, "drafted_tokens": s.drafted_nodes,
            "accepted_tokens": s.accepted_tokens, "acceptance_by_depth": [round(a, 3) for a in s.alpha_by_depth],
            "tokens_per_s": round(s.tokens_per_s, 2), "draft_ms": round(s.draft_us / 1000, 1),
            "verify_ms": round(s.verify_us / 1000, 1), "network_ms": round(s.network_us / 1000, 1),
            "resumes": s.resumes}


def usage(s: GenerationStats) -> dict:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
            "total_tokens": s.prompt_tokens + s.generated_tokens}


def completion(cid: str, model: str, text: str, finish_reason: str, stats: GenerationStats) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(stats), "tandem": tandem_stats(stats)}


def chunk(cid: str, model: str, created: int, delta: dict | None = None, finish_reason: str | None = None,
          stats: GenerationStats | None = None) -> dict:
    """One ``chat.completion.chunk``; with ``stats`` and no delta it is the final usage chunk (empty choices)."""
    out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    if stats is not None and delta is None:
        out.update(choices=[], usage=usage(stats), tandem=tandem_stats(stats))
    else:
        out["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason, "logprobs": None}]
    return out
