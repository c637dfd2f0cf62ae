"""Attention ops, in families: full, sliding, aha, dar, aamoe (and the sparse patterns', registered by their
mechanisms' base on ``blocksparse``, ``flex`` and ``dilated``). Each family has one entry, a dense reference
path (``*_reference``, the ground truth in fp32) and fast paths (``*_torch``, ``*_triton``) tested against it,
registered in ``allhere.backend``, which picks one per call.

Layout everywhere: q [batch, heads, q_len, dim], k/v [batch, kv_heads, kv_len, dim] with heads a
multiple of kv_heads (grouped-query attention), q_len <= kv_len and the queries being the *last*
q_len positions of the keys (bottom-right alignment: prefill has q_len == kv_len, a decode step has
q_len == 1).
"""
