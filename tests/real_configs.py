"""The config.json files of the checkpoints users pick, as published on the Hugging Face Hub, shrunk to
tiny widths and depths: every structural flag (tied embeddings, rope type and scaling, rope theta, q/k norm,
biases, head_dim != hidden / heads, the ratio of query to KV heads, sliding windows, partial rotary, parallel
residual, the stored dtype, the key names of the format they were published in) is kept as published; only
sizes shrink. ``tiny(name, vocab)`` gives the dict to write as config.json.

The published values are facts of those files; the shrunk sizes (``SHRINK``) are ours.
"""

from __future__ import annotations

import copy

# name -> the published config.json (sizes included, as published)
PUBLISHED = {
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 128256},
    "Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 128256},
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
    "Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
        "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
        "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064},
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
    "OLMo-2-1B": {
        "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
        "attention_dropout": 0.0, "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096,
        "num_attention_heads": 16, "num_hidden_layers": 16, "num_key_value_heads": 16, "pad_token_id": 100277,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False,
        "torch_dtype": "float32", "use_cache": True, "vocab_size": 100352},
    "OLMo-2-7B": {
        "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
        "attention_dropout": 0.0, "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 100277,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False,
        "torch_dtype": "float32", "use_cache": True, "vocab_size": 100352},
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000},
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576,
        "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "max_position_embeddings": 8192,
        "mlp_bias": False, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 49152},
    "Pythia-160M": {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "bos_token_id": 0, "eos_token_id": 0,
        "hidden_act": "gelu", "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
        "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "num_attention_heads": 12,
        "num_hidden_layers": 12, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
        "torch_dtype": "float16", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304},
    # --- hybrid-attention / scaled / MoE checkpoints (published values cross-checked against copies of the
    # config.json files quoted in public code; see the notes per entry) ---
    # google/gemma-2-2b-it (bf16). The base google/gemma-2-2b is published in float32 ("torch_dtype": "float32",
    # "eos_token_id": 1), otherwise identical. No layer_types in the file: transformers alternates sliding / full
    # starting with sliding (layer 0); no tie_word_embeddings either (Gemma2Config ties by default). head_dim
    # 256 != 2304 / 8; query_pre_attn_scalar = head_dim.
    "Gemma-2-2B-it": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
        "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 256000},
    # google/gemma-3-1b-it. No layer_types and no tie_word_embeddings in the file: sliding_window_pattern 6 gives
    # 5 sliding : 1 full (layer 5, 11, ...); Gemma3TextConfig ties by default. Sliding layers rotate with
    # rope_local_base_freq 1e4, full layers with rope_theta 1e6; q/k RMSNorm; no softcapping.
    "Gemma-3-1B-it": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
        "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
        "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262144},
    # google/gemma-3-4b-it is published multimodal (Gemma3ForConditionalGeneration, "model_type": "gemma3") with
    # this text_config, which sets only these six keys and leaves the rest to Gemma3TextConfig's defaults (8 query /
    # 4 KV heads, head_dim 256, query_pre_attn_scalar 256, rope_theta 1e6, rope_local_base_freq 1e4, pattern 6,
    # vocab 262208, tied). Here it is a text-only gemma3_text / Gemma3ForCausalLM config: the text_config plus the
    # outer file's torch_dtype and eos_token_id. The linear x8 rope scaling applies to the full layers only.
    "Gemma-3-4B-it": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "eos_token_id": [1, 106],
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024, "torch_dtype": "bfloat16"},
    # allenai/Olmo-3-1025-7B: 3 sliding (window 4096) : 1 full, YaRN x8 on the full layers only (transformers puts
    # rope_scaling into rope_parameters["full_attention"]; the sliding layers keep plain rope_theta), MHA (32 KV
    # heads), q/k RMSNorm over the whole projection, post-norms. Saved by transformers >= 4.56, hence "dtype" (not
    # "torch_dtype"); bf16 (14.6 GB for 7.3B parameters). Not cross-checked: the exact key set besides the values
    # quoted here (no bos_token_id).
    "OLMo-3-7B": {
        "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "attention_bias": False,
        "attention_dropout": 0.0, "dtype": "bfloat16", "eos_token_id": 100257, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 8,
        "max_position_embeddings": 65536, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06,
        "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0, "factor": 8.0,
                         "original_max_position_embeddings": 8192, "rope_type": "yarn"},
        "rope_theta": 500000, "sliding_window": 4096, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": 100278},
    # openai/gpt-oss-20b: MoE (32 experts, 4 per token; both spellings are in the file), alternating sliding (128) /
    # full from layer 0, YaRN x32 (truncate false) on every layer, attention sinks, q/k/v/o biases, head_dim 64 !=
    # 2880 / 64. Left out: "quantization_config" ({"quant_method": "mxfp4", "modules_to_not_convert": [...]}): the
    # experts are published MXFP4, which write_model cannot produce; the file has no torch_dtype (its other tensors
    # are bf16, STORED_DTYPE).
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
        "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088},
    # CohereForAI/c4ai-command-r7b-12-2024: 3 sliding (4096, with interleaved GPT-J rope, theta 50000) : 1 full
    # layer WITHOUT positional embeddings, parallel attention + MLP block, LayerNorm, logit_scale 0.25, no q/k norm
    # (no use_qk_norm key), tied (use_embedding_sharing; no tie_word_embeddings key). No layer_types in the file:
    # sliding_window_pattern 4 -> transformers builds them. transformers ignores head_dim (hidden / heads) and the
    # Cohere-only keys (layer_switch, order_of_interleaved_layers, position_embedding_type, rotary_pct, use_*).
    # Not cross-checked: head_dim, layer_switch, use_parallel_embedding (from memory of the file).
    "Command-R7B": {
        "architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 5, "cache_implementation": "hybrid", "eos_token_id": 255001,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "layer_norm_eps": 1e-05, "layer_switch": 4, "logit_scale": 0.25,
        "max_position_embeddings": 132096, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "order_of_interleaved_layers": "local_attn_first", "pad_token_id": 0,
        "position_embedding_type": "rope_gptj", "rope_scaling": None, "rope_theta": 50000, "rotary_pct": 1.0,
        "sliding_window": 4096, "sliding_window_pattern": 4, "torch_dtype": "bfloat16", "use_cache": True,
        "use_embedding_sharing": True, "use_gated_activation": True, "use_parallel_block": True,
        "use_parallel_embedding": True, "vocab_size": 256000},
    # HuggingFaceTB/SmolLM3-3B: Llama-like, every fourth layer without RoPE (no_rope_layers: 1 = rotate, 0 = not;
    # layers 3, 7, ... 35), all layers full attention (use_sliding_window false), tied, GQA 16 : 4. Not
    # cross-checked: whether the file also lists layer_types (all "full_attention"; transformers derives them).
    "SmolLM3-3B": {
        "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": 128012, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 65536,
        "max_window_layers": 28, "mlp_bias": False, "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0] * 9,
        "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 4, "pad_token_id": 128004,
        "pretraining_tp": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 128256},
    # microsoft/Phi-4-mini-instruct: partial rotary (0.75 of head_dim 128 = 96 dims -> 48 factors each), longrope
    # in the legacy "type" spelling (short factors all 1; long factors used past original_max_position_embeddings
    # 4096; the attention factor sqrt(1 + ln 32 / ln 4096) scales cos / sin always), fused qkv_proj / gate_up_proj,
    # tied, GQA 24 : 8. (A later revision of the file has eos_token_id 200020; the auto_map entry is left out.)
    "Phi-4-mini": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 199999, "embd_pdrop": 0.0, "eos_token_id": 199999,
        "full_attn_mod": 1, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
        "intermediate_size": 8192, "interpolate_factor": 1, "lm_head_bias": False, "max_position_embeddings": 131072,
        "mlp_bias": False, "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "original_max_position_embeddings": 4096, "pad_token_id": 199999, "partial_rotary_factor": 0.75,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "long_factor": [1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
                            2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687,
                            4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894,
                            8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252, 16.37415215,
                            18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13,
                            32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16,
                            47.77],
            "short_factor": [1.0] * 48, "type": "longrope"},
        "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 200064},
    # ibm-granite/granite-3.1-2b-instruct: Llama-like with muP multipliers: embeddings x12, attention scores x 1/64
    # (= 1 / head_dim, not its square root), residual branches x0.22, logits / 8; tied; GQA 32 : 8.
    "Granite-3.1-2B": {
        "architectures": ["GraniteForCausalLM"], "model_type": "granite", "attention_bias": False,
        "attention_dropout": 0.1, "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0,
        "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 8192, "logits_scaling": 8.0, "max_position_embeddings": 131072, "mlp_bias": False,
        "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "pad_token_id": 0,
        "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 5000000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 49155},
}

