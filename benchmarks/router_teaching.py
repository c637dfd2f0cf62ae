"""The measurements behind the taught routers' choices (``allhere.teaching``), on a real model with no fine-tuning:

- ``oracle``: per-token oracle gates (global where a (token, head)'s own teacher cost is in the top share, computed
  on the text itself), by label ("mass": attention beyond the window and sinks; "output": how far the head's output
  moves) and by budget (each layer its share, or one share over the whole model): what a router that ranked
  exactly as the teacher could keep, the ceiling of a label;
- ``fits``: from one capture of the routers' inputs and the teacher's costs, a ridge regression of the cost's log
  against the logistic fit on each layer's costliest share (``allhere.teaching.fit``): of held-out text's costliest
  share, the part each router sends global, with the budget set on the calibration text;
- ``taught``: the taught routers at several budgets: held-out Retain % of the model with every gate global, mu_f
  there, and passkey retrieval beyond the window;
- ``question``: where passkeys are lost: the routers taught at the first budget, then on the passkey prompts the
  gates of the question's tokens and of the other tokens each set by the routers, by the oracle (each layer's
  costliest 10% of the prompt's pairs) or all local, and the model's first token after the question read off.

    python benchmarks/router_teaching.py oracle --model smollm2 --window 128 --sinks 1
    python benchmarks/router_teaching.py fits --model smollm2
    python benchmarks/router_teaching.py taught --model smollm2 --mu-f 0.1 0.15 0.2
    python benchmarks/router_teaching.py question --model smollm2 --mu-f 0.15 --haystacks 16 --filler text

Held-out text: the standard library's validation files (the job's held-out windows); calibration: windows of its
training files and haystacks of plain sentences, facts planted in both (the job's ``real_taught.calibration``).
Prints one table; 2 CPU cores take about 10 (oracle), 8 (fits) and 5 minutes per budget (taught) on SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch


def setup(a):
    from allhere.hf import convert
    from allhere.hf.io import load_local
    from allhere.mechanisms import AHAConfig
    from allhere_recipes.real_data import token_data
    from allhere_recipes.real_plan import preset_plan
    from allhere_recipes.real_runs import resolve_model
    from allhere_recipes.real_taught import calibration

    tokenizer, model = load_local(resolve_model(a.model), convertible=True, dtype=torch.float32)
    convert(model, AHAConfig(window=a.window, sinks=a.sinks), seed=0)
    model.eval()
    job = preset_plan("cpu", "cpu")  # the job's calibration, where the flags do not say otherwise
    plan = dataclasses.replace(job, **{name: getattr(a, flag) for name, flag in (
        ("calib_haystacks", "haystacks"), ("calib_filler", "filler"), ("calib_facts", "facts"),
        ("calib_windows", "windows")) if getattr(a, flag) is not None})
    data = token_data(tokenizer, plan.seq_len, a.heldout)
    windows, answers = calibration(tokenizer, data, plan)
    return tokenizer, model, data.heldout, windows, answers


@torch.no_grad()
def capture(model, ids, window, sinks, label):
    """Per routed layer (router input x [b, n, d], the teacher's cost [b, heads, n]) of ``ids``, every gate open."""
    from allhere.routing import set_forced_gate
    from allhere.teaching.labels import local_cost
    from allhere.teaching.observe import observe_routed

    rows = {}
    set_forced_gate(model, True)
    with observe_routed(model, lambda r, m, q, k, v, call: rows.__setitem__(
            r, (call.x.float(), local_cost(q, k, v, window, sinks, call.scale, label)))):
        model(ids)
    set_forced_gate(model, None)
    return [rows[r] for r in range(len(rows))]


@torch.no_grad()
def loss(model, ids, gates=None) -> float:
    from allhere.hf import HFCausalLM
    from allhere.losses import lm_loss
    from allhere.routing import routed_layers, set_forced_gate

    if gates is not None:
        for (_, mech), g in zip(routed_layers(model), gates):
            mech.forced_gate = g
    try:
        return lm_loss(HFCausalLM(model)(ids).logits, ids).item()
    finally:
        if gates is not None:
            set_forced_gate(model, None)


def oracle(a, model, held, **_):
    print("| label | budget | " + " | ".join(f"{mu:.0%}" for mu in a.mu_f) + " |")
    print("|---|---|" + "---|" * len(a.mu_f))
    from allhere.routing import set_forced_gate

    set_forced_gate(model, True)
    full = sum(loss(model, held[i:i + 2]) for i in range(0, len(held), 2))
    set_forced_gate(model, None)
    for label in ("mass", "output"):
        totals = {(b, mu): 0.0 for b in ("layer", "model") for mu in a.mu_f}
        for i in range(0, len(held), 2):
            ids = held[i:i + 2]
            cost = torch.stack([c for _, c in capture(model, ids, a.window, a.sinks, label)])  # [L, b, h, n]
            for mu in a.mu_f:
                per_layer = torch.quantile(cost.flatten(1), 1 - mu, dim=1).view(-1, 1, 1, 1)
                overall = torch.quantile(cost.flatten()[::7], 1 - mu)
                totals["layer", mu] += loss(model, ids, list(cost > per_layer))
                totals["model", mu] += loss(model, ids, list(cost > overall))
        for budget in ("layer", "model"):
            print(f"| {label} | {budget} | " + " | ".join(f"{100 * full / totals[budget, mu]:.2f}%" for mu in a.mu_f)
                  + " |")


def fits(a, model, held, windows, answers, **_):
    from allhere.teaching.fit import ANSWER_WEIGHT, fit_router

    far = slice(a.window, None)

    def flat(ids, marks=None):
        rows = [capture(model, ids[i:i + 4], a.window, a.sinks, "output") for i in range(0, len(ids), 4)]
        x = [torch.cat([r[layer][0][:, far].reshape(-1, r[layer][0].shape[-1]) for r in rows]) for layer in
             range(len(rows[0]))]
        c = [torch.cat([r[layer][1][..., far].transpose(1, 2).reshape(-1, r[layer][1].shape[1]) for r in rows])
             for layer in range(len(rows[0]))]
        return x, c, None if marks is None else marks[:, far].reshape(-1)

    xc, cc, ac = flat(windows, answers)
    xh, ch, _ = flat(held)
    mu = a.mu_f[0]

    def ridge(x, c):
        xa = torch.cat([x, torch.ones(len(x), 1)], 1).double()
        gram = xa.T @ xa
        gram.diagonal()[:-1] += 1e-3 * gram.diagonal()[:-1].mean()
        w = torch.linalg.solve(gram, xa.T @ c.clamp_min(1e-3).log().double()).float()
        return w[:-1].T, w[-1]

    print(f"| fit | held-out recall of the costliest {mu:.0%} | held-out mu_f (budget set on calibration) |")
    print("|---|---|---|")
    for name, fit in (("ridge regression of log cost", ridge),
                      ("logistic on each layer's costliest share (allhere)",
                       lambda x, c: fit_router(x, c, mu, 1.0 + (ANSWER_WEIGHT - 1.0) * ac.float()))):
        hits = total = gates = pairs = 0
        for x, c, x2, c2 in zip(xc, cc, xh, ch):
            w, b = fit(x, c)
            thr = torch.quantile((x @ w.T + b).flatten(), 1 - mu)
            chosen = x2 @ w.T + b > thr
            top = c2 > torch.quantile(c2.flatten(), 1 - mu)
            hits, total = hits + (chosen & top).sum().item(), total + top.sum().item()
            gates, pairs = gates + chosen.sum().item(), pairs + chosen.numel()
        print(f"| {name} | {hits / total:.3f} | {gates / pairs:.1%} |")


def taught(a, model, held, windows, answers, tokenizer, **_):
    from allhere.eval.passkey import passkey_accuracy, passkey_prompts
    from allhere.hf import HFCausalLM
    from allhere.losses import lm_loss
    from allhere.routing import set_forced_gate
    from allhere.teaching import teach_routers

    prompts = passkey_prompts(tokenizer, 20, 480, 2 * a.window)
    set_forced_gate(model, True)
    full = sum(loss(model, held[i:i + 4]) for i in range(0, len(held), 4))
    set_forced_gate(model, None)
    print("| mu_f (calibration) | held-out Retain % | held-out mu_f | recall | passkey | mu_f on its question |")
    print("|---|---|---|---|---|---|")
    for mu in a.mu_f:
        t = teach_routers(model, list(windows.split(4)), mu, answers=list(answers.split(4)))
        with torch.no_grad():
            outs = [HFCausalLM(model)(held[i:i + 4]) for i in range(0, len(held), 4)]
        lost = sum(lm_loss(o.logits, held[i * 4:i * 4 + 4]).item() for i, o in enumerate(outs))
        held_mu = sum(o.routing.mu_f().item() for o in outs) / len(outs)
        pk = passkey_accuracy(model, tokenizer, prompts)
        print(f"| {mu:.0%} | {100 * full / lost:.2f}% | {held_mu:.1%} | {t.recall:.3f} | {pk['correct']}/20 | "
              f"{pk['question_mu_f']:.1%} |")


def question(a, model, windows, answers, tokenizer, **_):
    from allhere.eval.passkey import QUESTION, passkey_prompts
    from allhere.hf import HFCausalLM
    from allhere.mechanisms.aha_gate import hidden_gate
    from allhere.routing import routed_layers, set_forced_gate
    from allhere.teaching import teach_routers
    from allhere.teaching.teach import _router

    teach_routers(model, list(windows.split(4)), a.mu_f[0], answers=list(answers.split(4)))
    prompts = passkey_prompts(tokenizer, 20, 480, 2 * a.window)
    ids = torch.tensor([p.ids for p in prompts])
    asked = len(tokenizer(QUESTION, add_special_tokens=False)["input_ids"])
    layers = [m for _, m in routed_layers(model)]
    routers, oracles = [], []
    for i in range(0, len(ids), 4):
        rows = capture(model, ids[i:i + 4], a.window, a.sinks, "output")
        routers.append([hidden_gate(x, *_router(m), m.cfg.tau)[1].transpose(1, 2) for (x, _), m in zip(rows, layers)])
        oracles.append([c > torch.quantile(c.flatten(), 0.9) for _, c in rows])  # per batch of 4 prompts
    router = [torch.cat([r[i] for r in routers]) for i in range(len(layers))]  # [prompts, heads, n] per layer
    oracle = [torch.cat([o[i] for o in oracles]) for i in range(len(layers))]
    local = [torch.zeros_like(g) for g in router]
    print(f"| gates on the question's {asked} tokens | on every other token | first token right (of 20) | mu_f on "
          "the question / overall |")
    print("|---|---|---|---|")
    kinds = {"every gate open": None, "oracle": oracle, "taught routers": router, "every gate local": local}
    for ask, rest in (("every gate open", "every gate open"), ("oracle", "oracle"), ("oracle", "taught routers"),
                      ("oracle", "every gate local"), ("taught routers", "taught routers"),
                      ("taught routers", "oracle"), ("taught routers", "every gate local")):
        if kinds[ask] is None:
            gates = None
            set_forced_gate(model, True)
        else:
            gates = [torch.cat([r[..., :-asked], q[..., -asked:]], -1) for q, r in zip(kinds[ask], kinds[rest])]
            for m, g in zip(layers, gates):
                m.forced_gate = g
        with torch.no_grad():
            first = HFCausalLM(model)(ids).logits[:, -1].argmax(-1).tolist()
        set_forced_gate(model, None)
        words = [tokenizer.decode([t]) for t in first]
        right = sum(w == " " or (w.strip().isdigit() and p.key.startswith(w.strip())) for w, p in zip(words, prompts))
        shares = "100% / 100%" if gates is None else (
            f"{sum(g[..., -asked:].float().mean().item() for g in gates) / len(gates):.1%} / "
            f"{sum(g.float().mean().item() for g in gates) / len(gates):.1%}")
        print(f"| {ask} | {rest} | {right} | {shares} |", flush=True)


def main() -> None:
    from allhere.teaching.retrieval import FILLERS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("part", choices=("oracle", "fits", "taught", "question"))
    p.add_argument("--model", default="smollm2", help="smollm2 (allhere fetch smollm2), a GGUF file or a folder")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--sinks", type=int, default=1)
    p.add_argument("--mu-f", type=float, nargs="+", default=[0.1, 0.15])
    p.add_argument("--haystacks", type=int, help="calibration windows of repeated text added (default: the job's, 32)")
    p.add_argument("--filler", choices=FILLERS,
                   help="what a haystack repeats: the training text's own or plain sentences (default: the job's: "
                        "prose)")
    p.add_argument("--facts", type=int, help="facts planted per calibration window (default: the job's, 3)")
    p.add_argument("--windows", type=int, help="calibration windows of the training text (default: the job's, 32)")
    p.add_argument("--heldout", type=int, default=24, help="held-out windows of 512 tokens (default 24)")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", torch.get_num_threads())))
    tokenizer, model, held, windows, answers = setup(a)
    print(f"{a.model}, w = {a.window}, {a.sinks} sink(s); {len(held)} held-out windows; load average "
          f"{os.getloadavg()[0]:.2f}")
    part = {"oracle": oracle, "fits": fits, "taught": taught, "question": question}[a.part]
    part(a, model=model, held=held, windows=windows, answers=answers, tokenizer=tokenizer)


if __name__ == "__main__":
    main()
