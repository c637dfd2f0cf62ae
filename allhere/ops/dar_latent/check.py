"""The argument check of the ``"dar_latent"`` op family (one place for every path)."""

from __future__ import annotations

from ..common import check_qkv


def check_latent_call(q, q_far, k_near, v_near, latent, k_rope, w_uk, w_uv):
    """Validate the layout (see ``dar_latent_attention_reference``); return (b, h, lq, d, kv_heads, lk)."""
    b, h, lq, d, g, lk = check_qkv(q, k_near, v_near)
    e_r, d_c = k_rope.shape[-1], latent.shape[-1]
    e_c = w_uk.shape[1] if w_uk.dim() == 3 else -1
    want = {"q_far": (q_far, (b, h, lq, e_r + e_c)), "latent": (latent, (b, lk, d_c)),
            "k_rope": (k_rope, (b, g, lk, e_r)), "w_uk": (w_uk, (g, e_c, d_c)), "w_uv": (w_uv, (g, d, d_c))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} (b={b}, heads={h}, q_len={lq}, kv_heads={g}, kv_len={lk}, "
                             f"dim={d}, rope dims={e_r}, content dims={e_c}, latent={d_c}); got {list(t.shape)}")
    return b, h, lq, d, g, lk
