"""Every op family of allhere, and the paths each registers with ``allhere.backend``: written here and nowhere
else. ``FAMILIES`` names them all, with what each computes and where its entry is.

The families whose paths are ops (``allhere.ops``, the paged one included: ``allhere.ops.paged``) are registered
when this module is imported, which ``allhere.ops`` does. One family computes with state that lives above the ops,
so its code hands its paths in through ``register_patterns``, which fixes the family's backends and its ``"auto"``
rule: ``"patterns"``, whose paths are methods of the sparse-pattern layer (its predicate, tile plans and
FlexAttention block masks are cached on it), taken with the layer as first argument (called by
``allhere.mechanisms.masked_base``).
"""

from __future__ import annotations

from typing import Callable

from ..backend import on_cuda, register_path
from .aamoe.gathered import aamoe_attention_torch
from .aamoe.reference import aamoe_attention_reference
from .aha.dispatch import torch_takes as aha_torch_takes
from .aha.dispatch import triton_takes as aha_triton_takes
from .aha.fast import aha_attention_torch
from .aha.reference import aha_attention_reference
from .aha.triton_path import aha_attention_triton
from .all_attention import all_attention_reference
from .dar.blocked import dar_attention_torch
from .dar.reference import dar_attention_reference
from .dar_latent.dispatch import dar_latent_attention_torch, dar_latent_attention_triton, triton_refusal
from .dar_latent.reference import dar_latent_attention_reference
from .full import full_attention_reference, full_attention_torch
from .paged.dispatch import paged_reference, paged_torch, paged_triton
from .paged.dispatch import triton_takes as paged_triton_takes
from .sliding.blocked import sliding_window_attention_torch
from .sliding.reference import sliding_window_attention_reference

FAMILIES = {
    "full": "causal attention, or attention under a bool mask (ops.full.full_attention)",
    "sliding": "sliding-window attention (ops.sliding.sliding_window_attention)",
    "aha": "All-or-Here attention: per (token, head) full or windowed (ops.aha.aha_attention)",
    "dar": "DAR: near keys full-dimensional, far keys rebuilt from a bottleneck (ops.dar.dar_attention)",
    "dar_latent": "DAR with far keys scored in the latent (ops.dar_latent.dar_latent_attention)",
    "aamoe": "AA-MoE: each query reads the resources it chose (ops.aamoe.aamoe_attention)",
    "all_attention": "causal context and persistent memory in one softmax (mechanism all_attention's forward)",
    "patterns": "the sparse-pattern layers' attention under their mask predicate (mechanisms.masked_base)",
    "paged": "a served layer's attention over its paged KV cache (ops.paged.attention.paged_attention)",
}

register_path("full", "reference", full_attention_reference)
register_path("full", "torch", full_attention_torch)
register_path("sliding", "reference", sliding_window_attention_reference)
register_path("sliding", "torch", sliding_window_attention_torch)
register_path("aha", "reference", aha_attention_reference)
register_path("aha", "torch", aha_attention_torch, takes=aha_torch_takes)
register_path("aha", "triton", aha_attention_triton, takes=aha_triton_takes, auto=on_cuda)
register_path("dar", "reference", dar_attention_reference)
register_path("dar", "torch", dar_attention_torch)
register_path("dar_latent", "reference", dar_latent_attention_reference)
register_path("dar_latent", "torch", dar_latent_attention_torch)
register_path("dar_latent", "triton", dar_latent_attention_triton, takes=triton_refusal, auto=on_cuda)
register_path("aamoe", "reference", aamoe_attention_reference)
register_path("aamoe", "torch", aamoe_attention_torch)
register_path("all_attention", "reference", all_attention_reference)
register_path("paged", "reference", paged_reference)
register_path("paged", "torch", paged_torch)
register_path("paged", "triton", paged_triton, takes=paged_triton_takes, auto=on_cuda)


def register_patterns(reference: Callable, torch_path: Callable, flex: Callable) -> None:
    """Op family ``"patterns"``: its paths, each called as ``path(layer, q, k, v, key positions, segment starts,
    scale)``; ``"auto"`` takes FlexAttention on CUDA only."""
    register_path("patterns", "reference", reference)
    register_path("patterns", "torch", torch_path)
    register_path("patterns", "flex", flex, auto=on_cuda)
