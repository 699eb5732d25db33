"""The OpenAI surface at the gateway's boundary, with a scripted drafter client (no model): nothing silently ignored
(unknown fields and fields Tandem cannot honour are 400s naming them; their neutral values pass), sampling controls
reaching the verifier's parameters, ``/v1/completions`` (text or token ids, echo, stream), vLLM's ``/tokenize`` and
``/detokenize``, and model ids with aliases. The speculative path behind them is in tests/test_gateway.py."""
import json

import httpx
import openai
import pytest

from tandem.core.messages import Constraint
from tandem.core.sampling import Sampling
from tandem.core.model_id import model_slug

from scripted_gateway import BODY, H, KEY, FakeClient

COMPLETION = {"model": "m", "prompt": "ab", "max_tokens": 3}


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"300": 1}}, "logit_bias"),  # outside the vocabulary
    ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "logit_bias.x.[key]"),
    ("/v1/chat/completions", {"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, None),  # needs logprobs: true
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
     "tools.0.function.name"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "parallel_tool_calls": False}, None),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "1"}]}, "messages.0"),  # no tool_call_id
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages.0.name"),
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"top_k": -2}, "top_k"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),  # no schema
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"suffix": "}"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"logprobs": 2, "echo": True}, None),  # no prompt logprobs
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"messages": BODY["messages"]}, "messages"),
])
def test_fields_that_cannot_be_honoured_are_400s_naming_them(serve_app, path, extra, param):
    client = FakeClient()
    url = serve_app(client)
    body = {**(BODY if "chat" in path else COMPLETION), **extra}
    r = httpx.post(url + path, json=body, headers=H)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert not client.calls  # refused before any generation


def test_neutral_values_pass_and_sampling_controls_reach_the_verifier(serve_app):
    client = FakeClient()
    url = serve_app(client)
    neutral = {"logprobs": False, "tool_choice": "none", "response_format": {"type": "text"},  # text: no grammar
               "user": "u-1", "parallel_tool_calls": True}
    r = httpx.post(url + "/v1/chat/completions", json={**BODY, **neutral, "temperature": 0.7, "top_k": 40,
                                                       "min_p": 0.05, "top_p": 0.9, "seed": 3,
                                                       "presence_penalty": 0.5, "frequency_penalty": -0.25,
                                                       "repetition_penalty": 1.1, "logit_bias": {"7": -5, "2": 3}},
                   headers=H)
    assert r.status_code == 200, r.text
    assert client.calls[-1]["sampling"] == Sampling(0.7, top_k=40, top_p=0.9, seed=3, min_p=0.05,
                                                    presence_penalty=0.5, frequency_penalty=-0.25,
                                                    repetition_penalty=1.1, logit_bias=((2, 3.0), (7, -5.0)))
    r = httpx.post(url + "/v1/chat/completions", json={**BODY, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}}, headers=H)
    assert r.status_code == 200 and client.calls[-1]["constraint"] == Constraint(json_schema='{"type": "object"}')
    httpx.post(url + "/v1/chat/completions", json={**BODY, "response_format": {"type": "json_object"}}, headers=H)
    assert client.calls[-1]["constraint"] == Constraint(json_object=True)
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "top_k": -1, "suffix": None, "echo": False},
                   headers=H)
    assert r.status_code == 200 and client.calls[-1]["sampling"].top_k == 0  # vLLM's -1: off


