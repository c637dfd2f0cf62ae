"""``allhere demo --model smollm2``: the AHA paper's protocol ("Learning When Not to Attend Globally", Section 3)
on a real pretrained language model, with routers taught by the model itself.

1. the pretrained model (a GGUF file or a transformers folder; ``allhere fetch smollm2`` gets SmolLM2-135M-
   Instruct) is converted to AHA with attention sinks in its local branch, and its routers are taught by the full
   model's own attention on calibration text with planted facts (``real_taught``; no training): "taught";
2. it is fine-tuned from there with L_LM + lambda L_reg (the straight-through gate), beside a control: the same
   model, full attention, the same data, steps and learning rate (``real_plan`` says which and why): "aha";
3. beside them at the same budget: the taught routers' static twin (one gate per head, the heads the teacher
   finds costliest), the routers taught without sinks, and the paper's own recipe (routers open, no sinks, lambda
   steered to the budget);
4. every model is measured on held-out text (Retain % against the control and the pretrained model, AHA's mu_f per
   layer and head and its long tail), on passkey retrieval beyond the window (with mu_f on the question's tokens),
   AHA with every gate local and every gate global; chat replies; AHA's decode speed at a long prompt against the
   plain model's;
5. report.md, report.json and mu_f_heatmap.png are written into ``<out>/aha``, every model as a transformers
   folder (``taught/model``, ``aha/model``, ``control/model``, ...), the converted ones' model cards with their
   held-out numbers, and each fine-tuning run's held-out numbers in its TensorBoard events (``real_heldout``).
A rerun with the same settings continues where the last one stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from allhere.analysis.static import set_static_heads
from allhere.data.chat import ensure_chat_template
from allhere.eval.passkey import passkey_accuracy, passkey_prompts
from allhere.hf.io import check_causal_lm
from allhere.mechanisms import AHAConfig
from allhere.routing import set_forced_gate
from allhere.runtime.runlock import run_lock

from . import real_probes as probes
from .job import Job
from .real_heldout import heldout_events, write_cards
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
from .real_taught import calibration, static_heads, taught_models
from .rundir import check_out

# every model the job measures: (its name in results/ and rows, what it gets besides held-out text and passkey)
MEASURED = {"pretrained": ("chat",), "taught": ("local",), "static": (), "taught-nosinks": (),
            "aha": ("chat", "local", "global"), "aha-paper": (), "control": ("chat",)}


def aha_config(plan: RealPlan, sinks: int | None = None) -> AHAConfig:
    return AHAConfig(window=plan.window, lam=plan.lam, sinks=plan.sinks if sinks is None else sinks)


def run_configs(plan: RealPlan) -> dict:
    """The fine-tuning runs: AHA from its taught routers, the paper's recipe, the control."""
    return {"aha": train_config(plan, plan.steps, plan.lr, plan.taught_lam, plan.taught_target_mu_f,
                                plan.taught_router_lr_mult),
            "aha-paper": train_config(plan, plan.steps, plan.lr, plan.lam, plan.target_mu_f, plan.router_lr_mult),
            "control": train_config(plan, plan.steps, plan.lr)}


def run_real_demo(model: str = "smollm2", out: str | Path = "runs/smollm2", preset: str | None = None,
                  device: str = "cpu", data_path: str | None = None, progress: bool = True, log=print,
                  seed: int = 0) -> dict:
    """Run (or continue) the job in ``out/aha``; write its report there; return it. ``seed``: the fine-tuning runs'
    (their batches)."""
    plan = dataclasses.replace(preset_plan(preset or ("gpu" if device.startswith("cuda") else "cpu"), device),
                               seed=seed)
    source = resolve_model(model, progress, log)
    check_causal_lm(source, convertible=True, mechanism=aha_config(plan))  # before anything is loaded
    check_out(out)
    task = Path(out) / "aha"
    t0 = time.time()
    with run_lock(out):
        tokenizer, base, data = load_and_claim(task, "aha", source, plan, device, data_path, log, plan.window + 16)
        ensure_chat_template(tokenizer)  # a model without one (a base model) chats through allhere's fallback
        prompts = passkey_prompts(tokenizer, plan.passkey_prompts, plan.passkey_length, 2 * plan.window)
        windows, answers = calibration(tokenizer, data, plan)
        job = plan_job(task, plan, base, progress)
        configs = run_configs(plan)
        batches = data.batches(plan.batch_size, plan.seq_len, plan.recall_share)

        def measure(name: str, m) -> dict:
            """Held-out text and passkey (and the extras ``MEASURED`` names): each stage kept in results/."""
            row = stage(task, f"{name}-heldout", lambda: _heldout(job, task, f"{name}-heldout", m, data, device))
            row["passkey"] = stage(task, f"{name}-passkey",
                                   lambda: _passkey(job, task, f"{name}-passkey", m, tokenizer, prompts))
            extras = MEASURED[name]
            if "chat" in extras:
                row["chat"] = stage(task, f"{name}-chat", lambda: _chat(job, task, f"{name}-chat", m, tokenizer,
                                                                         plan))
            # every gate local (the window and the sinks), every gate global (full attention with the model's
            # weights: what the routers' choices cost, apart from the weights')
            for forced, which in ((False, "local"), (True, "global")):
                if which in extras:
                    set_forced_gate(m, forced)
                    try:
                        row[f"all_{which}"] = measure_forced(f"{name}-{which}", m)
                    finally:
                        set_forced_gate(m, None)
            if "usage" in row:
                row["long_tail"] = probes.long_tail(row["usage"])
            if name in configs:  # a fine-tuning run: what was measured in its TensorBoard events too
                heldout_events(task / name, configs[name].steps, row, m)
            return row

        def measure_forced(part: str, m) -> dict:
            row = stage(task, f"{part}-heldout", lambda: _heldout(job, task, f"{part}-heldout", m, data, device))
            row["passkey"] = stage(task, f"{part}-passkey",
                                   lambda: _passkey(job, task, f"{part}-passkey", m, tokenizer, prompts))
            return row

        rows = {"pretrained": measure("pretrained", base)}
        (taught, teaching), (nosinks, teaching0) = taught_models(
            [(task / "taught", aha_config(plan)), (task / "taught-nosinks", aha_config(plan, sinks=0))], base,
            windows, answers, plan.mu_f, tokenizer, job)
        rows["taught"] = {**measure("taught", taught), "teaching": teaching}
        heads = static_heads(teaching, rows["taught"]["mu_f"])  # as many global heads as the routers' held-out mu_f
        set_static_heads(taught, heads)
        try:
            rows["static"] = {**measure("static", taught), "heads": int(heads.sum())}
        finally:
            set_static_heads(taught, None)
        rows["taught-nosinks"] = {**measure("taught-nosinks", nosinks), "teaching": teaching0}
        del nosinks
        aha = fine_tune(task / "aha", base, None, configs["aha"], batches, tokenizer, job, start=taught)
        rows["aha"] = measure("aha", aha)
        del taught
        paper = fine_tune(task / "aha-paper", base, aha_config(plan, sinks=0), configs["aha-paper"], batches,
                          tokenizer, job)
        rows["aha-paper"] = measure("aha-paper", paper)
        del paper
        control = fine_tune(task / "control", base, None, configs["control"], batches, tokenizer, job)
        rows["control"] = measure("control", control)
        del base
        speed = stage(task, "speed", lambda: _speed(job, task, control, aha, data, plan))
        report = summarize(plan, rows, speed, data.description, str(source), task)
        report["seconds_this_call"] = round(time.time() - t0, 1)
        write_aha_report(task, report)
        write_cards(task, report)  # the saved models' cards with the report's held-out numbers
    return report


