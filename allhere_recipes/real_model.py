"""``allhere demo --model smollm2``: the AHA paper's protocol ("Learning When Not to Attend Globally", Section 3)
on a real pretrained language model.

1. the pretrained model (a GGUF file or a transformers folder; ``allhere fetch smollm2`` gets SmolLM2-135M-
   Instruct) is converted to AHA with its routers open, so it starts computing what the pretrained model did;
2. it is fine-tuned with L_LM + lambda L_reg, beside a control: the same model, full attention, the same data,
   steps and learning rate (``real_plan`` says which and why);
3. every model is measured on held-out text (Retain % against the control and the pretrained model; AHA's
   mu_f per layer and head, and its long tail), on passkey retrieval beyond the window (pretrained, control,
   AHA, AHA with every gate local, and with every gate global), on a few chat prompts, and AHA's decode speed
   at a long prompt against the plain model's;
4. report.md, report.json and mu_f_heatmap.png are written into ``<out>/aha``, with both fine-tuned models as
   transformers folders (``aha/model``, ``control/model``).
A rerun with the same settings continues where the last one stopped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from allhere.data.chat import ensure_chat_template
from allhere.eval.passkey import passkey_accuracy, passkey_prompts
from allhere.hf.io import check_causal_lm
from allhere.mechanisms import AHAConfig
from allhere.routing import set_forced_gate
from allhere.runlock import run_lock

from . import real_probes as probes
from .job import Job
from .real_plan import RealPlan, preset_plan
from .real_report import render_aha, write_aha_report
from .real_runs import (
    DECODE_TOKENS,
    fine_tune,
    load_and_claim,
    plan_run,
    plan_work,
    resolve_model,
    stage,
    token_cost,
    train_config,
    work_bar,
)
from .rundir import check_out


def aha_config(plan: RealPlan) -> AHAConfig:
    return AHAConfig(window=plan.window, lam=plan.lam)


def run_real_demo(model: str = "smollm2", out: str | Path = "runs/smollm2", preset: str | None = None,
                  device: str = "cpu", data_path: str | None = None, progress: bool = True, log=print) -> dict:
    """Run (or continue) the job in ``out/aha``; write its report there; return it."""
    plan = preset_plan(preset or ("gpu" if device.startswith("cuda") else "cpu"), device)
    source = resolve_model(model)
    check_causal_lm(source, convertible=True, mechanism=aha_config(plan))  # before anything is loaded
    check_out(out)
    task = Path(out) / "aha"
    t0 = time.time()
    with run_lock(out):
        tokenizer, base, data = load_and_claim(task, "aha", source, plan, device, data_path, log, plan.window + 16)
        ensure_chat_template(tokenizer)  # a model without one (a base model) chats through allhere's fallback
        prompts = passkey_prompts(tokenizer, plan.passkey_prompts, plan.passkey_length, 2 * plan.window)
        job = plan_job(task, plan, base, progress)
        runs = {"aha": train_config(plan, plan.steps, plan.lr, plan.lam, plan.target_mu_f, plan.router_lr_mult),
                "control": train_config(plan, plan.steps, plan.lr)}
        batches = data.batches(plan.batch_size, plan.seq_len, plan.recall_share)

        def measure(name: str, m, routed: bool = False) -> dict:
            row = stage(task, f"{name}-heldout", lambda: _heldout(job, task, f"{name}-heldout", m, data, device))
            row["passkey"] = stage(task, f"{name}-passkey",
                                   lambda: _passkey(job, task, f"{name}-passkey", m, tokenizer, prompts))
            row["chat"] = stage(task, f"{name}-chat", lambda: _chat(job, task, f"{name}-chat", m, tokenizer, plan))
            # the same model with every gate local (a sliding window of w), then every gate global (full
            # attention with the fine-tuned weights: what the routers' choices cost, apart from the weights')
            for forced, which in ((False, "local"), (True, "global")) if routed else ():
                set_forced_gate(m, forced)
                try:
                    part = f"{name}-{which}"
                    row[f"all_{which}"] = stage(task, f"{part}-heldout",
                                                lambda: _heldout(job, task, f"{part}-heldout", m, data, device))
                    row[f"all_{which}"]["passkey"] = stage(task, f"{part}-passkey", lambda: _passkey(
                        job, task, f"{part}-passkey", m, tokenizer, prompts))
                finally:
                    set_forced_gate(m, None)
            if routed:
                row["long_tail"] = probes.long_tail(row["usage"])
            return row

        rows = {"pretrained": measure("pretrained", base)}
        aha = fine_tune(task / "aha", base, aha_config(plan), runs["aha"], batches, tokenizer, job)
        rows["aha"] = measure("aha", aha, routed=True)
        control = fine_tune(task / "control", base, None, runs["control"], batches, tokenizer, job)
        rows["control"] = measure("control", control)
        del base
        speed = stage(task, "speed", lambda: _speed(job, task, control, aha, data, plan))
        report = summarize(plan, rows, speed, data.description, str(source), task)
        report["seconds_this_call"] = round(time.time() - t0, 1)
        write_aha_report(task, report)
    return report


def plan_job(task: Path, plan: RealPlan, base, progress: bool) -> Job:
    """Every training run and evaluation of the job, for the whole job's time left."""
    job = Job(progress)
    plan_run(job, task / "aha", train_config(plan, plan.steps, plan.lr), base, plan.seq_len)
    plan_run(job, task / "control", train_config(plan, plan.steps, plan.lr), base, plan.seq_len)
    forward = lambda tokens: token_cost(base, tokens, plan.seq_len)  # noqa: E731
    for name in ("pretrained", "aha", "control", "aha-local", "aha-global"):
        plan_work(job, task, f"{name}-heldout", plan.eval_sequences, forward(plan.seq_len))
        plan_work(job, task, f"{name}-passkey", plan.passkey_prompts,
                  forward(plan.passkey_length + 8 * DECODE_TOKENS))
        if name in ("pretrained", "aha", "control"):
            plan_work(job, task, f"{name}-chat", len(probes.CHAT_PROMPTS), forward(plan.chat_tokens * DECODE_TOKENS))
    plan_work(job, task, "speed", 3, forward(plan.speed_prompt + (plan.speed_tokens + 2) * DECODE_TOKENS))
    return job


