"""Chat templates: the target's own Jinja template, rendered with Hugging Face's conventions in a sandbox, and
published by the verifier so the edge renders conversations the target's way (or with --chat-template)."""
from types import SimpleNamespace

import pytest

from tandem.core.chat_template import ChatTemplate, TemplateError

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source, messages, kwargs, expected", [
    (CHATML, HI, {}, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    (CHATML, HI, {"add_generation_prompt": False}, "<|im_start|>user\nhi<|im_end|>\n"),
    ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}", HI, {},
     "<s>[user]hi</s>"),
    ("{{ messages | tojson }}", [{"role": "user", "content": "é"}], {}, '[{"role": "user", "content": "é"}]'),
    ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
     HI * 3, {}, "hi"),  # loop controls, as HF enables them
    ("{% if tools %}{{ tools | length }} tools{% endif %}", HI, {"tools": [{"type": "function"}]}, "1 tools"),
])
def test_render_table(source, messages, kwargs, expected):
    assert ChatTemplate(source, "<s>", "</s>").render(messages, **kwargs) == expected


@pytest.mark.parametrize("source, fragment", [
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}",
     "a system message comes first"),
    ("{{ messages.__class__.__mro__ }}", "chat template failed"),  # the sandbox keeps Python out of reach
    ("{{ ''.__class__.__subclasses__() }}", "chat template failed"),
])
def test_refusals_are_template_errors(source, fragment):
    with pytest.raises(TemplateError, match=fragment):
        ChatTemplate(source).render(HI)


def test_a_template_that_does_not_compile():
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.models
def test_the_targets_template_matches_llama_cpp_and_adds_its_default_system_prompt(engine):
    """Jinja rendering of the target's own GGUF template equals llama.cpp's built-in ChatML where both apply (a
    conversation with a system message); without one, the template adds Qwen's default system prompt, which the
    built-in renderer used to drop (prompts were not the format the target was trained on)."""
    import ctypes

    import llama_cpp as lc

    model = engine.model
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Write a sort."}]
    keep = [(m["role"].encode(), m["content"].encode()) for m in chat]
    msgs = (lc.llama_chat_message * len(keep))(*[lc.llama_chat_message(role=r, content=c) for r, c in keep])
    buf = ctypes.create_string_buffer(4096)
    n = lc.llama_chat_apply_template(model.chat_template.encode(), msgs, len(keep), True, buf, len(buf))
    assert model.chat_prompt(chat) == buf.raw[:n].decode()
    assert "You are Qwen, created by Alibaba Cloud" in model.chat_prompt(chat[1:2])


@pytest.mark.models
def test_the_edge_renders_with_the_verifiers_template(engine, drafter_path):
    """The verifier publishes its target's template (or --chat-template) in Health; an EdgeClient renders
    conversations with it, whatever template the drafter's own file carries."""
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.server import serve
    from tandem.core.llama_runtime import LlamaModel
    from tandem.edge.client import EdgeClient

    tok = LlamaModel(drafter_path, vocab_only=True)
    drafter = SimpleNamespace(tokenizer=tok)
    custom = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}ASSISTANT:"
    servers = []
    try:
        for template in ("", custom):
            backend = LocalBackend(engine, max_sessions=1)
            srv, port = serve(backend=backend, address="127.0.0.1:0", chat_template=template)
            servers.append((srv, backend))
            client = EdgeClient(drafter, f"127.0.0.1:{port}")
            health = client.health()
            assert health.chat_template == (template or engine.model.chat_template)
            expected = "<<user>> Hi\nASSISTANT:" if template else engine.model.chat_prompt(
                [{"role": "user", "content": "Hi"}])
            assert client.prompt_tokens([{"role": "user", "content": "Hi"}]) == tok.tokenize(expected)
            client.close()
    finally:
        for srv, backend in servers:
            srv.stop(None)
            backend.scheduler.stop()
