"""Tiny random-weight models as GGUF files, for tests of what reads GGUFs (the ONNX export, llama.cpp)."""


def write_gguf(model, path, arch="qwen2", vocab=False):
    """The tiny model's weights as a float32 GGUF (a Qwen2 one by default), under llama.cpp's tensor names;
    ``vocab``: with a vocabulary of one-character tokens (what llama.cpp needs to load it as a model)."""
    import gguf
    cfg, sd = model.config, {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if cfg.eos_token_id is not None:
        w.add_eos_token_id(cfg.eos_token_id)
    if vocab:
        w.add_context_length(cfg.max_position_embeddings)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list([chr(0x100 + i) for i in range(cfg.vocab_size)])
        w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
        w.add_token_merges([f"{chr(0x100)} {chr(0x101)}"])  # (llama.cpp wants at least one)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, ll in names.items():
            for kind in ("weight", "bias"):
                if f"model.layers.{i}.{hf}.{kind}" in sd:
                    w.add_tensor(f"blk.{i}.{ll}.{kind}", sd[f"model.layers.{i}.{hf}.{kind}"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
