"""A whole decoder trained on a 2-D mesh (FSDP2 over all dp x cp GPUs, a context-parallel ring over cp),
per GPU: memory, ring and FSDP traffic, attention FLOPs of one step, from the cost model
(``allhere_recipes.model_cost``). A model, not a measurement: nothing is run or allocated.

    python benchmarks/scale_model.py                                   # Mistral-7B-v0.1, 128k, the default meshes
    python benchmarks/scale_model.py --model path/to/config.json --seq 65536 --meshes 1x8 2x8

Mechanisms as in ``benchmarks/ring_scale.py``: full causal; sliding window w; Longformer (window w + the
first 64 tokens global, "Longformer: The Long-Document Transformer", arXiv:2004.05150); AHA with mu_f of
every chunk's rows global in each head, spread evenly (fixed gate), and with the gate trained (two more
forward-only ring passes for the straight-through gradient). Zigzag layout, micro-batch 1, activation
checkpointing per block.
"""

from __future__ import annotations

import argparse

from allhere_recipes.model_cost import MECHANISMS, PRESETS, load_model_shape, step_cost

GIB, MIB = 2 ** 30, 2 ** 20
DEFAULT_MESHES = ("2x4", "1x8", "2x8", "1x16", "4x8")

HEAD = ("| mechanism | mesh dp×cp | state GiB/rank | activations GiB/rank | of which ring working set GiB | "
        "peak GiB/rank | peak if tiled GiB/rank | ring GiB sent/step/rank | ring MiB/round | "
        "FSDP GiB sent/step/rank | attn TFLOP/step/rank |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|")


def mesh(text: str) -> tuple[int, int]:
    try:
        dp, cp = (int(x) for x in text.lower().replace("×", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a mesh is DPxCP, e.g. 2x8; got {text!r}") from None
    if dp < 1 or cp < 1:
        raise argparse.ArgumentTypeError(f"dp and cp must be >= 1, got {text!r}")
    return dp, cp


def rows(model, n, meshes, window, mu_f):
    for mech in MECHANISMS:
        for dp, cp in meshes:
            c = step_cost(model, n, dp, cp, mech, window=window, mu_f=mu_f)
            yield (f"| {mech} | {dp}×{cp} | {c['state'] / GIB:.1f} | {c['activations'] / GIB:.1f} | "
                   f"{c['ring_working_set'] / GIB:.1f} | {c['peak'] / GIB:.1f} | {c['peak_tiled'] / GIB:.1f} | "
                   f"{c['ring_sent_per_step'] / GIB:.1f} | {c['ring_received_per_round'] / MIB:.0f} | "
                   f"{c['fsdp_sent_per_step'] / GIB:.1f} | {c['attn_flops_per_step'] / 1e12:.0f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Mistral-7B-v0.1",
                   help=f"a preset ({', '.join(PRESETS)}) or the path of a config.json (or its folder)")
    p.add_argument("--seq", type=int, default=131072, help="tokens per sequence (micro-batch 1)")
    p.add_argument("--meshes", type=mesh, nargs="+", default=[mesh(m) for m in DEFAULT_MESHES],
                   help="dp x cp meshes, e.g. 1x8 2x8")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--mu-f", type=float, default=0.07)
    a = p.parse_args(argv)
    model = load_model_shape(a.model)
    for dp, cp in a.meshes:
        if a.seq % (2 * cp):
            p.error(f"--seq {a.seq} must be a multiple of 2 x cp = {2 * cp} (zigzag layout)")
    print(f"A model, not a measurement: {a.model}, {model.params / 1e9:.2f}B parameters, n = {a.seq}, "
          f"micro-batch 1, zigzag, w = {a.window}, mu_f = {a.mu_f}.\n"
          "Computed by allhere_recipes.model_cost (attention terms from allhere_recipes.cost on the "
          "ring's plan, busiest rank); nothing was run.\n")
    print(HEAD)
    for line in rows(model, a.seq, a.meshes, a.window, a.mu_f):
        print(line)


if __name__ == "__main__":
    main()
