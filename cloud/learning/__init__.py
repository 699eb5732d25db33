"""What the drafter learns from a tenant's traffic: the target's top-k kept at opted-in positions (``teacher``),
LoRA distillation on it (``distill``), rounds per partition while the verifier is idle and the adapters they publish
(``online``), llama.cpp's adapter format (``lora_gguf``), and adapters kept across restarts (``adapter_dir``)."""
