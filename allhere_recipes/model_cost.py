"""Memory and traffic per GPU of training a whole decoder on a 2-D mesh of G = dp x cp GPUs: FSDP2
shards the model over all G ranks, and every sequence is split over the cp ranks of a context-parallel
ring (zigzag layout by default). A model, not a measurement: nothing is run or allocated.

The attention terms come from ``cost.py`` (which walks the ``RingPlan`` the ring executes, one layer,
busiest rank); everything else is counted here, per rank, for a micro-batch of one sequence of n tokens:

- **Parameters** of a Llama/Mistral-style decoder (``ModelShape.params``): q/k/v/o projections, a SwiGLU
  MLP (gate, up, down), two RMSNorm weights per block, the embedding, the final norm and, when not
  tied, the output head. No biases. An AHA model's routers (d_model x heads per layer, under 0.1% of a
  7B model) are not counted.
- **State** (sharded over G): fp32 master parameters, fp32 gradients and AdamW's two fp32 moments,
  16 bytes per parameter / G.
- **FSDP buffers** (unsharded, with FSDP2's mixed precision: bf16 parameters, fp32 gradient reduction):
  the root unit (embeddings, final norm, head) in bf16, gathered for the whole step (FSDP2 does not
  reshard the root after forward); ``live_blocks`` blocks in bf16 (the one running and the one
  prefetched: 2); during the backward the root's bf16 gradients (computed at the start of the backward,
  reduce-scattered at its end) and one block's bf16 gradients plus their fp32 copy, the reduce-scatter
  input.
- **Activations**, with activation checkpointing per block (an assumption: allhere does not apply it
  today; ``checkpointing=False`` keeps every block's saved tensors instead):
  - the block inputs of every layer, n/cp tokens x d_model in bf16;
  - one block's recomputed saved tensors (``block_terms``): per token, in bf16, the attention norm's
    output (the q/k/v projections' input), the attention output re-laid out as [tokens, heads*head_dim]
    (o_proj's input, a copy), the residual after attention and its norm's output (the MLP's input),
    the gate and up projections, SiLU(gate) and SiLU(gate)*up (down's input), two fp32 norm scales;
    plus what the attention layer itself saves (``cost.saved_bytes``: q, k, v, output in bf16,
    log-sum-exp in fp32; for AHA the gate; with the gate trained the output-sized a_full - a_local);
  - the ring's forward working set of one layer (``cost.working_peak_bytes``, this untiled
    implementation: fp32 accumulators, the concatenated K/V, two receive buffers and one (n/2cp)^2 fp32
    score block per head, twice). A flash kernel per block would drop the score blocks
    (``ring_score_blocks``; ``peak_tiled`` is the peak without them);
  - the logits of the rank's tokens: bf16 from the head plus the fp32 log-softmax the cross-entropy
    saves (6 bytes per token and vocabulary entry).
  All are added as if live at once: an upper bound of this accounting, not an allocator's peak. Not
  counted: the gradients of activations in flight during the backward, temporaries of unfused kernels,
  the CUDA context, NCCL buffers, allocator fragmentation.
- **Ring traffic**, per layer from ``cost.summary`` (forward + backward, key/value chunks in bf16 and
  dK/dV back in fp32); per step the layers' sum plus, with checkpointing, each layer's forward pass
  again (the recompute runs the ring forward a second time). Per round: the layer's received bytes
  divided by the rounds that receive something (forward and backward).
- **FSDP traffic** per step, bytes each rank sends (equal to what it receives) with ring collectives:
  the forward all-gather of every parameter in bf16, the backward all-gather of the blocks in bf16 (not
  the root, kept from the forward), the reduce-scatter of every gradient in fp32; each (G-1)/G of the
  full size. The textbook 3 x params x (G-1)/G, at 2 + 2 + 4 bytes per parameter, minus the root's
  second all-gather.
- **Attention FLOPs** per step: ``cost.summary``'s per layer (4 rows.keys.dim forward, 10 backward) times
  the layers, plus the recomputed forward. Projections and MLP are not included.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from .cost import Shape, mechanism_plan, saved_bytes, summary

MECHANISMS = ("full", "sliding", "longformer", "aha", "aha (gate trained)")
STATE_BYTES_PER_PARAM = 16  # fp32 master + fp32 grad + AdamW exp_avg + exp_avg_sq
BF16, FP32 = 2, 4


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Mistral-style decoder: pre-norm blocks of GQA attention and a SwiGLU MLP."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelShape":
        """From a Hugging Face ``config.json`` dict. ``head_dim`` defaults to hidden / heads,
        ``num_key_value_heads`` to the heads, ``tie_word_embeddings`` to False (Llama's and Mistral's
        default)."""
        heads = cfg["num_attention_heads"]
        return cls(layers=cfg["num_hidden_layers"], d_model=cfg["hidden_size"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                   tied=bool(cfg.get("tie_word_embeddings", False)))

    @property
    def block_params(self) -> int:
        d, attn = self.d_model, self.heads * self.head_dim
        return 2 * d * attn + 2 * d * self.kv_heads * self.head_dim + 3 * d * self.ffn + 2 * d

    @property
    def root_params(self) -> int:
        """Embedding, final norm and (untied) output head: FSDP's root unit."""
        return self.vocab * self.d_model * (1 if self.tied else 2) + self.d_model

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.root_params

    def attention_shape(self, batch: int = 1) -> Shape:
        return Shape(batch=batch, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim, elt=BF16)


