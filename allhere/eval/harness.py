"""lm-evaluation-harness integration, with mu_f reported next to each task's metrics.

From the shell: ``allhere eval --model PATH --tasks ...`` (lm-eval's own ``lm_eval`` command cannot load
allhere: it has no plugin entry point for models). From Python: ``import allhere.eval.harness`` registers
the model name ``allhere`` with lm-eval, then ``lm_eval.simple_evaluate(model="allhere",
model_args="pretrained=PATH", ...)`` works, or pass ``AllhereLM(PATH)`` as the model.

``pretrained`` is an allhere checkpoint (``*.safetensors``, byte-level tokens), a folder with a
transformers model (converted by allhere to AHA or DAR, or plain), or a GGUF file (``allhere.hf.gguf``: its
weights de-quantized to float32). On a plain transformers model every
request is scored as lm-eval's own ``hf`` model scores it: the same tokens (``requests``), the same
windows for rolling log-likelihoods, the same greedy generations and stop rules. Requests run in batches
of ``batch_size`` (``runners``: padding, KV caches, mu_f).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path

import torch

from .._optional import require

require("lm_eval", "eval")

from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from ..runtime.progress import progress  # noqa: E402
from ..validation import ConfigError  # noqa: E402
from .requests import chunks, cut_at_stops, encode_pair, gen_group_key, generation_settings, max_length_of, share_inputs  # noqa: E402


@register_model("allhere")
class AllhereLM(LM):
    """``batch_size``: requests per forward pass or generation batch (lm-eval's "auto" is taken as 16).
    ``max_length``: tokens the model reads at most (default: a transformers model's own, as lm-eval reads
    it off the config; 2048 for allhere checkpoints). ``max_gen_toks``: new tokens when a task sets none.
    ``add_bos_token``: None keeps the tokenizer's default, as lm-eval's ``hf`` model does. Other
    arguments lm-eval hands every model (``max_batch_size``, ...) are ignored."""

    def __init__(self, pretrained: str, device: str = "cpu", max_length: int | None = None,
                 batch_size: int | str = 16, max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 show_progress: bool = True, **kwargs) -> None:
        super().__init__()
        self.show_progress = show_progress  # a bar (a line every 5% off a terminal) over each batch of requests
        path = Path(pretrained)
        self._device = torch.device(device)
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if path.suffix == ".safetensors":
            from ..runtime.model_checkpoint import load_model
            from .runners import DecoderRunner

            model, _ = load_model(path, device=device)
            self.runner = DecoderRunner(model.eval(), self._device)
            self.max_length = int(max_length or 2048)
        else:
            from ..hf.io import load_local
            from .runners import HFRunner

            tokenizer, model = load_local(path)  # plain, saved converted to AHA / DAR, or a GGUF file
            self.runner = HFRunner(model.to(self._device).eval(), tokenizer, self._device,
                                   None if add_bos_token is None else _flag(add_bos_token))
            self.max_length = int(max_length or max_length_of(model.config, tokenizer))

    def mu_f(self) -> dict[str, float]:
        return self.runner.mu_f()

    # -- the three request types ------------------------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        r = self.runner
        pairs = [encode_pair(r.encode, lambda s: r.encode(s, special=False), r.prefix_id, *req.args)
                 for req in requests]
        bar = progress(len(requests), "lm-eval loglikelihood requests", enabled=self.show_progress)
        out = self._score(pairs, [req.task_name for req in requests], bar)
        bar.close()
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        """The sum over every token of a text, in lm-eval's disjoint windows of ``max_length`` tokens: the
        first token predicted from the prefix token, each later window from the token before it."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pairs, owner, tasks = [], [], []
        for i, req in enumerate(requests):
            windows = get_rolling_token_windows(token_list=self.runner.encode(req.args[0]),
                                                prefix_token=self.runner.prefix_id, max_seq_len=self.max_length,
                                                context_len=1)
            for ctx, cont in map(make_disjoint_window, windows):
                pairs.append((ctx, cont))
                owner.append(i)
                tasks.append(req.task_name)
        bar = progress(len(pairs), "lm-eval rolling loglikelihood windows", enabled=self.show_progress)
        scores = self._score(pairs, tasks, bar)
        bar.close()
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        return totals

    def generate_until(self, requests) -> list[str]:
        """Greedy generation (unless a task asks to sample) with the KV cache, batched by equal generation
        settings, longest prompt first; each answer ends before its first stop string."""
        r = self.runner
        groups = defaultdict(list)
        for i, req in enumerate(requests):
            groups[gen_group_key(req.args[1])].append(i)
        out: list[str | None] = [None] * len(requests)
        bar = progress(len(requests), "lm-eval generation requests", enabled=self.show_progress)
        for members in groups.values():
            until, limit, settings = generation_settings(requests[members[0]].args[1], self.max_gen_toks, r.eos_text)
            room = self.max_length - limit
            if room < 1:
                raise ConfigError(f"a task asks for {limit} new tokens, as many as the model's max_length "
                                  f"({self.max_length}): no room is left for the prompt")
            contexts = {i: requests[i].args[0] for i in members}
            order = sorted(members, key=lambda i: (-len(r.encode(contexts[i])), contexts[i]))
            for batch in chunks(order, self.batch_size):
                prompts = [p[-room:] for p in r.encode_batch([contexts[i] for i in batch])]
                new = r.generate(prompts, limit, until, settings, [requests[i].task_name for i in batch])
                for i, ids in zip(batch, new):
                    out[i] = cut_at_stops(r.decode(ids), until)
                bar.update(len(batch))
        bar.close()
        return out

    def _score(self, pairs, tasks, bar) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each (context tokens, continuation tokens) pair: requests with the
        same model input share a forward pass; those run longest first in batches."""
        out = [(0.0, True)] * len(pairs)  # an empty continuation: nothing to score
        bar.update(sum(1 for _, cont in pairs if not cont))
        for batch in chunks(share_inputs(pairs, self.max_length), self.batch_size):
            logps = self.runner.logprobs([g.input for g in batch], [g.keep for g in batch],
                                         [tasks[g.members[0][0]] for g in batch])
            for group, logp in zip(batch, logps):
                for i, cont in group.members:
                    target = torch.tensor(cont[-len(logp):], device=logp.device)
                    rows = logp[-len(target):]
                    out[i] = (rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all()))
                bar.update(len(group.members))
        return out


def _flag(value) -> bool:
    """A boolean model argument, given as a bool or as lm-eval passes ``model_args`` strings."""
    if isinstance(value, str):
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"add_bos_token must be true or false, got {value!r}")
        return value.lower() == "true"
    return bool(value)


def _dataset_not_found() -> type[Exception]:
    try:
        from datasets.exceptions import DatasetNotFoundError
    except ImportError:  # older datasets
        return ConnectionError
    return DatasetNotFoundError


def task_manager(include_path: str | None = None):
    """lm-eval's index of tasks, with the YAMLs under ``include_path`` over its own. Building one reads every
    task file lm-eval ships (about 6 s on one core), so it is built once per process for an include path as its
    YAML files stand: adding, removing or changing one there builds it again. The tasks themselves are made
    afresh from their files at every evaluation."""
    if include_path is None:
        return _task_manager(None, ())
    root = Path(include_path).resolve()
    files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.suffix in (".yaml", ".yml"))
    return _task_manager(str(root), tuple((str(f), (st := f.stat()).st_mtime_ns, st.st_size) for f in files))


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str | None, files: tuple):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def evaluate(pretrained: str, tasks: list[str], include_path: str | None = None, limit: int | None = None,
             device: str = "cpu", num_fewshot: int | None = None, verbose: bool = True,
             show_progress: bool = True, batch_size: int = 16) -> dict:
    """Run lm-eval tasks on a model; returns lm-eval's results with ``mu_f`` added to every task.
    ``verbose`` False hides lm-eval's own bars (building each task's prompts); ``show_progress`` is ours
    over the scored requests."""
    import lm_eval.api.task
    from lm_eval import simple_evaluate

    manager = task_manager(include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = "lm-eval's tasks" + (f" or {include_path}" if include_path else "")
        raise ConfigError(f"unknown lm-eval task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not in "
                          f"{where} (lm-eval lists its tasks with: lm-eval ls tasks)")
    lm = AllhereLM(pretrained, device=device, show_progress=show_progress, batch_size=batch_size)
    bars = getattr(lm_eval.api.task, "tqdm", None)  # the bar lm-eval builds each task's prompts under
    if bars is not None and not verbose:
        lm_eval.api.task.tqdm = functools.partial(bars, disable=True)
    try:
        res = simple_evaluate(model=lm, tasks=tasks, task_manager=manager,
                              limit=limit, num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0)
    except (ConnectionError, _dataset_not_found()) as e:  # a task's dataset is neither cached nor reachable
        raise ConfigError(f"a task's dataset could not be loaded ({' '.join(str(e).split())[:200]}); allhere runs "
                          "offline: put the dataset in the datasets cache first, or give local data through "
                          "--include-path task YAMLs") from None
    finally:
        if bars is not None:
            lm_eval.api.task.tqdm = bars
    for task, mu in lm.mu_f().items():
        res["results"].setdefault(task, {})["mu_f"] = mu
    return res["results"]
