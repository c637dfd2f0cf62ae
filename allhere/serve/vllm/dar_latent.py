"""``dar_latent`` (DAR whose distant keys are scored in the latent: ``allhere.mechanisms.dar_latent``) served by
vLLM.

Two caches per converted layer, both vLLM's, as for DAR (``allhere.serve.vllm.dar``): the block's ``Attention``
rebuilt as a sliding-window layer of the window (the host's exact K/V of the last ``window`` tokens), and a
``LatentCache`` of one row per token, [c ; k^R of every KV head]: the latent c = h W_down (d_down numbers) and the
host's rotated key at the ``rope_pairs`` rotary pairs kept per KV head (the ``channels`` buffer allhere saved).

A step writes its rows, then every query reads its window from the near cache and its distant keys from the rows
with its far query [q^R ; q^C]: its rotated channels at the kept pairs, and its other channels unrotated (vLLM's
rotary table inverted at the query's position). A decode row reads the rows absorbed (its content query folded
into the latent by one matmul: ``allhere.ops.dar_latent.query_map``), nothing rebuilt; a prefill's far keys are
rebuilt per chunk from the rows, as DAR's. One softmax: the pieces are merged by log-sum-exp with the window's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

from ...hosts import SUBMODULE
from ...mechanisms.dar_latent_channels import far_queries
from ...ops.dar_latent.check import split_rows
from ...ops.dar_latent.query_map import absorbed_queries, query_map, rotary_factors
from ...ops.dar_latent.reference import far_keys
from ...ops.paged.dar_far import LatentKV, far_pieces
from ...ops.paged.dar_latent_decode import decode_latent
from ...ops.paged.step_plan import PagedStepPlan, part_of
from .attention import WORKSPACE
from .blocks import rebuild_attention
from .cpu_kernels import VLLM_WINDOW_OFFSET, step_plan
from .dar import DARAttention, LatentCache, check_own_block, keep_input, plain_rotary


class DARLatentServe(nn.Module):
    """The weights allhere saved (``...self_attn.allhere.{down,up_k,up_v}.weight`` and the ``channels`` buffer),
    the row cache, the block's rotary embedding, and the block's input of this step (``x``, set by its pre-hook)."""

    def __init__(self, d_model: int, cfg, kv_heads: int, head_dim: int, prefix: str, rotary: nn.Module) -> None:
        super().__init__()
        g, d, r2 = kv_heads, head_dim, 2 * cfg.rope_pairs
        self.window, self.d_down, self.r2 = cfg.window, cfg.d_down, r2
        self.down = nn.Linear(d_model, cfg.d_down, bias=False)
        self.up_k = nn.Linear(cfg.d_down, g * (d - r2), bias=False)
        self.up_v = nn.Linear(cfg.d_down, g * d, bias=False)
        self.register_buffer("channels", torch.zeros(g, d, dtype=torch.long))
        self.latent = LatentCache(cfg.d_down + g * r2, f"{prefix}.{SUBMODULE}.latent", 2 * g * d)
        self.x: torch.Tensor | None = None
        self._rotary = [rotary]  # a plain reference (registered under the block)
        self._kv: LatentKV | None = None
        self._decode: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """x [n, d_model], k [n, kv_heads, d] (rotated) -> the rows [n, d_down + kv_heads x r2]."""
        kept = k.gather(-1, self.channels[None, :, :self.r2].expand(k.shape[0], -1, -1))
        return torch.cat([self._down(x), kept.flatten(1).to(x.dtype)], dim=-1)

    def _down(self, x: torch.Tensor) -> torch.Tensor:
        """x W_down^T; on the CPU by vLLM's own GEMM for its linear layers (oneDNN or sgl-kernel, the weight
        packed once): a decode step's few rows take a fifth of ``F.linear``'s time in bf16."""
        if x.device.type != "cpu":
            return F.linear(x, self.down.weight)
        if not hasattr(self.down, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(self.down, remove_weight=False)
        return self.down.cpu_linear(x, self.down.weight, None)

    def far_queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``mechanisms.dar_latent_channels.far_queries`` in vLLM's layout: q [n, heads, d] (rotated, at
        ``positions`` [n]) -> [n, heads, d], the rotation undone with vLLM's own table."""
        cos, sin = self._rotary[0].cos_sin_cache.index_select(0, positions.long()).float().chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # rotate-half layout, as the HF host's
        return far_queries(q.transpose(0, 1)[None], cos, sin, self.channels, self.r2)[0].transpose(0, 1)

    def decode_queries(self, q: torch.Tensor, positions: torch.Tensor, dtype,
                       plan: PagedStepPlan | None = None) -> torch.Tensor:
        """q [n, heads, d] (rotated, at ``positions``) -> its far queries as absorbed cache rows [n, heads, width]
        in ``dtype`` (``ops.dar_latent.query_map``: one matmul). ``plan``: the step's ``PagedStepPlan`` (whose
        tokens are at ``positions``), where the rotary factors are kept for the step's next layer."""
        cache = self._rotary[0].cos_sin_cache
        factors = part_of(plan, ("rotary", id(cache)), lambda: rotary_factors(
            *cache.index_select(0, positions.long()).chunk(2, dim=-1), q.shape[-1]))
        return absorbed_queries(q, factors, self.decode_maps()[0], dtype)

    def decode_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``query_map`` [kv_heads, 2 d, width], W_UV [kv_heads, d, d_down]) in fp32, made once."""
        if self._decode is None:
            w_uk, w_uv = self.maps()
            self._decode = query_map(self.channels, w_uk, self.r2), w_uv.float()
        return self._decode

    def maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [kv_heads, d - r2, d_down], W_UV [kv_heads, d, d_down]): views of the loaded weights."""
        g, d = self.channels.shape
        return self.up_k.weight.view(g, d - self.r2, self.d_down), self.up_v.weight.view(g, d, self.d_down)

    def latent_kv(self) -> LatentKV:
        """How a prefill's far keys and values are rebuilt from the rows, for ``far_pieces`` (built once, from the
        loaded weights)."""
        if self._kv is None:
            g = self.channels.shape[0]
            w_uk, w_uv = self.maps()

            def keys(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [n, t, g, d], fp32
                return far_keys(*split_rows(rows.float(), g, self.d_down), w_uk.float()).transpose(1, 2)

            self._kv = LatentKV(keys, w_uv)  # a value is W_UV_g c: the rows' first d_down numbers
        return self._kv


class DARLatentAttention(DARAttention):
    """Stands where the block's ``attn`` stood: the window from the near (sliding) cache, the distant keys from
    the rows, one softmax."""

    def compute(self, q, k, v, x, out, meta, cache) -> None:
        mech = self._parts[0]
        step = self.begin(q, k, v, x, out, meta, cache, mech.rows)
        if step is None:
            return
        meta, view, q, out, lmeta, rows, _, _ = step
        n = meta.num_actual_tokens
        plan = step_plan(meta)  # what every layer of the step reads alike, made by its first
        req, positions = plan.token_positions()
        if plan.decodes_only():  # every request decodes: the whole step at once
            near_table, rows_table = plan.part("token tables", lambda: (meta.block_table[req], lmeta.block_table[req]))
            q_row = mech.decode_queries(q[:n], positions, rows.dtype, plan)
            decode_latent(q[:n], q_row, positions, view, near_table, rows, rows_table, mech.window,
                          mech.decode_maps()[1], self.scale, out[:n], WORKSPACE, plan)
            out[n:].zero_()
            return
        # a prefill's far keys are rebuilt for its far queries; a decode row reads the rows absorbed
        far = far_pieces(mech.far_queries(q[:n], positions), rows, lmeta.query_start_loc, lmeta.seq_lens,
                         lmeta.block_table, mech.window, mech.latent_kv(), self.scale,
                         absorbed=lambda ids: mech.decode_queries(q[ids], positions[ids], rows.dtype))
        self.attend_far(q, view, meta, out, far)


def install_dar_latent(block: nn.Module, attn: Attention, cfg, d_model: int) -> None:
    check_own_block(block, "dar_latent")
    rotary = getattr(block, "rotary_emb", None)
    if rotary is None or not plain_rotary(rotary) or not rotary.is_neox_style:
        raise NotImplementedError(f"allhere vLLM serving: dar_latent inverts the rotary embedding of the queries, "
                                  f"which it does for vLLM's plain rotate-half RotaryEmbedding only; "
                                  f"{type(block).__name__}'s is {type(rotary).__name__}")
    near = rebuild_attention(block, attn, per_layer_sliding_window=max(cfg.window, 1) + VLLM_WINDOW_OFFSET)
    mech = DARLatentServe(d_model, cfg, near.num_kv_heads, near.head_size, near.layer_name.rpartition(".")[0], rotary)
    block.add_module(SUBMODULE, mech)
    block.attn = DARLatentAttention(near, mech, block)
    block.register_forward_pre_hook(keep_input, with_kwargs=True)
