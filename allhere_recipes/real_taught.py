"""The real-model job's routers taught by the full model (``allhere.teaching``): the calibration windows (training
documents with facts planted and asked for beyond the window; never the held-out text nor the passkey's words), a
converted model whose routers are taught on them and saved, and the static heads of the same budget."""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import torch

from allhere.analysis.static import static_budget_k, top_k_heads
from allhere.hf import convert
from allhere.hf.card import teaching_results
from allhere.hf.io import load_local
from allhere.teaching import MARGIN
from allhere.teaching.retrieval import retrieval_windows
from allhere.teaching.teach import teach_alike

from .job import Job
from .real_runs import save_model
from .rundir import write_json


def calibration(tokenizer, data, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows [plan.calib_windows, plan.seq_len], the positions asking for a planted fact) from the job's training
    documents (a fixed draw: the same windows on every machine and rerun)."""
    docs = data.train[::max(1, len(data.train) // (4 * plan.calib_windows))]
    return retrieval_windows(tokenizer, docs, plan.calib_windows, plan.seq_len, plan.window + MARGIN,
                             plan.calib_facts, seed=0, with_answers=True,
                             haystacks=plan.calib_haystacks, filler=plan.calib_filler)


def taught_models(parts: list[tuple[Path, object]], base, windows: torch.Tensor, answers: torch.Tensor, mu_f: float,
                  tokenizer, job: Job) -> list[tuple[object, dict]]:
    """Per (folder, cfg) of ``parts``: (``base`` converted to ``cfg`` with its routers taught on ``windows`` at
    budget ``mu_f``, in float32 with the weights as saved; what the teaching found, ``allhere.teaching.Teaching``
    as a dict with the seconds of the pass that taught it), saved as ``folder/model`` with ``folder/teaching.json``
    and read back from there on a rerun. The ones not yet saved are taught together, from one pass of the model
    (``allhere.teaching.teach.teach_alike``: the configurations differ only in their windows and sinks)."""
    found: dict[int, tuple[object, dict]] = {}
    todo = []
    for i, (folder, cfg) in enumerate(parts):
        saved, record = folder / "model", folder / "teaching.json"
        if (saved / "config.json").exists() and record.exists():
            found[i] = load_local(saved, dtype=torch.float32)[1], json.loads(record.read_text())
        else:
            todo.append(i)
    if todo:
        t0 = time.time()
        models = [copy.deepcopy(base) for _ in todo]
        for i, model in zip(todo, models):
            convert(model, parts[i][1], seed=0)
        folder = parts[todo[0]][0]
        bar = job.bar(len(windows), f"{folder.parent.name}/{folder.name}")
        taught = teach_alike(models, list(windows.split(1)), mu_f, answers=list(answers.split(1)), done=bar.update)
        bar.close()
        seconds = round(time.time() - t0, 1)
        for i, model, teaching in zip(todo, models, taught):
            folder = parts[i][0]
            result = {**dataclasses.asdict(teaching), "seconds": seconds}
            save_model(model, folder / "model", tokenizer,
                       {"source": base.config.name_or_path, "results": teaching_results(teaching),
                        "settings": {"calibration_windows": len(windows), "mu_f_target": mu_f}})
            write_json(folder / "teaching.json", result)
            found[i] = model.float(), result
    return [found[i] for i in range(len(parts))]


def static_heads(teaching: dict, mu_f: float) -> torch.Tensor:
    """bool [layers, heads]: the heads the teacher finds costliest to read locally (its mean cost per head), as
    many as a share ``mu_f`` of them (rounded up), the rest local: DuoAttention's static choice ("DuoAttention:
    Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", arXiv:2410.10819) at the budget the
    dynamic routers spend."""
    cost = torch.tensor(teaching["head_cost"])
    return top_k_heads(cost, static_budget_k(mu_f, cost.numel()))