PRESETS = {
    # config.json of mistralai/Mistral-7B-v0.1: 7,241,732,096 parameters
    "Mistral-7B-v0.1": ModelShape(layers=32, d_model=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
                                  vocab=32000, tied=False),
}


def load_model_shape(spec: str) -> ModelShape:
    """A preset name (``PRESETS``, case-insensitive) or the path of a ``config.json``."""
    for name, shape in PRESETS.items():
        if spec.lower() == name.lower():
            return shape
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
    return ModelShape.from_config(json.loads(path.read_text()))


# One block's recomputed saved tensors besides the attention's own, per token: (elements, bytes each).
def block_terms(m: ModelShape) -> dict:
    return {"attn_norm_out": (m.d_model, BF16), "o_proj_in": (m.heads * m.head_dim, BF16),
            "residual_after_attn": (m.d_model, BF16), "mlp_norm_out": (m.d_model, BF16),
            "gate_up_out": (2 * m.ffn, BF16), "silu_gate": (m.ffn, BF16), "silu_gate_times_up": (m.ffn, BF16),
            "norm_rstd": (2, FP32)}


def block_bytes_per_token(m: ModelShape) -> int:
    """Bytes one block saves per token outside the attention layer (``block_terms``)."""
    return sum(e * b for e, b in block_terms(m).values())


def ring_layer(shape: Shape, mechanism: str, n: int, cp: int, layout: str = "zigzag", window: int = 4096,
               mu_f: float = 0.07, n_global: int = 64) -> dict:
    """One attention layer on the busiest rank: ``cost.summary`` (rounds, received, sent, flops, peak,
    saved) plus its forward part alone (``fwd_*``, what a recompute runs again) and ``transfers`` (rounds
    that receive, forward + backward). ``mechanism``: one of ``MECHANISMS``; Longformer's global tokens
    are the first ``n_global``."""
    return dict(_ring_layer(shape, mechanism, n, cp, layout, window, mu_f, n_global))


@functools.lru_cache(maxsize=None)
def _ring_layer(shape, mechanism, n, cp, layout, window, mu_f, n_global) -> dict:
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
    plan, selector, extra = mechanism_plan(mechanism, n, cp, layout, shape, window, mu_f, n_global)
    out = summary(plan, shape, selector, extra)
    out["saved"] = saved_bytes(shape, n, cp, selector, trained_gate=extra is not None)
    return out


