"""The OpenAI wire format (chat completions, completions, vLLM's tokenize/detokenize): request validation and
response shapes (pydantic), nothing else.

The gateway converts these to domain calls (``EdgeClient.generate``) at its boundary; engines never see them.
Responses carry OpenAI's ``usage`` plus Tandem's speculative statistics under ``tandem``.

Nothing that would change the output is silently ignored: an unknown field is a 400 naming it, and a known field
Tandem cannot honour yet (best_of, suffix) is accepted only at its neutral value (the value that changes nothing,
which some clients always send) and is otherwise a 400 naming it. The fields OpenAI's SDKs send for bookkeeping and
routing, which change nothing of the output (``IGNORED``), are accepted and ignored, as vLLM does.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tandem.core.messages import MAX_TOP_LOGPROBS, Constraint, TokenLogprobs
from tandem.core.sampling import MAX_LOGIT_BIAS, MAX_TOP_K, Sampling
from tandem.core.tenancy import MAX_SALT_CHARS
from tandem.edge.client import GenerationStats
from tandem.edge.text import MAX_STOP_CHARS


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text of an object

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v):
        try:
            ok = isinstance(json.loads(v), dict)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("function arguments must be the JSON text of an object")
        return v


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, sent back in the conversation."""
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this answers

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the 'tool_call_id' it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template(self) -> dict:
        """The message as chat templates take it (Hugging Face conventions: arguments as objects)."""
        out: dict = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: padding against length side channels, none is sent


# fields Tandem knows but cannot honour yet -> the values that change nothing (accepted, everything else is a 400)
NEUTRAL: dict[str, tuple] = {
    "best_of": (1,),
    "suffix": ("",), "functions": ([],), "function_call": ("none",), "modalities": (["text"],),
}
# fields accepted (type-checked) and ignored: OpenAI's bookkeeping and routing, nothing of the output depends on them
IGNORED = ("store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key")


class _Request(BaseModel):
    """What every generation request shares: the model, length, sampling (the verifier's warping of the target:
    temperature, top-k, top-p, min-p), stop strings and streaming."""
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K, description="0 or -1: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request")
    # IGNORED: accepted and ignored
    user: str | None = Field(None, max_length=256, description="the caller's end-user id (not used for sampling)")
    safety_identifier: str | None = Field(None, max_length=256, description="the end user's id (OpenAI's newer "
                                                                              "name of 'user'); ignored")
    store: bool | None = Field(None, description="OpenAI keeps the completion for its dashboard; ignored")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="tags for stored completions; ignored")
    service_tier: str | None = Field(None, max_length=64, description="OpenAI's processing tier; ignored")
    prompt_cache_key: str | None = Field(None, max_length=1024, description=(
        "OpenAI's cache-routing hint; ignored (the cache partition is the key's, or 'cache_salt')"))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS, description=(
        "the prompt cache partition: requests share cached prompts only with requests of the same salt (a secret "
        "a tenant gives all its keys); absent: the API key's own partition"))

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v):
        if v and any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return v

    @model_validator(mode="before")
    @classmethod
    def _neutral_only(cls, data):
        """A field we cannot honour is refused by name unless it has its neutral value; unknown fields fall to
        ``extra="forbid"``. ``null`` is neutral for all of them."""
        if isinstance(data, dict):
            data = dict(data)
            for name, neutral in NEUTRAL.items():
                if name in data:
                    value = data.pop(name)
                    if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
                        raise PydanticCustomError(
                            "unsupported_field", "'{field}' is not supported by this server (only {neutral} is)",
                            {"field": name, "neutral": json.dumps(neutral[0])})
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings are limited to {MAX_STOP_CHARS} characters")
        return stops

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens or default

    def constraint(self) -> Constraint | None:
        """Structured output the verifier enforces (chat's ``response_format``); none here."""
        return None

    def sampling(self) -> Sampling:
        """No seed: fresh entropy on the verifier for every session; a seed pins the output (core.sampling)."""
        return Sampling(temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p, seed=self.seed,
                        min_p=self.min_p, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                        logit_bias=tuple(sorted((self.logit_bias or {}).items())))


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object`` (any JSON object) or ``json_schema``: enforced by the verifier's grammar."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' goes with type 'json_schema', and only with it")
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint(json_object=True)
        if self.type == "json_schema" and self.json_schema is not None:
            return Constraint(json_schema=json.dumps(self.json_schema.json_schema))
        return None


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return self

    def wanted_logprobs(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description="'required' and a named function would need constrained decoding: not supported")
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_rules(self):
        if self.parallel_tool_calls is False and self.tools:
            raise ValueError("'parallel_tool_calls': false is not supported (the model may call several tools)")
        return self

    def chat_messages(self) -> list[dict]:
        return [m.template() for m in self.messages]

    def constraint(self) -> Constraint | None:
        return self.response_format.constraint() if self.response_format else None

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template offers the model (none with tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, as text or token ids (a batch of one is accepted in either form)."""
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _no_prompt_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("'echo' with 'logprobs' (log-probabilities of the prompt) is not supported")
        return self

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request (n = 1): send a string or a list of token ids")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a prompt, or messages rendered by the chat template."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        if self.messages is not None and not self.add_generation_prompt:
            raise ValueError("'add_generation_prompt': false is not supported (the template always adds it)")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def error(message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def tandem_stats(s: GenerationStats) -> dict:
    """Tandem's speculative statistics, the extra field next to ``usage``."""
    return {"tau": round(s.tau, 3), "verify_forwards": s.rounds, "drafted_tokens": s.drafted_nodes,
            "accepted_tokens": s.accepted_tokens, "acceptance_by_depth": [round(a, 3) for a in s.alpha_by_depth],
            "tokens_per_s": round(s.tokens_per_s, 2), "draft_ms": round(s.draft_us / 1000, 1),
            "verify_ms": round(s.verify_us / 1000, 1), "network_ms": round(s.network_us / 1000, 1),
            "resumes": s.resumes, "price_us_per_token": s.price_us_per_token, "batch_sessions": s.batch_sessions,
            **({"policy": s.policy} if s.policy else {})}


def usage(s: GenerationStats) -> dict:
    # OpenAI's prompt_tokens_details.cached_tokens: prompt tokens served from the verifier's prefix cache
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
            "total_tokens": s.prompt_tokens + s.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}