def plan_job(task: Path, plan: RealPlan, base, progress: bool) -> Job:
    """Every teaching, training run and evaluation of the job, for the whole job's time left."""
    job = Job(progress)
    for name, cfg in run_configs(plan).items():
        plan_run(job, task / name, cfg, base, plan.seq_len)
    forward = lambda tokens: token_cost(base, tokens, plan.seq_len)  # noqa: E731
    done = all((task / name / "teaching.json").exists() for name in ("taught", "taught-nosinks"))
    # both taught in one pass: a forward of each window, then per model its labels and its fit (about a forward each)
    job.plan_named(f"{task.name}/taught", 0 if done else plan.calib_windows + plan.calib_haystacks,
                   3 * forward(plan.seq_len))
    parts = [(name, extras) for name, extras in MEASURED.items()]
    parts += [(f"{name}-{which}", ()) for name, extras in MEASURED.items() for which in ("local", "global")
              if which in extras]
    for name, extras in parts:
        plan_work(job, task, f"{name}-heldout", plan.eval_sequences, forward(plan.seq_len))
        plan_work(job, task, f"{name}-passkey", plan.passkey_prompts,
                  forward(plan.passkey_length + 8 * DECODE_TOKENS))
        if "chat" in extras:
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
    pre, control, aha, taught = rows["pretrained"]["loss"], rows["control"]["loss"], rows["aha"], rows["taught"]
    for r in (*rows.values(), aha["all_local"], aha["all_global"], taught["all_local"]):
        r["retain_vs_pretrained"] = 100.0 * pre / r["loss"]
        r["retain_vs_control"] = 100.0 * control / r["loss"]
    pk = {name: rows[name]["passkey"]["correct"] for name in rows}
    asked = aha["passkey"]
    aha_speed = next(r["speedup"] for r in speed["rows"] if r["model"] == "AHA")
    budget = 0.07 if plan.device != "cpu" else 0.10
    goals = {
        f"AHA fine-tuned from taught routers keeps >= 99% of the control's held-out quality at mu_f <= "
        f"{budget:.0%}": aha["retain_vs_control"] >= 99.0 and aha["mu_f"] <= budget,
        "passkey: AHA fine-tuned within 1 of the control's count": pk["aha"] >= pk["control"] - 1,
        "passkey: AHA's mu_f on the question's tokens at least twice its mu_f over the prompts":
            (asked.get("question_mu_f") or 0.0) >= 2 * (asked.get("prompt_mu_f") or 1.0),
        "taught routers, no fine-tuning: >= 97% of the pretrained model's held-out quality at mu_f <= 15%":
            taught["retain_vs_pretrained"] >= 97.0 and taught["mu_f"] <= 0.15,
        "passkey: taught routers within 2 of the pretrained model's count": pk["taught"] >= pk["pretrained"] - 2,
        "dynamic (taught) routers >= static heads at the same mu_f, on held-out loss and passkey":
            taught["loss"] <= rows["static"]["loss"] and pk["taught"] >= pk["static"],
        "long tail: the busiest 10% of heads make >= half of the global calls":
            aha["long_tail"]["busiest_share_of_global_calls"] >= 0.5,
        "AHA decodes at least as fast as the plain model at the long prompt": aha_speed >= 1.0,
    }
    return {"model": source, "plan": plan.to_dict(), "data": data, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "rows": rows, "speed": speed, "goals": goals,
            "histories": {n: _history(task / n) for n in ("aha", "aha-paper", "control")}}


def _history(folder: Path) -> list:
    path = folder / "history.json"
    return json.loads(path.read_text()) if path.exists() else []


__all__ = ["run_real_demo", "render_aha"]
