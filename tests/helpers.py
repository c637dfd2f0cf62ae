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


def segment_mask(b, lq, lk, boundaries, pad_left, pad_right=None):
    """Causal within documents (``boundaries``: starts of the documents after the first) between
    ``pad_left[i]`` and ``pad_right[i]`` padding positions that no query sees (padding queries see
    nothing), [b, 1, lq, lk]."""
    pos = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    doc = lambda t: sum((t >= x).long() for x in boundaries)  # noqa: E731
    real = lambda t, p, r: (t >= p) & (t < lk - r)  # noqa: E731
    return torch.stack([(j <= pos) & real(j, p, r) & real(pos, p, r) & (doc(j) == doc(pos))
                        for p, r in zip(pad_left, pad_right or [0] * b)])[:, None]


def spy_paths(monkeypatch):
    """Record (op family, backend) of every op path that runs (``allhere.backend``'s registry) until the test
    ends; returns the list it appends to."""
    import dataclasses

    import allhere.mechanisms  # noqa: F401  (every built-in op family registered)
    from allhere import backend

    calls = []
    for op in backend.ops():
        for name, path in backend.paths(op).items():
            def counted(*args, _path=path, **kwargs):
                calls.append((_path.op, _path.backend))
                return _path.fn(*args, **kwargs)

            monkeypatch.setitem(backend._PATHS[op], name, dataclasses.replace(path, fn=counted))
    return calls


def mixed_routers(model, seed=2):
    """AHA routers with random weights (in place; returns ``model``): some (token, head) pairs global, the rest
    local."""
    from allhere.mechanisms.base import mechanism_layers

    torch.manual_seed(seed)
    with torch.no_grad():
        for mech in mechanism_layers(model):
            for p in mech.router_parameters():
                p.normal_(0, 1.0)
    return model