# name -> the sizes of the tiny version; the ratios that matter are kept: query heads per KV head,
# head_dim != hidden / heads where the published model has it, SmolLM2's 9 query heads over 3 KV heads
SHRINK = {
    "Llama-3.2-1B": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=8),
    "Llama-3.1-8B": dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2),
    "Qwen2.5-0.5B": dict(hidden_size=56, intermediate_size=96, num_hidden_layers=2, num_attention_heads=7,
                         num_key_value_heads=1, max_window_layers=2),
    "Qwen2.5-7B": dict(hidden_size=56, intermediate_size=96, num_hidden_layers=2, num_attention_heads=7,
                       num_key_value_heads=1, max_window_layers=2),
    "Qwen3-0.6B": dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_window_layers=2),
    "OLMo-2-1B": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4),
    "OLMo-2-7B": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4),
    "Mistral-7B-v0.1": dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=2),
    "SmolLM2-135M": dict(hidden_size=72, intermediate_size=96, num_hidden_layers=2, num_attention_heads=9,
                         num_key_value_heads=3),
    "Pythia-160M": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
    # Windows shrink to 8 / 16 so ~40-token sequences cross them; depths keep one period of the layer pattern
    # (layer_types / no_rope_layers lists are cut to the depth by tiny()); query_pre_attn_scalar stays = head_dim.
    "Gemma-2-2B-it": dict(hidden_size=72, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
    "Gemma-3-1B-it": dict(hidden_size=72, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
    "Gemma-3-4B-it": dict(hidden_size=80, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16),
    "OLMo-3-7B": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, sliding_window=8),
    "gpt-oss-20b": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        experts_per_token=2, sliding_window=8),
    "Command-R7B": dict(hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=8, sliding_window=8),
    "SmolLM3-3B": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=1, max_window_layers=4),
    "Phi-4-mini": dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                       num_key_value_heads=2),
    "Granite-3.1-2B": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=2),
}

