"""Attention ops, in families (``FAMILIES``, registered in ``allhere.ops.families``): full, sliding, aha, dar,
dar_latent, aamoe, all_attention and paged (a served layer's attention over its paged KV cache, ``paged``), whose
paths are ops here; and patterns, whose paths are the sparse-pattern layers' own methods on ``blocksparse``,
``flex`` and ``dilated``. Each family has one entry, a dense reference path
(``*_reference``, the ground truth in fp32) and fast paths (``*_torch``, ``*_triton``) tested against it,
registered in ``allhere.backend``, which picks one per call.

Layout everywhere: q [batch, heads, q_len, dim], k/v [batch, kv_heads, kv_len, dim] with heads a
multiple of kv_heads (grouped-query attention), q_len <= kv_len and the queries being the *last*
q_len positions of the keys (bottom-right alignment: prefill has q_len == kv_len, a decode step has
q_len == 1). The paged family reads a server's batch instead: q [tokens, heads, dim] of many requests, their keys
in a paged cache (``paged.attention``).
"""

from .families import FAMILIES

__all__ = ["FAMILIES"]
