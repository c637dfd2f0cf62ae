"""AA-MoE attention cases shared by the op, layer and GPU tests: random inputs and a brute-force oracle."""

import math

import torch


def random_case(b=2, h=4, hkv=2, lq=11, lk=13, d=8, m=3, e=2, k_max=3, seed=0, grad=True):
    """Random q/k/v/memory and a valid random choice: distinct previous chunks and experts per query."""
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g).requires_grad_(grad)  # noqa: E731
    q, k, v = t(b, h, lq, d), t(b, hkv, lk, d), t(b, hkv, lk, d)
    mk, mv = t(h, e, m, d), t(h, e, m, d)
    n_chunks = -(-lk // m)
    choice = torch.full((b, lq, k_max), -1, dtype=torch.long)
    for bi in range(b):
        for i in range(lq):
            pos = lk - lq + i
            options = list(range(pos // m)) + [n_chunks + x for x in range(e)]
            take = torch.randperm(len(options), generator=g)[:int(torch.randint(0, k_max + 1, (1,), generator=g))]
            for r, o in enumerate(take.tolist()):
                choice[bi, i, r] = options[o]
    logp = t(b, lq, k_max)
    return q, k, v, mk, mv, choice, logp


def brute_force(q, k, v, mk, mv, choice, logp, m, own, q_mem=None):
    """Expert slots are read by q_mem (default q)."""
    q_mem = q if q_mem is None else q_mem
    b, h, lq, d = q.shape
    lk, g = k.shape[2], h // k.shape[1]
    n_chunks = -(-lk // m)
    out = torch.zeros(b, h, lq, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                pos = lk - lq + i
                logits, vals = [], []
                if own:
                    for j in range((pos // m) * m, pos + 1):
                        logits.append(k[bi, hi // g, j] @ q[bi, hi, i]), vals.append(v[bi, hi // g, j])
                for r in range(choice.shape[2]):
                    c = int(choice[bi, i, r])
                    if c < 0:
                        continue
                    for s in range(m):
                        if c < n_chunks:
                            key, val, query = k[bi, hi // g, c * m + s], v[bi, hi // g, c * m + s], q[bi, hi, i]
                        else:
                            key, val, query = mk[hi, c - n_chunks, s], mv[hi, c - n_chunks, s], q_mem[bi, hi, i]
                        logits.append(key @ query + logp[bi, i, r] * math.sqrt(d)), vals.append(val)
                if not logits:
                    continue
                s = torch.stack(logits).double() / math.sqrt(d)
                out[bi, hi, i] = torch.softmax(s, 0) @ torch.stack(vals).double()
    return out
