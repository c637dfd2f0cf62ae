"""Brute-force ground truth shared by the tests: one (batch, head, query) at a time, in float64."""

import math

import torch


def brute_force_aha(q, k, v, gate, window):
    """Loop over every (batch, head, token); full prefix where gate is 1, the last `window` keys else."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    g = h // k.shape[1]
    off = lk - lq
    out = torch.zeros(b, h, lq, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                pos = off + i
                first = 0 if bool(gate[bi, hi, i]) else max(0, pos - window + 1)
                keys = k[bi, hi // g, first:pos + 1].double()
                vals = v[bi, hi // g, first:pos + 1].double()
                s = keys @ q[bi, hi, i].double() / math.sqrt(d)
                out[bi, hi, i] = torch.softmax(s, 0) @ vals
    return out


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
