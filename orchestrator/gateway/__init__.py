"""The OpenAI-compatible REST gateway: the serving class and its routes (``serving``), the OpenAI wire format
(``openai_api``), tool-call parsing (``tool_calls``) and its Prometheus metrics (``metrics``)."""
