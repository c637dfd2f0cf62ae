"""DAR (Distance-Adaptive Representation, "Dual Dimensionality for Local and Global Attention", arXiv:2606.18587)
served by vLLM with the cache the paper's Section 5 describes: full-dimensional K/V for the last ``window``
tokens only, and a d_down latent c = h W_down for every token, from which each step rebuilds the distant keys
(W_up absorbed into W_K) and reads the distant values through the latents (W_up absorbed into W_V).

Two caches per converted layer, both vLLM's (it sizes them, assigns their blocks, prefix-caches and frees them):

- near: the layer's own ``Attention`` rebuilt as a sliding-window layer of the DAR window (``window`` 0: of one
  token, never read), so vLLM keeps only the window's blocks per request, as for its own sliding layers;
- latent: ``LatentCache``, a cache-only layer (vLLM's pattern for cached hidden states) reporting a full-
  attention KV spec of one head of d_down numbers and no values: its own KV cache group, every token kept.
  vLLM gives all groups pages of one size, so the latent group's blocks hold more tokens: as many latents as fit
  the window cache's page (``LatentCache``).

KV bytes per token of context fall from 2 x kv_heads x head_dim numbers per layer to d_down (plus the window,
a constant per request). The price is compute: each step rebuilds the distant keys of every row it reads,
d_down x kv_heads x head_dim multiply-adds per key (``allhere.ops.paged.dar_far``), where a plain cache only reads
them.

The host's key path. A far key is RoPE(norm(h' W_K + b)) on h' = c W_up: this block's ``qkv_proj`` key rows
times W_up, its bias, its per-head ``k_norm`` where it has one (Qwen3, Gemma-3), and its own ``rotary_emb`` at
the key's position. On the first step the same path is run on the step's hidden states and compared with the
keys the block itself made; a block whose keys it does not reproduce is refused with that error rather than
served wrong.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.models.extract_hidden_states import (
    CacheOnlyAttentionBackend,
    CacheOnlyAttentionLayer,
    CacheOnlyAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ...hosts import SUBMODULE
from ...ops.paged.attention import window_read
from ...ops.paged.dar_far import LatentKV, far_pieces, rotary_projection, write_latents
from ...ops.paged.window_prefill import window_pieces
from .attention import WINDOW_TILE, PagedAttention
from .blocks import block_argument, rebuild_attention
from .cpu_kernels import VLLM_WINDOW_OFFSET, step_plan


@dataclass
class LatentMetadata:
    """What allhere reads of a step for the latent cache (its group's block table and slot mapping; the step's
    ``PagedStepPlan`` is kept on it: ``allhere.serve.vllm.cpu_kernels.step_plan``)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int


