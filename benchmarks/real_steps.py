"""The real-model job's fine-tuning with more steps: AHA from its taught routers and the full-attention control,
both for ``--steps`` optimizer steps (the job's cpu preset: 120) at ``--lr``, lambda steered towards ``--target``.

    python benchmarks/real_steps.py --out runs/steps240-seed1 --steps 240 --target 0.12 --seed 1 [--model smollm2]

The job's own pieces (``allhere_recipes.real_model``, ``real_runs``, ``real_taught``) with the cpu preset's plan
(``--preset``) but those settings: the routers taught on the job's calibration (read back from
``<out>/aha/taught`` when there, e.g. copied from another seed's folder: the teaching does not depend on the seed),
AHA fine-tuned from them, the control fine-tuned from the pretrained model, both on the job's batches of
``--seed``; then AHA's and the control's held-out loss, AHA's mu_f there and its passkeys. Prints and writes
``<out>/steps.json``: Retain % of the control = control loss / AHA loss. Resumable per stage as the job is. On 2
cores, 240 steps: about 20 minutes per fine-tuning run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from allhere.data.chat import ensure_chat_template
from allhere.eval.passkey import passkey_prompts
from allhere_recipes import real_model
from allhere_recipes.real_plan import preset_plan
from allhere_recipes.real_runs import fine_tune, load_and_claim, resolve_model, stage
from allhere_recipes.real_taught import calibration, taught_models


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the run folder (the job's layout under <out>/aha)")
    p.add_argument("--steps", type=int, default=240, help="optimizer steps of both fine-tuning runs (default 240)")
    p.add_argument("--target", type=float, default=0.12,
                   help="AHA's lambda steered towards this share of full attention on the training batches "
                        "(default 0.12; the job: 0.09)")
    p.add_argument("--seed", type=int, default=0, help="the fine-tuning runs' batches (default 0)")
    p.add_argument("--lr", type=float, default=None, help="both runs' peak learning rate (default: the preset's)")
    p.add_argument("--model", default="smollm2", help="a fetched model's name, a GGUF file or a folder")
    p.add_argument("--preset", choices=["cpu", "tiny"], default="cpu", help="the job's plan these settings "
                   "change (default cpu; tiny: seconds, to try the script)")
    args = p.parse_args(argv)
    plan = dataclasses.replace(preset_plan(args.preset, "cpu"), steps=args.steps, taught_target_mu_f=args.target,
                               seed=args.seed, **({} if args.lr is None else {"lr": args.lr}))
    task = Path(args.out) / "aha"
    t0 = time.time()
    tokenizer, base, data = load_and_claim(task, "aha", resolve_model(args.model), plan, "cpu", None, print,
                                           plan.window + 16)
    ensure_chat_template(tokenizer)
    prompts = passkey_prompts(tokenizer, plan.passkey_prompts, plan.passkey_length, 2 * plan.window)
    windows, answers = calibration(tokenizer, data, plan)
    job = real_model.plan_job(task, plan, base, True)
    configs = real_model.run_configs(plan)
    batches = data.batches(plan.batch_size, plan.seq_len, plan.recall_share)
    ((taught, _),) = taught_models([(task / "taught", real_model.aha_config(plan))], base, windows, answers,
                                   plan.mu_f, tokenizer, job)
    rows = {}
    for name, start in (("aha", taught), ("control", None)):
        model = fine_tune(task / name, base, None, configs[name], batches, tokenizer, job, start=start)
        rows[name] = stage(task, f"{name}-heldout",
                           lambda: real_model._heldout(job, task, f"{name}-heldout", model, data, "cpu"))
        if name == "aha":
            rows[name]["passkey"] = stage(task, "aha-passkey", lambda: real_model._passkey(
                job, task, "aha-passkey", model, tokenizer, prompts))
    aha, control = rows["aha"], rows["control"]
    result = {"steps": args.steps, "target_mu_f": args.target, "seed": args.seed, "lr": plan.lr,
              "aha_loss": aha["loss"], "control_loss": control["loss"],
              "retain_vs_control": 100.0 * control["loss"] / aha["loss"], "heldout_mu_f": aha["mu_f"],
              "passkey": {k: aha["passkey"].get(k) for k in ("correct", "prompts", "question_mu_f", "prompt_mu_f")},
              "seconds_this_call": round(time.time() - t0, 1)}
    print(json.dumps(result, indent=1))
    (Path(args.out) / "steps.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