Piece = Callable[[int], bytes]  # a token's bytes (the tokenizer's)


def chat_logprobs(entries: Sequence[TokenLogprobs], piece: Piece) -> dict:
    """OpenAI's chat ``logprobs``: per token its text, bytes, log-probability and the top alternatives."""
    def one(token: int, logprob: float) -> dict:
        b = piece(token)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(b)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def text_logprobs(entries: Sequence[TokenLogprobs], piece: Piece, offset: int = 0) -> dict:
    """The completions API's ``logprobs``: tokens, their log-probabilities, top alternatives and text offsets."""
    texts = [piece(e.token).decode("utf-8", errors="replace") for e in entries]
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{piece(t).decode("utf-8", errors="replace"): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def completion(cid: str, model: str, text: str, finish_reason: str, stats: GenerationStats,
               logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    message: dict = {"role": "assistant", "content": text or (None if tool_calls else "")}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": usage(stats), "tandem": tandem_stats(stats)}


def chunk(cid: str, model: str, created: int, delta: dict | None = None, finish_reason: str | None = None,
          stats: GenerationStats | None = None, logprobs: dict | None = None) -> dict:
    """One ``chat.completion.chunk``; with ``stats`` and no delta it is the final usage chunk (empty choices)."""
    out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    if stats is not None and delta is None:
        out.update(choices=[], usage=usage(stats), tandem=tandem_stats(stats))
    else:
        out["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason, "logprobs": logprobs}]
    return out


def text_completion(cid: str, model: str, text: str, finish_reason: str, stats: GenerationStats,
                    logprobs: dict | None = None) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": usage(stats), "tandem": tandem_stats(stats)}


def text_chunk(cid: str, model: str, created: int, text: str = "", finish_reason: str | None = None,
               stats: GenerationStats | None = None, logprobs: dict | None = None) -> dict:
    """One streamed ``text_completion``; with ``stats`` it is the final usage chunk (empty choices)."""
    out = {"id": cid, "object": "text_completion", "created": created, "model": model}
    if stats is not None:
        out.update(choices=[], usage=usage(stats), tandem=tandem_stats(stats))
    else:
        out["choices"] = [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]
    return out