class LatentMetadataBuilder(CacheOnlyAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> LatentMetadata:
        m = common_attn_metadata
        return LatentMetadata(m.query_start_loc, m.seq_lens, m.block_table_tensor, m.slot_mapping, m.num_actual_tokens)


class LatentBackend(CacheOnlyAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[LatentMetadataBuilder]:
        return LatentMetadataBuilder


class LatentCache(CacheOnlyAttentionLayer):
    """A paged cache of ``width`` numbers per token: vLLM's view [blocks, 1, block_size, width]. vLLM gives every
    cache group pages of one size, the window cache's (``near_numbers`` per token of ``block_size``): where
    ``width`` divides that page, vLLM itself makes the blocks longer; elsewhere its fallback would pad a page of
    ``block_size`` rows to the whole page (no saving at all), so the spec asks for ``block_size`` x
    (near_numbers // width) rows a page, the rest padding. Rows per block stay a multiple of ``block_size``: vLLM
    hits its prefix cache only with block sizes that divide one another (73 rows a block, say, never hit)."""

    def __init__(self, width: int, prefix: str, near_numbers: int) -> None:
        super().__init__(num_heads=1, head_size=width, prefix=prefix)
        self.attn_backend = LatentBackend
        self.near_numbers = near_numbers

    def get_kv_cache_spec(self, vllm_config) -> FullAttentionSpec:
        block = vllm_config.cache_config.block_size
        spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=self.head_size, head_size_v=0,
                                 dtype=self.kv_cache_torch_dtype)
        per_slot = self._rows_per_slot()
        if per_slot is None:
            return spec
        page = block * self.near_numbers * self.kv_cache_torch_dtype.itemsize
        return dataclasses.replace(spec, block_size=block * per_slot, page_size_padded=page)

    def _rows_per_slot(self) -> int | None:
        """Rows a page holds per token slot of the window cache's pages, padded; None where vLLM sizes the blocks
        itself (rows wider than the window's K/V, or dividing them)."""
        per_slot = self.near_numbers // self.head_size
        return None if per_slot == 0 or self.near_numbers % self.head_size == 0 else per_slot

    def reserved_numbers(self) -> float:
        """Numbers of cache memory vLLM reserves per token: a row, with its share of the page's padding."""
        per_slot = self._rows_per_slot()
        return self.head_size if per_slot is None else self.near_numbers / per_slot


class DARServe(nn.Module):
    """DAR's bottleneck (the weights allhere saved: ``...self_attn.allhere.{down,up}.weight``), the latent cache,
    and the block's input of this step (``x``, set by the block's pre-hook). ``absorb`` takes the block's K/V
    weights once they are loaded (vLLM's CPU backend then moves them into its GEMM library's own format)."""

    def __init__(self, d_model: int, d_down: int, window: int, prefix: str, block: nn.Module) -> None:
        super().__init__()
        self.window = window
        self.down = nn.Linear(d_model, d_down, bias=False)
        self.up = nn.Linear(d_down, d_model, bias=False)
        self.latent = LatentCache(d_down, f"{prefix}.{SUBMODULE}.latent", 2 * block.kv_size)
        self.x: torch.Tensor | None = None
        self._block = [block]  # a plain reference (the block holds this module)
        self.weights: dict[str, torch.Tensor | None] = {}

    def absorb(self) -> None:
        """From the block's ``qkv_proj`` (rows: queries, keys, values): W_K and b_K (kept for the first step's
        check), W_K W_up, W_V W_up and b_V."""
        block = self._block[0]
        w, bias, q, size = block.qkv_proj.weight, getattr(block.qkv_proj, "bias", None), block.q_size, block.kv_size
        if not w.dtype.is_floating_point or tuple(w.shape) != (q + 2 * size, self.up.weight.shape[0]):
            raise NotImplementedError(f"allhere vLLM serving: DAR reads the K/V weights of {type(block).__name__}'s "
                                      f"qkv_proj, which holds no plain [{q + 2 * size}, d_model] matrix (quantized?)")
        with torch.no_grad():
            w_k, w_v, up = w[q:q + size].clone(), w[q + size:], self.up.weight.float()
            self.weights = {"w_k": w_k, "a_k": (w_k.float() @ up).to(w.dtype), "a_v": (w_v.float() @ up).to(w.dtype),
                            **({"b_k": None, "b_v": None} if bias is None else
                               {"b_k": bias[q:q + size].clone(), "b_v": bias[q + size:].clone()})}


class DARAttention(PagedAttention):
    """Stands where the block's ``attn`` stood: the near window from the owner's (sliding) cache and the far keys
    from the latents, one softmax."""

    def __init__(self, near: Attention, mech: DARServe, block: nn.Module) -> None:
        window = mech.window
        super().__init__(near, [[window_read(window, q_tile=WINDOW_TILE)] if window else []])
        self._parts = [mech, block]  # plain references: both are registered elsewhere (no module cycle)
        self._kv: LatentKV | None = None

    def aux(self) -> torch.Tensor:
        mech = self._parts[0]
        x, mech.x = mech.x, None
        if x is None:
            raise RuntimeError(f"allhere: {self.layer_name} called without the block's input")
        return x

    def begin(self, q, k, v, x, out, meta, cache, rows_of):
        """The step's K/V written to the window's cache, and ``rows_of(x, k)`` (x [n, d_model], k [n, kv_heads, d])
        to the latent cache. Returns (metadata, the window cache's view, q, out, the latent cache's metadata and
        view [blocks, block_size, width], x, k), or None in vLLM's warm-up (no cache yet)."""
        step = self.write_step(q, k, v, out, meta, cache)
        if step is None:
            return None
        meta, view, q, out = step
        n = meta.num_actual_tokens
        x, k = x.reshape(-1, x.shape[-1])[:n], k.view(-1, self.kv_heads, self.head_dim)[:n]
        lmeta, _, lcache, _ = get_attention_context(self._parts[0].latent.layer_name)
        latents = lcache[:, 0]
        slots, bs = lmeta.slot_mapping[:n], latents.shape[1]
        places = step_plan(lmeta).slot_places(slots, bs)
        write_latents(latents, slots, rows_of(x, k), places)
        return meta, view, q, out, lmeta, latents, x, k

    def compute(self, q, k, v, x, out, meta, cache) -> None:
        mech = self._parts[0]
        step = self.begin(q, k, v, x, out, meta, cache, lambda x, k: F.linear(x, mech.down.weight))
        if step is None:
            return
        meta, view, q, out, lmeta, latents, x, k = step
        n = meta.num_actual_tokens
        if self._kv is None:
            self._kv = self._latent_kv(x, k, step_plan(meta).token_positions()[1])
        far = far_pieces(q[:n], latents, lmeta.query_start_loc, lmeta.seq_lens, lmeta.block_table, mech.window,
                         self._kv, self.scale)
        self.attend_far(q, view, meta, out, far)

    def attend_far(self, q, view, meta, out, far) -> None:
        """The window and ``far``'s pieces under one softmax. On the torch path a prefill's windows are read in a
        few large calls (``ops.paged.window_prefill``) and the layer's path reads only the decode rows' (the
        prefill rows are of a class that reads nothing there)."""
        starts = meta.query_start_loc.long()
        prefill = (starts[1:] - starts[:-1]) > 1
        if self.path.backend != "torch" or not self.reads[0] or not bool(prefill.any()):
            self.attend(q, view, meta, None, out, extra=far)
            return
        n = meta.num_actual_tokens
        req, _ = step_plan(meta).token_positions()
        near = window_pieces(q[:n], view, meta.query_start_loc, meta.seq_lens, meta.block_table,
                             self._parts[0].window, self.scale)
        row_class = prefill[req].long()[:, None].expand(n, self.heads)  # 1: a prefill row, read here by nothing
        self.attend(q, view, meta, row_class, out, extra=itertools.chain(far, near), reads=[self.reads[0], []])

    def _latent_kv(self, x, k_host, positions) -> LatentKV:
        """The far keys' and values' maps from the latents; first checked: the same key path on the step's
        hidden states gives the keys the block made."""
        mech, block = self._parts
        w = mech.weights
        if not w:
            raise RuntimeError(f"allhere: {self.layer_name}: DAR's weights were not absorbed after loading")
        check, _ = _key_path(block, w.pop("w_k"), w["b_k"], self.kv_heads)
        keys, order = _key_path(block, w["a_k"], w["b_k"], self.kv_heads)
        host = k_host.float() if order is None else k_host.float()[..., order]
        tol = 1e-4 if k_host.dtype == torch.float32 else 2e-2
        try:
            mine = check(x[None], positions)[0]  # [tokens, kv_heads, d], in ``order``
            same = torch.allclose(mine, host, rtol=tol, atol=tol * float(host.abs().max()) + 1e-6)
        except (RuntimeError, AssertionError, TypeError, ValueError) as e:  # a module that does not take this call
            same, why = False, f" ({type(e).__name__}: {e})"
        else:
            why = ""
        if not same:
            raise NotImplementedError(f"allhere vLLM serving: DAR rebuilds {self.layer_name}'s distant keys as "
                                      f"qkv_proj -> k_norm -> rotary_emb, which does not give the keys "
                                      f"{type(block).__name__} makes{why}")
        b_v = w["b_v"]
        return LatentKV(keys, w["a_v"].view(self.kv_heads, self.head_dim, -1),
                        None if b_v is None else b_v.view(self.kv_heads, self.head_dim), order)


_TABLES: dict[tuple, torch.Tensor] = {}  # one complex table per cos/sin table (vLLM's layers share one)


def _rotation_table(cos_sin: torch.Tensor) -> torch.Tensor:
    """[positions, r / 2] complex: cos + i sin, from vLLM's [positions, r] table (cos, then sin)."""
    key = (cos_sin.data_ptr(), tuple(cos_sin.shape), cos_sin.dtype)
    if key not in _TABLES:
        cos, sin = cos_sin.float().chunk(2, dim=-1)
        _TABLES[key] = torch.complex(cos, sin)
    return _TABLES[key]


def plain_rotary(rotary: nn.Module) -> bool:
    """Whether ``rotary`` is vLLM's plain ``RotaryEmbedding`` (its forward unchanged by the subclass), which
    rotates by its ``cos_sin_cache`` table alone (Llama-3's and YaRN's scaled tables included)."""
    return isinstance(rotary, RotaryEmbedding) and all(
        getattr(type(rotary), f) is getattr(RotaryEmbedding, f) for f in ("forward_native", "forward_static"))


def _key_path(block: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, kv_heads: int):
    """(keys, order) as ``allhere.ops.paged.dar_far.rotary_projection`` gives them, through ``block``'s own
    ``k_norm`` and ``rotary_emb``: the rotation read from its cos/sin table where it is vLLM's plain
    ``RotaryEmbedding`` (its forward unchanged by the subclass: Llama-3's and YaRN's scaled tables included),
    the module itself otherwise (slower: its own elementwise passes)."""
    k_norm, rotary = getattr(block, "k_norm", None), getattr(block, "rotary_emb", None)
    if rotary is None or plain_rotary(rotary):
        table = None if rotary is None else (_rotation_table(rotary.cos_sin_cache), bool(rotary.is_neox_style))
        return rotary_projection(weight, bias, kv_heads, table, k_norm)
    projected, _ = rotary_projection(weight, bias, kv_heads, None, k_norm)

    def keys(x, positions):
        k = projected(x, positions)  # [n, count, kv_heads, d], not rotated
        _, rotated = rotary(positions.repeat(k.shape[0]), k.new_zeros(k.shape[0] * k.shape[1], k.shape[3]),
                            k.flatten(2).flatten(0, 1))  # a one-head query it rotates too
        return rotated.view(k.shape)

    return keys, None


def keep_input(block, args, kwargs):
    where, key = block_argument(block, args, kwargs, "hidden_states")
    getattr(block, SUBMODULE).x = where[key]


def check_own_block(block: nn.Module, kind: str) -> None:
    """DAR's variants read the block's input: vLLM's own attention block is needed."""
    params = inspect.signature(type(block).forward).parameters
    if not {"positions", "hidden_states"} <= set(params):
        raise NotImplementedError(f"allhere vLLM serving: {kind} needs vLLM's own attention block (taking positions "
                                  f"and hidden_states); {type(block).__name__} runs through vLLM's Transformers "
                                  f"backend")


def install_dar(block: nn.Module, attn: Attention, cfg, d_model: int) -> None:
    check_own_block(block, "DAR")
    missing = [a for a in ("qkv_proj", "q_size", "kv_size") if not hasattr(block, a)]
    if missing:
        raise NotImplementedError(f"allhere vLLM serving: DAR rebuilds distant keys through the block's qkv_proj; "
                                  f"{type(block).__name__} has no {', '.join(missing)}")
    near = rebuild_attention(block, attn, per_layer_sliding_window=max(cfg.window, 1) + VLLM_WINDOW_OFFSET)
    mech = DARServe(d_model, cfg.d_down, cfg.window, near.layer_name.rpartition(".")[0], block)
    block.add_module(SUBMODULE, mech)
    block.attn = DARAttention(near, mech, block)
    block.register_forward_pre_hook(keep_input, with_kwargs=True)
