"""Workers of the Hugging Face context-parallel tests (gloo): a tiny converted Hugging Face model, one packed
batch of documents, the loss and every gradient of one process against the ring's on shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers

from allhere.distributed.context import context_parallel, mean_over_ranks, shard_loss
from allhere.hf import HFCausalLM, convert
from allhere.losses import training_loss
from allhere.mechanisms import AHAConfig, DARConfig, FullConfig, SlidingConfig

N, LAM = 32, 0.01
MECHANISMS = {"full": FullConfig(), "sliding": SlidingConfig(window=5), "aha": AHAConfig(window=5, tau=0.5, lam=LAM),
              "dar": DARConfig(window=5, d_down=16)}


def model(folder: str, kind: str) -> HFCausalLM:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(1)
    convert(hf, MECHANISMS[kind], layers="all")
    return HFCausalLM(hf)


def batch(vocab: int):
    """ids [2, N] and segment starts of packed documents (row 0: three, row 1: two, one crossing the middle)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, vocab, (2, N), generator=g)
    pos = torch.tensor([list(range(9)) + list(range(14)) + list(range(9)), list(range(20)) + list(range(12))])
    return ids, (torch.arange(N) - pos)


def grads(net) -> dict:
    return {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


def single(folder: str, kind: str) -> dict:
    net = model(folder, kind)
    ids, starts = batch(net.hf.config.vocab_size)
    loss = training_loss(net(ids, segment_starts=starts), ids, LAM)
    loss.total.backward()
    return {"total": loss.total.item(), "lm": loss.lm.item(), "grads": grads(net)}


def sharded(rank, world, tmp, folder, cases):
    results = {}
    for kind, layout in cases:
        net = model(folder, kind)
        ids, starts = batch(net.hf.config.vocab_size)
        loss = shard_loss(net, ids, LAM, layout, segment_starts=starts)
        loss.total.backward()
        g = grads(net)
        for t in g.values():
            dist.all_reduce(t)
            t /= world
        results[f"{kind}-{layout}"] = {"total": mean_over_ranks(loss.total), "lm": mean_over_ranks(loss.lm),
                                       "grads": g}
    try:  # a hybrid model's unconverted sliding layers cannot run on shards
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with context_parallel(HFCausalLM(convert(hf, FullConfig(), layers=[0])), layout="zigzag"):
            pass
        results["refused"] = ""
    except NotImplementedError as e:
        results["refused"] = str(e)
    return results
