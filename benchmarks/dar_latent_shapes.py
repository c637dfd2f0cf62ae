"""Other shapes of ``dar_latent`` on the real model, each trained in a finished DAR job's folder (``allhere demo
--model smollm2 --mechanism dar``) exactly as the job trains its own (d_c = d/4): the same data, plan, calibration
windows, two stages and seeds, then measured by the job's held-out stage. One table row per shape, beside the
job's DAR and control.

    python benchmarks/dar_latent_shapes.py --shapes 64:4            # d_c = 64, 4 rotary pairs per KV head
    python benchmarks/dar_latent_shapes.py --run runs/smollm2 --shapes 64:4 96:4

A shape's model lands in ``RUN/dar/latent-w<w>-d<d_c>-r<r>/stage2/model`` (served by ``allhere serve``, timed by
``serve_throughput.py --real RUN/dar MODEL``); its row in ``RUN/dar/results/``. Rerunning reads finished stages
back. Loss ratios as the job's report gives them: vs DAR = DAR's held-out loss / the shape's (the quality DAR as
the paper defines it keeps), vs control = the control's / the shape's. KV numbers: per distant token and layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def shape(text: str) -> tuple[int, int]:
    try:
        d_c, pairs = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected D_C:PAIRS, e.g. 64:4") from None
    return d_c, pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--run", type=Path, default=Path("runs/smollm2"), help="the job's --out (default runs/smollm2)")
    p.add_argument("--shapes", type=shape, nargs="+", required=True, metavar="D_C:PAIRS")
    a = p.parse_args()
    task = a.run / "dar"
    results = task / "results"
    if not (task / "settings.json").exists():
        p.error(f"{task} holds no DAR job: run allhere demo --model smollm2 --mechanism dar --out {a.run} first")

    from allhere.mechanisms import DARConfig, DARLatentConfig
    from allhere_recipes import real_runs as runs
    from allhere_recipes.job import Job
    from allhere_recipes.real_dar import folder_of, mechanisms, two_stages
    from allhere_recipes.real_plan import RealPlan

    settings = json.loads((task / "settings.json").read_text())
    plan = RealPlan(**settings["plan"])
    tokenizer, base, data = runs.load_and_claim(task, "dar", Path(settings["model"]), plan, plan.device,
                                                settings["data_path"], print)
    job_mechs = mechanisms(plan, base.config).values()
    dar_mech = next(m for m in job_mechs if isinstance(m, DARConfig) and m.window)
    own = next(m for m in job_mechs if isinstance(m, DARLatentConfig))  # the job's d_c = d/4, shown when finished
    shapes = list(dict.fromkeys([*([(own.d_down, own.rope_pairs)] if (results / f"{folder_of(own)}.json").exists()
                                   else []), *a.shapes]))
    done = [results / f"{n}.json" for n in ("control", folder_of(dar_mech))]
    if not all(f.exists() for f in done):
        p.error(f"the DAR job in {task} is not finished ({', '.join(str(f) for f in done if not f.exists())} "
                f"missing): finish it with allhere demo --model smollm2 --mechanism dar --out {a.run}")
    batches = data.batches(plan.batch_size, plan.seq_len)
    job = Job(True)
    rows = {}
    for d_c, pairs in shapes:
        mech = DARLatentConfig(window=plan.window, d_down=d_c, rope_pairs=pairs)
        model, rows[(d_c, pairs)] = two_stages(job, task, mech, base, tokenizer, data, batches, plan)
        del model
    control, dar = (json.loads(f.read_text()) for f in done)
    cfg = base.config
    kv_heads = cfg.num_key_value_heads
    kv_dims = kv_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    print("| shape | KV numbers | held-out loss | vs DAR | vs control | KV bytes / token at "
          f"{control['long_tokens']:,} | x plain |\n|---|---|---|---|---|---|---|")
    for name, r, numbers in [("control", control, 2 * kv_dims),
                             (f"DAR w={plan.window} d_down={dar_mech.d_down}", dar, dar_mech.d_down)] + [
            (f"dar_latent d_c={d_c} r={k}", rows[(d_c, k)], d_c + 2 * k * kv_heads) for d_c, k in shapes]:
        print(f"| {name} | {numbers} | {r['loss']:.4f} | {100 * dar['loss'] / r['loss']:.1f}% | "
              f"{100 * control['loss'] / r['loss']:.1f}% | {r['kv_bytes_per_token_long']:,.0f} | "
              f"{r['kv_bytes_per_token_long'] / control['kv_bytes_per_token_long']:.2f}x |")


if __name__ == "__main__":
    main()
