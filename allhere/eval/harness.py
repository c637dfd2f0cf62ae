"""lm-evaluation-harness integration, with mu_f reported next to each task's metrics.

From the shell: ``allhere eval --model PATH --tasks ...`` (lm-eval's own ``lm_eval`` command cannot load
allhere: it has no plugin entry point for models). From Python: ``import allhere.eval.harness`` registers
the model name ``allhere`` with lm-eval, then ``lm_eval.simple_evaluate(model="allhere",
model_args="pretrained=PATH", ...)`` works, or pass ``AllhereLM(PATH)`` as the model.

``pretrained`` is an allhere checkpoint (``*.safetensors``, byte-level tokens) or a folder with a
transformers model (converted by allhere to AHA or DAR, or plain). Requests are scored one sequence at a time.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from .._optional import require

require("lm_eval", "eval")

from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from ..progress import progress  # noqa: E402
from ..routing import routed_layers  # noqa: E402
from ..validation import ConfigError  # noqa: E402
from .perplexity import rolling_windows  # noqa: E402


class _Bytes:
    """The byte tokenizer of allhere's own models."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@register_model("allhere")
class AllhereLM(LM):
    def __init__(self, pretrained: str, device: str = "cpu", max_length: int = 2048, batch_size: int = 1,
                 max_gen_toks: int = 256, show_progress: bool = True, **kwargs) -> None:
        super().__init__()
        self.show_progress = show_progress  # a bar (a line every 5% off a terminal) over each batch of requests
        path = Path(pretrained)
        self._device = torch.device(device)
        self.max_length = int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        if path.suffix == ".safetensors":
            from ..checkpoint import load_model

            self.model, _ = load_model(path, device=device)
            self.tok, self.hf = _Bytes(), False
        else:
            from ..hf.io import load_local

            self.tok, self.model = load_local(path)  # plain, or saved converted to AHA / DAR
            self.model.to(self._device)
            self.hf = True
        self.model.eval()
        self.gates = defaultdict(lambda: [0.0, 0])  # task -> [sum of mu_f x tokens, tokens]

    # -- model plumbing -------------------------------------------------------------------------------
    def _forward(self, ids: list[int], task: str | None) -> torch.Tensor:
        """Log-probabilities [len(ids), vocab] of one sequence; records its mu_f for ``task``."""
        x = torch.tensor([ids], device=self._device)
        with torch.no_grad():
            if self.hf:
                logits = self.model(input_ids=x).logits
                routing = None
                if routed_layers(self.model):
                    from ..hf import collect_routing

                    routing = collect_routing(self.model)
            else:
                out = self.model(x)
                logits, routing = out.logits, out.routing
        if routing is not None and task is not None:
            g = self.gates[task]
            g[0] += routing.mu_f().item() * len(ids)
            g[1] += len(ids)
        return F.log_softmax(logits[0].float(), dim=-1)

    def mu_f(self) -> dict[str, float]:
        return {task: s / n for task, (s, n) in self.gates.items() if n}

    def _each(self, requests, kind: str):
        """The requests one by one, with progress."""
        bar = progress(len(requests), f"lm-eval {kind} requests", enabled=self.show_progress)
        for req in requests:
            yield req
            bar.update(1)
        bar.close()

    # -- the three request types ------------------------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for req in self._each(requests, "loglikelihood"):
            context, continuation = req.args
            ctx, cont = self.tok.encode(context), self.tok.encode(continuation)
            if not ctx:  # the first continuation token needs something to be predicted from
                ctx = [self.tok.eos_token_id if self.tok.eos_token_id is not None else 10]
            ids = (ctx + cont)[-(self.max_length + 1):]
            logp = self._forward(ids[:-1], req.task_name)
            n = len(cont)
            targets = torch.tensor(ids[-n:], device=logp.device)
            picked = logp[-n:].gather(1, targets[:, None]).squeeze(1)
            out.append((picked.sum().item(), bool((logp[-n:].argmax(-1) == targets).all())))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for req in self._each(requests, "rolling loglikelihood"):
            ids = self.tok.encode(req.args[0])
            total = 0.0
            for start, end, first in rolling_windows(len(ids), self.max_length, self.max_length // 2):
                logp = self._forward(ids[start:end], req.task_name)
                targets = torch.tensor(ids[first:end], device=logp.device)
                total += logp[first - start - 1: end - start - 1].gather(1, targets[:, None]).sum().item()
            out.append(total)  # the first token has no prediction and is not scored
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in self._each(requests, "generation"):
            context, gen_kwargs = req.args
            until = gen_kwargs.get("until", []) or []
            until = [until] if isinstance(until, str) else until
            limit = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok.encode(context)[-self.max_length:]
            new: list[int] = []
            for _ in range(limit):  # greedy, re-reading the context each step (simple and exact)
                nxt = int(self._forward(ids + new, req.task_name)[-1].argmax())
                if nxt == self.tok.eos_token_id:
                    break
                new.append(nxt)
                text = self.tok.decode(new)
                if any(u in text for u in until):
                    break
            text = self.tok.decode(new)
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return out


def evaluate(pretrained: str, tasks: list[str], include_path: str | None = None, limit: int | None = None,
             device: str = "cpu", num_fewshot: int | None = None, verbose: bool = True,
             show_progress: bool = True) -> dict:
    """Run lm-eval tasks on a model; returns lm-eval's results with ``mu_f`` added to every task.
    ``verbose`` False hides lm-eval's own bars (building each task's prompts); ``show_progress`` is ours
    over the scored requests."""
    import lm_eval.api.task
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = "lm-eval's tasks" + (f" or {include_path}" if include_path else "")
        raise ConfigError(f"unknown lm-eval task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not in "
                          f"{where} (lm-eval lists its tasks with: lm-eval ls tasks)")
    lm = AllhereLM(pretrained, device=device, show_progress=show_progress)
    bars = getattr(lm_eval.api.task, "tqdm", None)  # the bar lm-eval builds each task's prompts under
    if bars is not None and not verbose:
        lm_eval.api.task.tqdm = functools.partial(bars, disable=True)
    try:
        res = simple_evaluate(model=lm, tasks=tasks, task_manager=manager,
                              limit=limit, num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0)
    finally:
        if bars is not None:
            lm_eval.api.task.tqdm = bars
    for task, mu in lm.mu_f().items():
        res["results"].setdefault(task, {})["mu_f"] = mu
    return res["results"]