# the checkpoints the conformance matrix runs (the first ten); HYBRID_NAMES: the later entries (sliding / full
# layer mixes, softcapping, sinks, MoE, NoPE layers, partial rotary with longrope, muP multipliers)
NAMES = ("Llama-3.2-1B", "Llama-3.1-8B", "Qwen2.5-0.5B", "Qwen2.5-7B", "Qwen3-0.6B", "OLMo-2-1B", "OLMo-2-7B",
         "Mistral-7B-v0.1", "SmolLM2-135M", "Pythia-160M")
HYBRID_NAMES = tuple(name for name in PUBLISHED if name not in NAMES)
ALL_NAMES = NAMES + HYBRID_NAMES

# the dtype of the published tensors where the file does not say (gpt-oss: bf16 outside the MXFP4 experts)
STORED_DTYPE = {"gpt-oss-20b": "bfloat16"}
# tie_word_embeddings where the file leaves it to the class default
TIED_BY_DEFAULT = {"Gemma-2-2B-it": True, "Gemma-3-1B-it": True, "Gemma-3-4B-it": True,
                   "Command-R7B": True}


def stored_dtype(name: str) -> str:
    """The dtype the weights of ``name`` are published in: ``torch_dtype`` (``dtype`` in files written by
    transformers >= 4.56), else STORED_DTYPE, else float32."""
    cfg = PUBLISHED[name]
    return cfg.get("torch_dtype") or cfg.get("dtype") or STORED_DTYPE.get(name, "float32")


def tied(name: str) -> bool:
    """Whether ``name`` ties its input and output embeddings (the file's flag, else the class default)."""
    return PUBLISHED[name].get("tie_word_embeddings", TIED_BY_DEFAULT.get(name, False))


def _spread(values: list, n: int) -> list:
    """``n`` of ``values``, evenly spaced, first and last kept (a longrope factor list for a narrower head)."""
    if n >= len(values):
        return list(values)
    if n == 1:
        return [values[0]]
    return [values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)]


def tiny(name: str, vocab_size: int, bos: int, eos: int, pad: int) -> dict:
    """The published config.json of ``name`` with the tiny sizes and a ``vocab_size`` tokenizer's special ids."""
    cfg = copy.deepcopy(PUBLISHED[name])
    cfg.update(SHRINK[name], vocab_size=vocab_size)
    depth = cfg["num_hidden_layers"]
    for key in ("layer_types", "no_rope_layers"):  # per-layer lists: the first `depth` entries (one period or more)
        if isinstance(cfg.get(key), list) and key not in SHRINK[name]:
            cfg[key] = cfg[key][:depth]
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and "long_factor" in scaling:  # longrope: one factor per rotated pair
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        pairs = int(head_dim * cfg.get("partial_rotary_factor", 1.0)) // 2
        for key in ("long_factor", "short_factor"):
            scaling[key] = _spread(scaling[key], pairs)
    for key, value in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)):
        if key in cfg or key == "pad_token_id":
            cfg[key] = value
    return cfg
