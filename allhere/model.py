"""A small decoder-only LM (RMSNorm, RoPE, SwiGLU) whose attention is any mechanism, per model or per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import registry
from .config import ModelConfig
from .mechanisms.base import AttentionCall, AttentionDims, mechanism_layers
from .routing import Routing


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
    """The host layer: q/k/v/o projections and RoPE; the registered mechanism decides what each query reads."""

    def __init__(self, cfg: ModelConfig, mech) -> None:
        super().__init__()
        self.h, self.hkv, self.hd, self.rope_theta = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.rope_theta
        self.q_proj = nn.Linear(cfg.d_model, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.d_model, bias=False)
        self.mechanism = registry.build(mech, AttentionDims(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim))

    def forward(self, x, cos, sin, cache=None, segment_starts=None, positions=None):
        b, n, _ = x.shape
        extra = self.mechanism.q_extra_rows
        if extra is None:
            q, q_extra = self.q_proj(x), None
        else:  # the mechanism's rows ride along in one matmul
            q, q_extra = F.linear(x, torch.cat([self.q_proj.weight, extra])).split(
                [self.h * self.hd, extra.shape[0]], -1)
        q = apply_rope(q.view(b, n, self.h, self.hd).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, n, self.hkv, self.hd).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, n, self.hkv, self.hd).transpose(1, 2)
        call = AttentionCall(x=x, segment_starts=segment_starts, q_extra=q_extra, positions=positions,
                             project_kv=lambda h, positions=None, weights=None:
                                 self.project_kv(h, positions, cos, sin, weights),
                             kv_weights=(self.k_proj.weight, self.v_proj.weight), rope=(cos, sin))
        out, routing = self.mechanism(q, k, v, call, cache=cache)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.h * self.hd)), routing

    def project_kv(self, h, positions=None, cos=None, sin=None, weights=None):
        """The layer's own K (with RoPE at ``positions``, or at cos/sin) and V of hidden states h; or of
        other inputs through ``weights`` = (W_K', W_V') given in place of the layer's own."""
        b, n, _ = h.shape
        if positions is not None:
            cos, sin = rope_cos_sin(positions, self.hd, self.rope_theta)
        wk, wv = weights or (self.k_proj.weight, self.v_proj.weight)
        k = apply_rope(F.linear(h, wk).view(b, n, self.hkv, self.hd).transpose(1, 2), cos, sin)
        return k, F.linear(h, wv).view(b, n, self.hkv, self.hd).transpose(1, 2)


class Block(nn.Module):
    """Attention then a SwiGLU MLP, each on a pre-norm residual branch; a mechanism that brings its own
    feed-forward capacity (``replaces_mlp``, e.g. persistent memory as in All-Attention) has no MLP."""

    def __init__(self, cfg: ModelConfig, mech) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, mech)
        self.has_mlp = not self.attn.mechanism.replaces_mlp
        if self.has_mlp:
            self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
            self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden, bias=False)
            self.down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, cache=None, segment_starts=None, positions=None):
        a, routing = self.attn(self.attn_norm(x), cos, sin, cache, segment_starts, positions)
        x = x + a
        if not self.has_mlp:
            return x, routing
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), routing


@dataclass
class DecoderOutput:
    logits: torch.Tensor  # [batch, tokens, vocab]
    routing: Routing | None  # None when no layer routes
    cache: "DecoderCache | None"
    aux_loss: torch.Tensor | None = None  # the sum of the mechanisms' ``aux_loss`` (None: none has one)


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
        for mech in mechanism_layers(self):  # the mechanisms' own weights as they define them
            mech.reset_parameters()

    def new_cache(self, tokens: int | None = None) -> DecoderCache:
        """One empty cache per layer; ``tokens``: the length it will reach (prompt + new tokens), reserved up
        front by the caches that grow (no reallocation while decoding)."""
        layers = [b.attn.mechanism.new_cache() for b in self.blocks]
        if tokens is not None:
            for layer in layers:
                if hasattr(layer, "reserve"):
                    layer.reserve(tokens)
        return DecoderCache(layers)

    def forward(self, input_ids: torch.Tensor, cache: DecoderCache | None = None,
                segment_starts: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> DecoderOutput:
        """input_ids [batch, tokens]. With ``cache`` the tokens continue the cached sequence.

        positions: optional int64 [tokens], the absolute positions of these tokens (their rotary angles),
        for a shard of a longer sequence (context parallelism); not with a cache or segment_starts. Default: the next
        positions after the cache, from 0 without one. Mechanisms get them as ``AttentionCall.positions``
        (the patterns place their sinks / globals / windows at them over the keys at hand).

        segment_starts: optional int64 [batch, tokens] (``allhere.masks.starts_from``): per token the
        absolute position of its segment's first token -- a sequence of a padded batch (padding on either
        side) or a document of packed sequences -- and -1 for padding. Each token then attends only within
        its segment. Pass the padding mask to the loss and to ``Routing`` statistics to exclude pads.
        """
        n = input_ids.shape[1]
        given = positions  # the mechanisms see positions only when they are not the default ones
        if positions is None:
            start = 0 if cache is None else cache.seen
            positions = torch.arange(start, start + n, device=input_ids.device)
        elif (positions.shape != (n,) or positions.dtype != torch.int64 or cache is not None
              or segment_starts is not None):
            raise ValueError(f"positions must be int64 [tokens] = [{n}], without a cache (it numbers its tokens "
                             "itself) and without segment_starts (which count from the row's first token); got "
                             f"{positions.dtype} {tuple(positions.shape)}"
                             + (" and a cache" if cache is not None else "")
                             + (" and segment_starts" if segment_starts is not None else ""))
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed(input_ids)
        layers, per_layer, aux = [], [], []
        for i, blk in enumerate(self.blocks):
            x, r = blk(x, cos, sin, None if cache is None else cache.layers[i], segment_starts, given)
            if r is not None:
                layers.append(i)
                per_layer.append(r)
            mech = blk.attn.mechanism
            if mech.aux_loss is not None:  # handed on, not kept: a module holding a graph cannot be deep-copied
                aux.append(mech.aux_loss)
                mech.aux_loss = None
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.lm_head is None else self.lm_head(x)
        if cache is not None:
            cache.seen += n
        return DecoderOutput(logits, Routing(layers, per_layer) if per_layer else None, cache,
                             sum(aux) if aux else None)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with the KV cache: [batch, prompt] -> [batch, prompt + max_new_tokens]."""
        cache = self.new_cache(input_ids.shape[1] + max_new_tokens)
        out = self(input_ids, cache=cache)
        tokens = [input_ids]
        for _ in range(max_new_tokens):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            out = self(nxt, cache=cache)
        return torch.cat(tokens, dim=1)


def swap_mechanism(model: Decoder, mechanism) -> Decoder:
    """A new Decoder with the same weights and another attention mechanism (a registered config, or a
    list of one per layer). Mechanism weights (routers, bottlenecks) the old model has under the same name
    and shape are carried over; the others start as the mechanism initialises them.

    Every weight of the host layers is copied; the only parameters allowed to be new are the mechanisms'.
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
        elif ".mechanism." not in name:  # only the mechanisms' own weights may be new
            raise ValueError(f"cannot carry weight {name!r} over to the new mechanism")
    return new
