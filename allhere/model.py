"""A small decoder-only LM (RMSNorm, RoPE, SwiGLU) whose attention is any mechanism, per model or per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import AHAConfig, DARConfig, FullConfig, MechanismConfig, ModelConfig, SlidingConfig
from .mechanisms.aha import AHAAttention
from .mechanisms.dar import DARAttention
from .mechanisms.full import FullAttention
from .mechanisms.sliding import SlidingAttention
from .routing import Routing

MECHANISM_MODULES = {FullConfig: FullAttention, SlidingConfig: SlidingAttention, AHAConfig: AHAAttention,
                     DARConfig: DARAttention}


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    ang = positions.float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)  # rotate-half layout
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, h, n, d]; cos/sin [n, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, mech: MechanismConfig) -> None:
        super().__init__()
        self.h, self.hkv, self.hd, self.rope_theta = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.rope_theta
        self.router_channels = cfg.n_heads if isinstance(mech, AHAConfig) and mech.router == "qproj" else 0
        self.q_proj = nn.Linear(cfg.d_model, self.h * self.hd + self.router_channels, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.d_model, bias=False)
        self.mechanism = MECHANISM_MODULES[type(mech)](mech, cfg.d_model, cfg.n_heads)

    def forward(self, x, cos, sin, cache=None):
        b, n, _ = x.shape
        q = self.q_proj(x)
        router_logits = None
        if self.router_channels:
            q, router_logits = q.split([self.h * self.hd, self.router_channels], dim=-1)
        q = apply_rope(q.view(b, n, self.h, self.hd).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, n, self.hkv, self.hd).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, n, self.hkv, self.hd).transpose(1, 2)
        extra = {}
        if getattr(self.mechanism, "wants_kv_projection", False):
            extra["kv_of"] = lambda h, positions=None, weights=None: self.project_kv(h, positions, cos, sin, weights)
            extra["kv_weights"] = (self.k_proj.weight, self.v_proj.weight)
        out, routing = self.mechanism(q, k, v, x, cache=cache, router_logits=router_logits, **extra)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.h * self.hd)), routing


    def project_kv(self, h, positions=None, cos=None, sin=None, weights=None):
        """The module's own K (with RoPE at ``positions``, or at cos/sin) and V of hidden states h; or of
        other inputs through ``weights`` = (W_K', W_V') given in place of the module's own."""
        b, n, _ = h.shape
        if positions is not None:
            cos, sin = rope_cos_sin(positions, self.hd, self.rope_theta)
        wk, wv = weights or (self.k_proj.weight, self.v_proj.weight)
        k = apply_rope(F.linear(h, wk).view(b, n, self.hkv, self.hd).transpose(1, 2), cos, sin)
        return k, F.linear(h, wv).view(b, n, self.hkv, self.hd).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mech: MechanismConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, mech)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, cache=None):
        a, routing = self.attn(self.attn_norm(x), cos, sin, cache)
        x = x + a
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), routing


@dataclass
class DecoderOutput:
    logits: torch.Tensor  # [batch, tokens, vocab]
    routing: Routing | None  # None when the model has no AHA layer
    cache: "DecoderCache | None"


class DecoderCache:
    """One KV cache per layer (each mechanism's own kind) and the number of tokens seen."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.seen = 0


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, cfg.layer_mechanism(i)) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        std = 0.02
        residual_out = ("o_proj.weight", "down.weight")  # scaled down as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = (2 * self.cfg.n_layers) ** -0.5 if name.endswith(residual_out) else 1.0
                nn.init.normal_(p, 0.0, std * scale)
        reset_routers(self)
        for blk in self.blocks:
            if isinstance(blk.attn.mechanism, DARAttention):
                blk.attn.mechanism.reset_parameters()

    def aha_modules(self) -> list[tuple[int, AHAAttention]]:
        return [(i, b.attn.mechanism) for i, b in enumerate(self.blocks) if isinstance(b.attn.mechanism, AHAAttention)]

    def new_cache(self) -> DecoderCache:
        return DecoderCache([b.attn.mechanism.new_cache() for b in self.blocks])

    def forward(self, input_ids: torch.Tensor, cache: DecoderCache | None = None) -> DecoderOutput:
        """input_ids [batch, tokens]. With ``cache`` the tokens continue the cached sequence.

        Padding must be on the right (a causal model never lets a real token see a later pad); pass the
        padding mask to the loss and to ``Routing`` statistics to exclude pads.
        """
        n = input_ids.shape[1]
        start = 0 if cache is None else cache.seen
        cos, sin = rope_cos_sin(torch.arange(start, start + n, device=input_ids.device),
                                self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed(input_ids)
        layers, per_layer = [], []
        for i, blk in enumerate(self.blocks):
            x, r = blk(x, cos, sin, None if cache is None else cache.layers[i])
            if r is not None:
                layers.append(i)
                per_layer.append(r)
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.lm_head is None else self.lm_head(x)
        if cache is not None:
            cache.seen += n
        return DecoderOutput(logits, Routing(layers, per_layer) if per_layer else None, cache)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with the KV cache: [batch, prompt] -> [batch, prompt + max_new_tokens]."""
        cache = self.new_cache()
        out = self(input_ids, cache=cache)
        tokens = [input_ids]
        for _ in range(max_new_tokens):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            out = self(nxt, cache=cache)
        return torch.cat(tokens, dim=1)


def reset_routers(model: Decoder) -> None:
    """(Re-)initialise every router of the model as its AHAConfig says."""
    for i, mech in model.aha_modules():
        attn = model.blocks[i].attn
        mech.reset_router(attn.q_proj.weight[-attn.router_channels:] if attn.router_channels else None)


def set_forced_gate(model: Decoder, value: bool | None) -> None:
    """Force every AHA gate to full (True) or local (False) attention; None restores routing."""
    for _, mech in model.aha_modules():
        mech.forced_gate = value


def set_aha_impl(model: Decoder, impl: str) -> None:
    """Pick the AHA op for every layer: "fast" or "naive" (dense reference)."""
    for _, mech in model.aha_modules():
        mech.impl = impl


def swap_mechanism(model: Decoder, mechanism: MechanismConfig | list[MechanismConfig]) -> Decoder:
    """A new Decoder with the same weights and another attention mechanism (routers freshly initialised).

    Every pretrained weight is copied; the only parameters allowed to be new are the mechanism's own
    (AHA routers, DAR's W_down / W_up).
    """
    if isinstance(mechanism, (list, tuple)):
        cfg = model.cfg.replace(layer_mechanisms=tuple(mechanism))
    else:
        cfg = model.cfg.replace(mechanism=mechanism, layer_mechanisms=None)
    new = Decoder(cfg).to(next(model.parameters()).device)
    src = model.state_dict()
    dst = new.state_dict()
    for name, t in dst.items():
        if name in src and src[name].shape == t.shape:
            t.copy_(src[name])
        elif name.endswith("q_proj.weight") and name in src:  # qproj router rows added or dropped
            rows = min(t.shape[0], src[name].shape[0])
            t[:rows].copy_(src[name][:rows])
        elif ".mechanism." not in name:  # only the mechanism's own modules (routers, DAR bottleneck) are new
            raise ValueError(f"cannot carry weight {name!r} over to the new mechanism")
    return new
