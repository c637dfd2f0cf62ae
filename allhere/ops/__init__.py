"""Attention ops. Each op has a dense reference twin (``naive``, the ground truth in fp32) and fast paths
tested against it; an op with several paths picks one by ``allhere.backend``.

Layout everywhere: q [batch, heads, q_len, dim], k/v [batch, kv_heads, kv_len, dim] with heads a
multiple of kv_heads (grouped-query attention), q_len <= kv_len and the queries being the *last*
q_len positions of the keys (bottom-right alignment: prefill has q_len == kv_len, a decode step has
q_len == 1).
"""
