"""Whole-model prefill: AHA against dense attention in a whole model, not the op alone (part of
``allhere bench``; on the CPU its main table).

Two models of one shape (4 layers, d = 256, 4 heads of 64, fp32, B = 1, inference): allhere's ``Decoder``
and a transformers ``LlamaForCausalLM`` converted with ``allhere.hf.convert``. Each runs dense (the
original attention), with AHA (w = 256) whose routers are set so that every (layer, head) has its own share
of global tokens -- long-tailed as trained models have them: in three layers one head at 27%, every other
head at 2%, mu_f 6.7% overall -- and with AHA whose every gate is local (the most any gates can give).
Times are medians of round-robin repeats (the order rotates every round), so load from other processes
falls on every column alike.
"""

from __future__ import annotations

import torch

from allhere.mechanisms.base import mechanism_layers

from .gates import tail_share
from .timing import round_robin_times

SHAPE = dict(vocab=256, d_model=256, layers=4, heads=4, window=256)
BUSY, QUIET = 0.27, 0.02  # share of global tokens of the busy head (layers 0-2) and of every other head


def head_shares(layers: int, heads: int, mu: float | None = None) -> torch.Tensor:
    """[layers, heads]: the share of global tokens each (layer, head) is set to. Without ``mu``: one head at
    ``BUSY`` in the first three layers, every other head at ``QUIET``; with it, every layer as the op bench's
    long-tailed gates (``gates.long_tailed``): head 0 always global, the others at the rest of mu."""
    if mu is not None:
        shares = torch.full((layers, heads), tail_share(heads, mu) if heads > 1 else mu)
        shares[:, 0] = 1.0 if heads > 1 else mu
        return shares
    shares = torch.full((layers, heads), QUIET)
    shares[: min(3, layers), 0] = BUSY
    return shares


def _router_inputs(model, run, ids) -> list[torch.Tensor]:
    """The block input x each AHA mechanism of ``model`` gets in one forward of ``ids``."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[3].x)) for m in mechanism_layers(model)]
    try:
        with torch.no_grad():
            run(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def set_routers(model, run, ids, shares: torch.Tensor) -> None:
    """Give every AHA router of ``model`` random weights and, layer by layer, the bias that makes head h of
    layer l global for ``shares[l, h]`` of the tokens of ``ids`` (the quantile of its logits; a share of 1:
    global for any token)."""
    g = torch.Generator().manual_seed(0)
    mechs = mechanism_layers(model)
    with torch.no_grad():
        for m in mechs:
            m.router.weight.copy_(torch.randn(m.router.weight.shape, generator=g) * 0.05)
            m.router.bias.fill_(-30.0)
        for i, m in enumerate(mechs):  # layer i's input depends on the gates of the layers before it
            x = _router_inputs(model, run, ids)[i]
            # in fp32 and without the bias: a bf16 logit near the bias of -30 is 0.125 coarse
            logits = (x.float() @ m.router.weight.float().T).reshape(-1, m.router.out_features)
            cut = torch.stack([torch.quantile(logits[:, h], 1.0 - float(shares[i, h])) if shares[i, h] < 1
                               else logits[:, h].min() - 1e3 for h in range(logits.shape[1])])  # 1: always global
            m.router.bias.copy_(-cut)


def build(n_calibrate: int = 2048):
    """{name: (model, run, mechanisms-or-None)} for the dense and AHA versions of both models."""
    import allhere as ah
    from allhere.hf import convert

    s = SHAPE
    cfg = ah.ModelConfig(vocab_size=s["vocab"], d_model=s["d_model"], n_layers=s["layers"], n_heads=s["heads"])
    torch.manual_seed(0)
    dense = ah.Decoder(cfg).eval()
    aha = ah.Decoder(ah.ModelConfig(**{**cfg.__dict__, "mechanism": ah.AHAConfig(window=s["window"])})).eval()
    aha.load_state_dict(dense.state_dict(), strict=False)
    models = {"Decoder": (dense, aha, lambda m: (lambda ids: m(ids).logits))}
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        LlamaForCausalLM = None
    if LlamaForCausalLM is not None:
        lcfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["d_model"], intermediate_size=cfg.hidden,
                           num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                           max_position_embeddings=1 << 17, tie_word_embeddings=True)
        llama = LlamaForCausalLM(lcfg).eval()
        converted = LlamaForCausalLM(LlamaConfig(**lcfg.to_dict())).eval()
        converted.load_state_dict(llama.state_dict())
        convert(converted, ah.AHAConfig(window=s["window"]))
        models["converted Llama"] = (llama, converted, lambda m: (lambda ids: m(ids, use_cache=False).logits))
    ids = torch.randint(0, s["vocab"], (1, n_calibrate), generator=torch.Generator().manual_seed(1))
    for _, routed, run in models.values():
        set_routers(routed, run(routed), ids, head_shares(s["layers"], s["heads"]))
    return models


def _mu_f(model, run, ids) -> float:
    """mu_f of ``model`` (a routed Decoder or converted HF model) on ``ids``."""
    if hasattr(model, "blocks"):  # allhere's Decoder returns its routing
        return float(model(ids).routing.mu_f())
    from allhere.hf import collect_routing

    run(model)(ids)
    return float(collect_routing(model).mu_f())


def run_model_bench(lengths, repeats: int = 3, progress=print) -> list[dict]:
    """One row per (model, n): dense, AHA and all-local AHA prefill times (medians), tokens/s and mu_f."""
    from allhere.routing import set_forced_gate

    rows = []
    for name, (dense, routed, run) in build().items():
        for n in lengths:
            ids = torch.randint(0, SHAPE["vocab"], (1, n), generator=torch.Generator().manual_seed(2))

            def aha(forced):
                def call():
                    set_forced_gate(routed, forced)
                    run(routed)(ids)
                return call

            calls = {"dense": lambda: run(dense)(ids), "aha": aha(None), "local": aha(False)}
            with torch.inference_mode():
                for c in calls.values():  # warm-up
                    c()
                times = round_robin_times(calls, repeats)
                set_forced_gate(routed, None)
                mu = _mu_f(routed, run, ids)
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            rows.append({"model": name, "n": n, "mu_f": mu, "dense_ms": med["dense"] * 1e3,
                         "aha_ms": med["aha"] * 1e3, "local_ms": med["local"] * 1e3,
                         "speedup": med["dense"] / med["aha"], "ceiling": med["dense"] / med["local"],
                         "aha_tokens_per_s": n / med["aha"]})
            progress(f"whole model {rows[-1]}")
    return rows


def render_model(rows: list[dict]) -> list[str]:
    out = ["## Whole-model prefill (4 layers, d = 256, 4 heads of 64, fp32, B = 1, w = 256)", "",
           "Routers set per (layer, head): one head at 27% global in three layers, every other head at 2%.", "",
           "| model | n | mu_f | dense | AHA | AHA / dense | AHA tokens/s | every gate local (ceiling) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['n']} | {100 * r['mu_f']:.1f}% | {r['dense_ms']:.0f} ms "
                   f"| {r['aha_ms']:.0f} ms | {r['speedup']:.2f}x "
                   f"| {r['aha_tokens_per_s']:,.0f} | {r['ceiling']:.2f}x |")
    return out
