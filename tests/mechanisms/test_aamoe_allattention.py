"""The All-Attention layer: one softmax over the causal context and the persistent memory, in a decoder
whose blocks have no MLP; cached decoding, packed segments and checkpoints."""

import math

import pytest
import torch

from allhere import ConfigError, Decoder, ModelConfig
from allhere.masks import starts_from
from allhere.mechanisms.allattention import AllAttention, AllAttentionConfig
from allhere.mechanisms.base import AttentionCall, AttentionDims
from allhere.model import apply_rope, rope_cos_sin
from allhere.runtime.model_checkpoint import load_model, save_checkpoint

from helpers import rel_err


@pytest.mark.parametrize("memory_positions", ["relative", "absolute"])
def test_layer_equals_brute_force(memory_positions):
    """"relative": the memory is read by the query rotated back from its position (3 + i) to 0."""
    torch.manual_seed(0)
    m = AllAttention(AllAttentionConfig(n_mem=5, memory_positions=memory_positions), AttentionDims(16, 4, 2, 4))
    q, k, v = torch.randn(2, 4, 6, 4), torch.randn(2, 2, 9, 4), torch.randn(2, 2, 9, 4)
    out, routing = m(q, k, v, AttentionCall(x=None))
    assert routing is None and m.mem_k.shape == (4, 5, 4)
    q_mem = q if memory_positions == "absolute" else apply_rope(q, *rope_cos_sin(-torch.arange(3, 9), 4, 1e4))
    for b in range(2):
        for h in range(4):
            for i in range(6):
                pos = 3 + i  # the last 6 of 9 positions
                s = torch.cat([k[b, h // 2, :pos + 1] @ q[b, h, i], m.mem_k[h] @ q_mem[b, h, i]]).double()
                vals = torch.cat([v[b, h // 2, :pos + 1], m.mem_v[h]]).double()
                assert rel_err(out[b, h, i], torch.softmax(s / math.sqrt(4), 0) @ vals) < 1e-5


def model():
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               mechanism=AllAttentionConfig(n_mem=8))).eval()


def test_decoder_without_mlp_cache_segments_checkpoint(tmp_path):
    net = model()
    assert all(not b.has_mlp for b in net.blocks)
    assert not any("gate_up" in n or "down" in n for n, _ in net.named_parameters())
    ids = torch.randint(0, 40, (2, 11))
    with torch.no_grad():
        full = net(ids).logits
        cache = net.new_cache()
        steps = torch.cat([net(ids[:, t:t + 1], cache=cache).logits for t in range(11)], 1)
        assert rel_err(steps, full) < 1e-5
        positions = torch.cat([torch.arange(5), torch.arange(6)])[None].expand(2, -1)
        packed = net(ids, segment_starts=starts_from(position_ids=positions)).logits
        assert rel_err(packed[:, 5:], net(ids[:, 5:]).logits) < 1e-5
        pad = starts_from(padding_mask=torch.tensor([[False] * 3 + [True] * 8] * 2))
        assert torch.isfinite(net(ids, segment_starts=pad).logits).all()  # padding reads only the memory
    save_checkpoint(tmp_path / "m.safetensors", net, None, {"step": 0})
    again, _ = load_model(tmp_path / "m.safetensors")
    assert again.cfg.mechanism == AllAttentionConfig(n_mem=8) and torch.equal(again(ids).logits, full)


def test_memory_learns_and_config_is_checked():
    net = model().train()
    ids = torch.randint(0, 40, (2, 7))
    net(ids).logits.square().mean().backward()
    assert net.blocks[0].attn.mechanism.mem_v.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="AllAttentionConfig.n_mem"):
        AllAttentionConfig(n_mem=0)
    with pytest.raises(ConfigError, match="AllAttentionConfig.memory_positions"):
        AllAttentionConfig(memory_positions="none")