def _heldout(job: Job, task: Path, name: str, model, data, device: str) -> dict:
    bar = work_bar(job, task, name, len(data.heldout))
    rows = []
    for window in data.heldout.split(1):
        rows.append(probes.heldout(model, window, device))
        bar.update(1)
    bar.close()
    out = {k: sum(r[k] for r in rows) / len(rows) for k in ("loss", "bits_per_token", "mu_f")}
    if "usage" in rows[0]:
        heads = len(rows[0]["usage"][0])
        out["usage"] = [[sum(r["usage"][i][j] for r in rows) / len(rows) for j in range(heads)]
                        for i in range(len(rows[0]["usage"]))]
    return out


def _passkey(job: Job, task: Path, name: str, model, tokenizer, prompts) -> dict:
    bar = work_bar(job, task, name, len(prompts))
    result = passkey_accuracy(model, tokenizer, prompts, done=bar.update)
    bar.close()
    return result


def _chat(job: Job, task: Path, name: str, model, tokenizer, plan: RealPlan) -> dict:
    bar = work_bar(job, task, name, len(probes.CHAT_PROMPTS))
    replies = probes.chat_replies(model, tokenizer, plan.chat_tokens)
    bar.update(len(replies))
    bar.close()
    return {"prompts": list(probes.CHAT_PROMPTS), "replies": replies}


def _speed(job: Job, task: Path, plain, aha, data, plan: RealPlan) -> dict:
    """Decode at a long held-out prompt: the plain model (the control) on both of its caches, then AHA."""
    bar = work_bar(job, task, "speed", 3)
    ids = probes.long_prompt(data.heldout_docs, plan.speed_prompt)
    rows = []
    for name, model in (("plain (control)", plain), ("AHA", aha)):
        for row in probes.decode_speed(model, ids, plan.speed_tokens, plan.device):
            rows.append({"model": name, **row})
            bar.update(1)
    bar.close()
    best = min(r["ms_per_step"] for r in rows if r["model"].startswith("plain"))
    for r in rows:
        r["speedup"] = best / r["ms_per_step"]
    return {"rows": rows, "load_average_after": list(os.getloadavg())}


def summarize(plan: RealPlan, rows: dict, speed: dict, data: str, source: str, task: Path) -> dict:
    """The report: the rows with Retain % against the pretrained model and the control, and the goals."""
    pre, control, aha = rows["pretrained"]["loss"], rows["control"]["loss"], rows["aha"]
    for r in (*rows.values(), aha["all_local"], aha["all_global"]):
        r["retain_vs_pretrained"] = 100.0 * pre / r["loss"]
        r["retain_vs_control"] = 100.0 * control / r["loss"]
    pk = {name: rows[name]["passkey"]["accuracy"] for name in rows}
    local_pk = aha["all_local"]["passkey"]["accuracy"]
    aha_speed = next(r["speedup"] for r in speed["rows"] if r["model"] == "AHA")
    goals = {
        "AHA keeps >= 99% of the control's held-out quality (loss ratio)": aha["retain_vs_control"] >= 99.0,
        f"AHA mu_f on held-out text <= {'7' if plan.device != 'cpu' else '10'}%":
            aha["mu_f"] <= (0.07 if plan.device != "cpu" else 0.10),
        "passkey: AHA within 5 points of the control": pk["aha"] >= pk["control"] - 0.05,
        "passkey: AHA with every gate local near 0 (<= 10%)": local_pk <= 0.10,
        "long tail: the busiest 10% of heads make >= half of the global calls":
            aha["long_tail"]["busiest_share_of_global_calls"] >= 0.5,
        "AHA decodes at least as fast as the plain model at the long prompt": aha_speed >= 1.0,
    }
    return {"model": source, "plan": plan.to_dict(), "data": data, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "rows": rows, "speed": speed, "goals": goals,
            "histories": {n: _history(task / n) for n in ("aha", "control")}}


def _history(folder: Path) -> list:
    path = folder / "history.json"
    return json.loads(path.read_text()) if path.exists() else []


__all__ = ["run_real_demo", "render_aha"]
