"""Attention over a paged KV cache (op family ``"paged"``): what a served layer computes, whatever engine owns the
cache, its blocks and its block table. ``paged_attention`` is the torch path; the family's paths (reference, torch,
Triton) are in ``dispatch`` and registered in ``allhere.ops.families`` like every other family's.

Modules: ``attention`` (the cache's block layout, the rule of what each row class reads, ``paged_attention``),
``chunks`` (its prefill tiles, the gather of blocks, the merge of pieces), ``decode`` (its decode rows),
``dispatch`` (the family's paths), ``aha_prefill`` (AHA's prefill rows in a few fused calls), ``aha_triton`` (AHA
through the Triton paged kernels), ``dar_far`` (DAR's far keys rebuilt from paged latents, dar_latent's read
absorbed), ``dar_latent_decode`` (dar_latent's decode step at once), ``step_plan`` (``PagedStepPlan``: one step's
batch and what its layers share, made once per step).
"""

from .attention import Read, causal_read, paged_attention, paged_view, window_read, write
from .dispatch import paged_reference

__all__ = ["Read", "causal_read", "paged_attention", "paged_reference", "paged_view", "window_read", "write"]
