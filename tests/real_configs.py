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
}

NAMES = tuple(PUBLISHED)


def tiny(name: str, vocab_size: int, bos: int, eos: int, pad: int) -> dict:
    """The published config.json of ``name`` with the tiny sizes and a ``vocab_size`` tokenizer's special ids."""
    cfg = copy.deepcopy(PUBLISHED[name])
    cfg.update(SHRINK[name], vocab_size=vocab_size)
    for key, value in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)):
        if key in cfg or key == "pad_token_id":
            cfg[key] = value
    return cfg
