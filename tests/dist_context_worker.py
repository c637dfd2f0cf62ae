"""Worker of the context-parallel tests (CPU, gloo, started by ``dist_worker.launch``): a tiny ``Decoder``
runs forward + backward on this rank's shard of a batch; the one-process reference is ``single``, run in
the test's own process with the same model and batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from allhere import masks
from allhere.config import ModelConfig
from allhere.losses import training_loss
from allhere.mechanisms import AHAConfig, FullConfig, SlidingConfig
from allhere.mechanisms.base import mechanism_layers
from allhere.model import Decoder

N, BATCH, VOCAB = 64, 2, 64
LAM = 0.05  # lambda of L_reg: large enough that the routers' L_reg gradient counts

MECHANISMS = {
    "full": FullConfig(),
    "sliding": SlidingConfig(window=12),  # 12 > a zigzag chunk at 4 ranks (8): reads two neighbour chunks
    "aha": AHAConfig(window=6, lam=LAM, router_init="neutral"),  # about half the gates open
}
if hasattr(masks, "longformer"):
    from allhere.mechanisms import LongformerConfig

    MECHANISMS["longformer"] = LongformerConfig(window=5, global_first=2)  # window + the first 2 tokens global


def model(kind: str) -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               mechanism=MECHANISMS[kind]))


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, N), generator=torch.Generator().manual_seed(1))


class SavedBytes:
    """Bytes of the storages autograd saves for the backward during a forward pass, parameters excluded:
    ``attention`` inside the layers' mechanisms, ``rest`` everywhere else (saved_tensors_hooks nest: the
    innermost pair records)."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in net.parameters()}
        self.seen = {"attention": {}, "rest": {}}
        self.mechs = mechanism_layers(net)
        self.handles = []
        self.inner = []

    def _hooks(self, part: str):
        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.params:
                self.seen[part][ptr] = t.untyped_storage().nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def __enter__(self):
        def pre(module, args):
            self.inner.append(self._hooks("attention"))
            self.inner[-1].__enter__()

        def post(module, args, out):
            self.inner.pop().__exit__(None, None, None)

        for m in self.mechs:
            self.handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        self.outer = self._hooks("rest")
        self.outer.__enter__()
        return self

    def __exit__(self, *exc):
        self.outer.__exit__(*exc)
        for h in self.handles:
            h.remove()

    def totals(self) -> dict:
        t = {k: sum(v.values()) for k, v in self.seen.items()}
        t["model"] = t["attention"] + t["rest"]
        return t


def grads(net: torch.nn.Module) -> dict:
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def single(kind: str) -> dict:
    """The one-process run: loss fields, every parameter's gradient, saved bytes."""
    net = model(kind)
    ids = batch()
    with SavedBytes(net) as saved:
        out = net(ids)
    loss = training_loss(out, ids, LAM)
    loss.total.backward()
    res = {"total": loss.total.item(), "lm": loss.lm.item(), "grads": grads(net), "saved": saved.totals()}
    if loss.mu_f is not None:
        res.update(l_reg=loss.l_reg.item(), mu_f=loss.mu_f.item())
    return res


def sharded(rank, world, tmp, cases):
    """Each case (kind, layout): forward + backward of this rank's shard under ``context_parallel``; the
    gradients all-reduced (mean over ranks), the loss fields averaged over ranks."""
    from allhere.distributed import RingStats
    from allhere.distributed.context import context_parallel, mean_over_ranks

    results = {}
    for kind, layout in cases:
        net = model(kind)
        stats = RingStats()
        with context_parallel(net, layout=layout, stats=stats) as cp:
            ids, pos, targets = cp.shard(batch())
            with SavedBytes(net) as saved:
                out = net(ids, positions=pos)
            loss = cp.loss(out, targets, LAM)
            loss.total.backward()
        g = grads(net)
        for t in g.values():
            dist.all_reduce(t)
            t /= world
        res = {"total": mean_over_ranks(loss.total), "lm": mean_over_ranks(loss.lm), "grads": g,
               "saved": saved.totals(), "rounds": stats.counts["forward"]["rounds"]}
        if loss.mu_f is not None:
            res.update(l_reg=mean_over_ranks(loss.l_reg), mu_f=mean_over_ranks(loss.mu_f))
        results[f"{kind}-{layout}"] = res
    results["errors"] = errors(world)
    return results


def errors(world) -> dict:
    """The messages of what context parallelism refuses (every rank reaches the same error before any
    communication)."""
    from allhere.distributed.context import context_parallel

    found = {}
    net = model("full")
    with context_parallel(net) as cp:
        ids, pos, _ = cp.shard(batch())
        for name, call in (("positions", lambda: net(ids)),
                           ("segments", lambda: net(ids, positions=pos, segment_starts=torch.zeros_like(ids)))):
            try:
                call()
                found[name] = None
            except (ValueError, NotImplementedError) as e:
                found[name] = str(e)
    found["restored"] = all("forward" not in vars(m) for m in mechanism_layers(net))
    return found


# -- allhere.train.train(..., parallel=ParallelConfig(context_parallel=world, layout=layout)) ------------------

TRAIN_N = 32


def train_cfg():
    from allhere.config import TrainConfig

    return TrainConfig(steps=4, batch_size=2, grad_accum=2, lr=3e-3, ckpt_every=4, log_every=1)


def train_run(path, parallel=None) -> dict:
    from allhere.train import train

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Decoder(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              mechanism=MECHANISMS["aha"]))
    data = lambda step, micro, g: torch.randint(0, VOCAB, (2, TRAIN_N), generator=g)  # noqa: E731
    return train(net, data, train_cfg(), path, progress=False, parallel=parallel)


def train_spawned(rank, world, tmp, path, layout):
    """The training run on this rank; also the query lengths the ring saw (a shard's, if it ran)."""
    from allhere.distributed import ParallelConfig, context

    seen = []
    original = context.ring_gated_attention

    def counting(q, *args, **kwargs):
        seen.append(q.shape[2])
        return original(q, *args, **kwargs)

    context.ring_gated_attention = counting
    try:
        state = train_run(path, ParallelConfig(context_parallel=world, layout=layout))
    finally:
        context.ring_gated_attention = original
    return {"history": state["history"], "seen": seen}