def step_cost(model: ModelShape, n: int, dp: int, cp: int, mechanism: str = "full", layout: str = "zigzag",
              window: int = 4096, mu_f: float = 0.07, n_global: int = 64, live_blocks: int = 2,
              checkpointing: bool = True) -> dict:
    """Per-rank memory (bytes), traffic (bytes sent) and attention FLOPs of one training step on a
    dp x cp mesh, micro-batch one sequence of ``n`` tokens per dp replica. See the module docstring for
    every term; the totals are ``state``, ``activations``, ``peak`` (and ``peak_tiled``),
    ``ring_sent_per_step``, ``fsdp_sent_per_step`` and ``attn_flops_per_step``."""
    g = dp * cp
    tokens = n // cp
    ring = ring_layer(model.attention_shape(), mechanism, n, cp, layout, window, mu_f, n_global)
    o: dict = dict(mechanism=mechanism, dp=dp, cp=cp, gpus=g, n=n, tokens_per_rank=tokens,
                   params=model.params, block_params=model.block_params, root_params=model.root_params,
                   live_blocks=live_blocks, checkpointing=checkpointing)
    # memory: sharded state + FSDP's unsharded buffers
    o["sharded_state"] = STATE_BYTES_PER_PARAM * model.params / g
    o["gathered_root"] = BF16 * model.root_params
    o["gathered_blocks"] = BF16 * live_blocks * model.block_params
    o["unsharded_grads"] = BF16 * model.root_params + (BF16 + FP32) * model.block_params
    o["state"] = o["sharded_state"] + o["gathered_root"] + o["gathered_blocks"] + o["unsharded_grads"]
    # memory: activations
    o["block_bytes_per_token"] = block_bytes_per_token(model)
    o["attn_saved_per_layer"] = ring["saved"]
    one_block = tokens * o["block_bytes_per_token"] + ring["saved"]
    if checkpointing:
        o["block_inputs"] = model.layers * tokens * model.d_model * BF16
        o["block_recompute"] = one_block
    else:
        o["block_inputs"] = 0
        o["block_recompute"] = model.layers * one_block  # nothing is recomputed: every block's saved tensors
    o["ring_working_set"] = ring["peak"]
    o["ring_score_blocks"] = ring["score_blocks"]  # the part of the working set a flash kernel drops
    o["logits"] = tokens * model.vocab * (BF16 + FP32)
    o["activations"] = o["block_inputs"] + o["block_recompute"] + o["ring_working_set"] + o["logits"]
    o["peak"] = o["state"] + o["activations"]
    o["peak_tiled"] = o["peak"] - o["ring_score_blocks"]
    # ring traffic (busiest rank)
    o["ring_rounds_per_layer"] = ring["rounds"]
    o["ring_sent_per_layer"] = ring["sent"]
    o["ring_received_per_layer"] = ring["received"]
    o["ring_recompute_sent_per_layer"] = ring["fwd_sent"] if checkpointing else 0
    o["ring_sent_per_step"] = model.layers * (o["ring_sent_per_layer"] + o["ring_recompute_sent_per_layer"])
    o["ring_received_per_round"] = ring["received"] / ring["transfers"] if ring["transfers"] else 0.0
    # FSDP traffic (bytes sent per rank; received is the same)
    share = (g - 1) / g
    o["fsdp_allgather_forward"] = BF16 * model.params * share
    o["fsdp_allgather_backward"] = BF16 * model.layers * model.block_params * share
    o["fsdp_reduce_scatter"] = FP32 * model.params * share
    o["fsdp_sent_per_step"] = (o["fsdp_allgather_forward"] + o["fsdp_allgather_backward"]
                               + o["fsdp_reduce_scatter"])
    # attention FLOPs
    o["attn_flops_per_layer"] = ring["flops"]
    o["attn_recompute_flops_per_layer"] = ring["fwd_flops"] if checkpointing else 0
    o["attn_flops_per_step"] = model.layers * (ring["flops"] + o["attn_recompute_flops_per_layer"])
    return o
