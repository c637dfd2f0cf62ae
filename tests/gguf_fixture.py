"""A tiny GGUF written as llama.cpp's converter writes one (``gguf``'s GGUFWriter), from a tiny transformers Llama
shaped like SmolLM2-135M (``real_configs``: 9 query heads over 3 KV heads, tied embeddings), with hf_fixtures'
byte-level BPE as the tokenizer and a chat template: so its logits can be compared with the model it was written
from."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
import transformers

from hf_fixtures import make_tokenizer
from real_configs import tiny

CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '</s>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
QUANTIZED = ("ffn_down",)  # written as Q8_0: the one matrix of this shape whose rows (96) are whole 32-value blocks


def tiny_llama(seed: int = 0):
    """(tokenizer, float32 model): the tiny SmolLM2, its matrices drawn from N(0, 0.1^2) so greedy tokens vary."""
    tok = make_tokenizer()
    config = transformers.LlamaConfig(**{k: v for k, v in tiny("SmolLM2-135M", len(tok), tok.bos_token_id,
                                                                  tok.eos_token_id, tok.pad_token_id).items()
                                         if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    return tok, model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The order llama.cpp's converter gives the rows of Llama's Q and K (each head's rotary halves interleaved),
    which transformers' GGUF loader reverses."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(model, quantized=QUANTIZED):
    """A copy of ``model`` with the matrices the GGUF stores quantized replaced by their de-quantized values: the
    model the GGUF holds exactly."""
    from gguf import GGMLQuantizationType, quants

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if any(_HF[q] in name for q in quantized):
                q8 = quants.quantize(p.numpy(), GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(quants.dequantize(q8, GGMLQuantizationType.Q8_0).reshape(p.shape)))
    return out


_HF = {"ffn_down": "mlp.down_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}


def write_gguf(path: Path, tok, model, quantized=QUANTIZED, arch: str = "llama") -> Path:
    """``model`` and ``tok`` as a GGUF at ``path``: F32 tensors, those named in ``quantized`` as Q8_0."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants

    c = model.config
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny smollm2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    special = set(tok.all_special_tokens) | {"<|user|>", "<|assistant|>", "<|system|>"}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t, _ in vocab])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_unk_token_id(tok.unk_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # a tied head is not stored: transformers' loader ties it again
        module = name.removesuffix(".weight")
        if module.startswith("model.layers."):
            i, rest = module.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{layer[rest]}"
        else:
            gname = names[module]
        data = p.detach().float().numpy()
        if gname.endswith("attn_q"):
            data = _permute(data, c.num_attention_heads)
        elif gname.endswith("attn_k"):
            data = _permute(data, c.num_key_value_heads)
        if gname.split(".")[-1] in quantized:
            w.add_tensor(gname + ".weight", quants.quantize(data, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname + ".weight", np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