def test_completions_through_the_official_client(serve_app):
    client = FakeClient()
    url = serve_app(client)
    oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = oai.completions.create(model="m", prompt="ab", max_tokens=3, echo=True)
    assert r.object == "text_completion" and r.choices[0].text == "abxxx" and r.choices[0].finish_reason == "length"
    assert client.calls[-1]["prompt"] == [97, 98] and r.usage.completion_tokens == 3
    r = oai.completions.create(model="m", prompt=[104, 105], max_tokens=2, echo=True)  # token ids
    assert client.calls[-1]["prompt"] == [104, 105] and r.choices[0].text == "hixx"
    oai.completions.create(model="m", prompt="ab")
    assert client.calls[-1]["max_new_tokens"] == 16  # OpenAI's default for completions
    chunks = list(oai.completions.create(model="m", prompt=[[99]], max_tokens=4, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "xxxx"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        oai.completions.create(model="m", prompt=[1, 300], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-17", prompt="a", max_tokens=2)


def test_logprobs_shapes(serve_app):
    """The verifier's logprobs in each API's shape (values come from the verifier; tests/test_gateway.py checks
    them against target-only decoding)."""
    client = FakeClient()
    url = serve_app(client)
    oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = oai.chat.completions.create(model="m", messages=BODY["messages"], max_tokens=3, logprobs=True,
                                    top_logprobs=2)
    assert client.calls[-1]["top_logprobs"] == 2
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["x"] * 3 and content[0].logprob == -0.5 and content[0].bytes == [120]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("x", -0.5), ("y", -1.5)]
    chunks = list(oai.chat.completions.create(model="m", messages=BODY["messages"], max_tokens=4, logprobs=True,
                                              stream=True))
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == 4
    r = oai.completions.create(model="m", prompt="ab", max_tokens=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["x"] * 3 and lp.token_logprobs == [-0.5] * 3 and lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs[0] == {"x": -0.5, "y": -1.5}
    oai.chat.completions.create(model="m", messages=BODY["messages"], max_tokens=3)
    assert client.calls[-1]["top_logprobs"] is None  # not asked: not computed


def test_a_conversation_the_template_refuses_is_a_400(serve_app):
    from tandem.core.chat_template import TemplateError

    class Strict(FakeClient):
        def prompt_tokens(self, messages):
            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    client = Strict()
    url = serve_app(client)
    r = httpx.post(url + "/v1/chat/completions", json=BODY, headers=H)
    assert r.status_code == 400 and "must alternate" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages" and not client.calls
    t = httpx.post(url + "/tokenize", json={"messages": BODY["messages"]}, headers=H)
    assert t.status_code == 400 and "must alternate" in t.text


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
SCRIPT = ["Let me ", "check.\n<tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_',
          'call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>']


def test_tool_calls_through_the_official_client(serve_app):
    """Tools reach the chat template; the model's <tool_call> blocks come back as OpenAI tool calls, whole and
    streamed; the tool's answer goes back as a role "tool" message."""
    client = FakeClient(script=SCRIPT)
    url = serve_app(client)
    oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = oai.chat.completions.create(model="m", messages=BODY["messages"], tools=[WEATHER], max_tokens=64)
    assert client.rendered[-1][1] == [WEATHER]  # offered to the template as OpenAI function definitions
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    chunks = list(oai.chat.completions.create(model="m", messages=BODY["messages"], tools=[WEATHER],
                                              max_tokens=64, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas).strip() == "Let me check."  # text between calls too
    streamed = [t for d in deltas for t in (d.tool_calls or [])]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_weather", {"city": "Oslo"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the conversation continues with the call and the tool's answer
    history = BODY["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C, sunny"}]
    oai.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=8)
    rendered = client.rendered[-1][0]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # objects, as templates want
    assert rendered[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": calls[0].id}
    # tool_choice "none": tools are not offered, and text stays text
    r = oai.chat.completions.create(model="m", messages=BODY["messages"], tools=[WEATHER], tool_choice="none")
    assert client.rendered[-1][1] is None and r.choices[0].finish_reason == "stop"
    assert "<tool_call>" in r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_tokenize_and_detokenize(serve_app):
    url = serve_app(FakeClient())
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 401  # keys, like /v1
    r = httpx.post(url + "/tokenize", json={"model": "m", "prompt": "hé"}, headers=H).json()
    assert r["tokens"] == list("hé".encode()) and r["count"] == 3 and r["max_model_len"] == 4096
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, headers=H).json() == {"prompt": "hé"}
    assert httpx.post(url + "/tokenize", json={"prompt": "a", "messages": BODY["messages"]},
                      headers=H).status_code == 400  # exactly one of the two
    bad = httpx.post(url + "/detokenize", json={"tokens": [1, -1]}, headers=H)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/detokenize", json={"model": "x", "tokens": [1]}, headers=H).status_code == 404


def test_model_ids_aliases_and_metadata(serve_app):
    url = serve_app(FakeClient(), model_name="coder", aliases=("coder-latest",))
    data = httpx.get(url + "/v1/models", headers=H).json()["data"]
    assert [m["id"] for m in data] == ["coder", "coder-latest"]
    assert all(m["created"] > 1_700_000_000 and m["max_model_len"] == 4096 and m["root"] == "m" for m in data)
    r = httpx.post(url + "/v1/chat/completions", json={**BODY, "model": "coder-latest"}, headers=H)
    assert r.status_code == 200 and r.json()["model"] == "coder"  # answers name the served id
    assert httpx.post(url + "/v1/chat/completions", json=BODY, headers=H).status_code == 404


@pytest.mark.parametrize("identity, slug", [
    ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf (qwen2 1.5B Q4_K - Medium)", "qwen2.5-coder-1.5b-instruct-q4_k_m"),
    ("Qwen2.5-7B-Instruct (qwen2, torch bfloat16)", "qwen2.5-7b-instruct"),
    ("/models/Llama-3.gguf", "llama-3"),
    ("m", "m"),
])
def test_model_slug(identity, slug):
    assert model_slug(identity) == slug


IGNORED = {"store": True, "metadata": {"app": "notes", "user_tier": "free"}, "service_tier": "auto",
           "user": "u-7", "safety_identifier": "hash-of-u-7", "prompt_cache_key": "notes-v1",
           "parallel_tool_calls": True, "stream_options": None, "modalities": ["text"]}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bookkeeping_fields_the_sdks_send_are_accepted_and_change_nothing(serve_app, path):
    from tandem.orchestrator.gateway.openai_api import IGNORED as DOCUMENTED
    assert set(DOCUMENTED) <= set(IGNORED)  # every field the gateway ignores is tried here ...
    from pathlib import Path
    rest_md = (Path(__file__).parents[1] / "docs" / "rest.md").read_text()
    assert all(f"`{name}`" in rest_md for name in DOCUMENTED)  # ... and listed for users
    client = FakeClient()
    url = serve_app(client)
    body = BODY if "chat" in path else COMPLETION
    assert httpx.post(url + path, json=body, headers=H).status_code == 200
    plain = client.calls[-1]
    ignored = IGNORED if "chat" in path else {k: v for k, v in IGNORED.items() if k != "parallel_tool_calls"}
    r = httpx.post(url + path, json={**body, **ignored}, headers=H)
    assert r.status_code == 200, r.text
    assert client.calls[-1] == plain  # the generation asked of the verifier is the same
    for bad in ({"metadata": "not an object"}, {"store": "sometimes"}, {"modalities": ["text", "audio"]}):
        r = httpx.post(url + path, json={**body, **bad}, headers=H)  # ignored, yet still type-checked
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text
    for changes_the_output in ({"reasoning_effort": "high"}, {"verbosity": "low"}, {"audio": {"voice": "x"}}):
        r = httpx.post(url + path, json={**body, **changes_the_output}, headers=H)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(changes_the_output))


def test_the_official_client_with_the_fields_it_sends(serve_app):
    client = FakeClient()
    url = serve_app(client)
    oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = oai.chat.completions.create(model="m", messages=BODY["messages"], max_tokens=2, store=False,
                                    metadata={"k": "v"}, service_tier="auto", user="u", parallel_tool_calls=True)
    assert r.choices[0].message.content == "xx"
    assert oai.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError, match="gpt-17"):
        oai.models.retrieve("gpt-17")


