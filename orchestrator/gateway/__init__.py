"""The OpenAI-compatible REST gateway: the application (``app``), the serving class (``gateway``) and its REST
routes (``serving``), its configuration (``config``), errors (``errors``) and middleware (``middleware``), the OpenAI
wire format (``openai_api``), tool-call parsing (``tool_calls``) and its Prometheus metrics (``metrics``)."""
