"""Accuracy on the recall task's retrieval tokens, and where the router goes global."""

from __future__ import annotations

import torch

from ..data.recall_task import RecallTask
from ..model import Decoder
from .heldout import static_mu_f


@torch.no_grad()
def evaluate_recall(model: Decoder, task: RecallTask, n_sequences: int = 512, batch_size: int = 64,
                    seed: int = 12345, device: str = "cpu", usage: bool = False) -> dict:
    """Greedy accuracy of predicting each query's value; mu_f on retrieval tokens and on all others; with ``usage``,
    a routed model's mu_f per layer and head too (``usage`` [layers][heads], as ``evaluate_lm`` gives it)."""
    model.eval().to(device)
    g = torch.Generator().manual_seed(seed)
    correct = total = 0
    gate_sum = {"retrieval": 0.0, "other": 0.0}
    tok = {"retrieval": 0, "other": 0}
    heads = None  # usage summed over the sequences
    for start in range(0, n_sequences, batch_size):
        ids, retrieval = task.batch(min(batch_size, n_sequences - start), g)
        ids, retrieval = ids.to(device), retrieval.to(device)
        out = model(ids)
        pred = out.logits[:, :-1].argmax(-1)
        r = retrieval[:, :-1]
        correct += (pred[r] == ids[:, 1:][r]).sum().item()
        total += r.sum().item()
        if out.routing is not None:
            for name, mask in (("retrieval", retrieval), ("other", ~retrieval)):
                gate_sum[name] += out.routing.mu_f(mask).item() * mask.sum().item()
                tok[name] += mask.sum().item()
            if usage:
                u = out.routing.usage() * ids.shape[0]
                heads = u if heads is None else heads + u
    result = {"accuracy": correct / total, "chance": 1.0 / task.n_values}
    if tok["retrieval"]:
        result["mu_f_retrieval"] = gate_sum["retrieval"] / tok["retrieval"]
        result["mu_f_other"] = gate_sum["other"] / tok["other"]
        result["mu_f"] = (gate_sum["retrieval"] + gate_sum["other"]) / (tok["retrieval"] + tok["other"])
    else:
        result["mu_f"] = result["mu_f_retrieval"] = result["mu_f_other"] = static_mu_f(model)
    if heads is not None:
        result["usage"] = (heads / n_sequences).tolist()
    return result