def test_every_error_is_openai_shaped(serve_app):
    """Unknown routes, wrong methods, bodies that are not JSON: the same {"error": {...}} every SDK parses."""
    client = FakeClient()
    url = serve_app(client)
    shape = {"message", "type", "param", "code"}
    for method, path, headers in (("GET", "/nope", {}), ("POST", "/nope", {}), ("GET", "/v1/nope", H),
                                  ("GET", "/v1/chat/completions/x", H)):
        r = httpx.request(method, url + path, headers=headers)
        assert r.status_code == 404 and set(r.json()["error"]) == shape, r.text
        assert r.json()["error"]["code"] == "not_found" and path in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/chat/completions", headers=H)
    assert r.status_code == 405 and set(r.json()["error"]) == shape and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    for raw in (b'{"model": "m", "messages": [}', b"not json at all", b'{"model": "m",'):
        r = httpx.post(url + "/v1/chat/completions", content=raw, headers={**H, "Content-Type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and set(err) == shape and err["code"] == "invalid_json", r.text
        assert err["param"] is None and "not valid JSON" in err["message"] and "at byte" in err["message"]
    r = httpx.post(url + "/v1/chat/completions", json=["a", "list"], headers=H)
    assert r.status_code == 400 and set(r.json()["error"]) == shape
    assert not client.calls


def test_health_and_one_model(serve_app):
    client = FakeClient()
    url = serve_app(client, model_name="coder", aliases=("coder-latest",), identity_ttl_s=0.0)
    assert httpx.get(url + "/health").status_code == 200  # no key: a probe, like /healthz
    client.up = False
    down = httpx.get(url + "/health")
    assert down.status_code == 503 and down.json()["error"]["code"] == "verifier_unavailable"
    assert httpx.get(url + "/healthz").status_code == 200  # the process itself is alive
    client.up = True
    assert httpx.get(url + "/v1/models/coder").status_code == 401  # keys, like /v1/models
    one = httpx.get(url + "/v1/models/coder-latest", headers=H).json()
    assert one["id"] == "coder-latest" and one["object"] == "model" and one["root"] == "m"
    assert one == next(m for m in httpx.get(url + "/v1/models", headers=H).json()["data"] if m["id"] == one["id"])
    r = httpx.get(url + "/v1/models/Qwen/Qwen2.5-7B", headers=H)  # ids may hold slashes
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
