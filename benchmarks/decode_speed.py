"""Cached decoding on the CPU: the cost per token as the context grows, and AHA's decode step against dense's.

    python benchmarks/decode_speed.py                # tables (a), (b), (c): about 1-2 minutes on 2 cores
    python benchmarks/decode_speed.py --cat          # the run in docs/performance.md: (b) with torch.cat too
    python benchmarks/decode_speed.py --cat --threads 1    # the same on one thread (robust on a shared machine)
    python benchmarks/decode_speed.py --part b --profile --threads 1 --rounds 3   # torch.profiler's top ops
    python benchmarks/decode_speed.py --quick        # contexts 1k..4k, (b) and (c) at 4k, 3 rounds

(a) ``allhere.Decoder`` with ``FullConfig`` (4 layers, d = 256, 4 heads of 64, fp32), B = 1 and B = 8: one
decode step (one token per row, with the KV cache) at contexts 1k, 2k, 4k, 8k, 16k. Prints the median ms
per token (per step), its ratio to the 1k row next to the ratio of keys read, and where the step's time
goes: cache updates, attention (the mechanism's time less its cache update) and the rest of the model.
The "torch.cat cache" column is the same step with a cache that concatenates at every step (the caches
before they wrote in place), measured in the same rounds.

(b) the whole-model decode step with the cache, AHA (w = 256) against dense (``FullConfig``), same
weights, 4 layers, d = 1024, 16 heads of 64, B = 8, 16k context. Routers: a random direction per head with
a bias set so that, over the vocabulary, 1-3 "busy" heads per layer go global at 20-85% and the others at
1-3%: mu_f ~7%, long-tailed (the measured mu_f is printed). The two models decode in turn on one shared
cache (it holds every key for both; sharing halves the memory).

(c) one layer's decode attention at (b)'s shapes: dense SDPA against ``aha_attention`` (whose decode step
reads every head's window and each global (batch, head)'s cache through views, no copies).

Caches are filled to the context through their own ``update`` with random keys and values (no prefill is
computed: a decode step's cost does not depend on the values), with room reserved for the timed steps.
Steps run round-robin (every configuration once per round, the order rotating), medians over the rounds;
the machine's load (``os.getloadavg()``) is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from allhere import AHAConfig, Decoder, FullConfig, ModelConfig, swap_mechanism
from allhere.mechanisms import mechanism_layers
from allhere.mechanisms.caches import KVCache
from allhere.model import DecoderCache
from allhere_recipes.gates import byte_limit
from allhere_recipes.timing import round_robin, round_robin_times, timed_call

BUSY = [1, 2, 3, 2]  # busy heads per AHA layer in (b)


class Clock:
    """Seconds spent in cache updates and in the mechanisms (forward hooks), per step."""

    def __init__(self) -> None:
        self.update = self.mechanism = 0.0
        self._t0 = 0.0

    def reset(self) -> None:
        self.update = self.mechanism = 0.0

    def attach(self, model) -> None:
        for m in mechanism_layers(model):
            m.register_forward_pre_hook(self._start)
            m.register_forward_hook(self._stop)

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.mechanism += time.perf_counter() - self._t0


class TimedKVCache(KVCache):
    """``KVCache`` (in place) whose updates are timed."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def update(self, k, v):
        t0 = time.perf_counter()
        out = super().update(k, v)
        self.clock.update += time.perf_counter() - t0
        return out


class CatKVCache:
    """The cache as it was before: ``torch.cat`` of the whole cache with the new token at every step."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.k, self.v = clock, None, None

    def reserve(self, tokens: int) -> None:
        pass

    def update(self, k, v):
        t0 = time.perf_counter()
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.clock.update += time.perf_counter() - t0
        return self.k, self.v


def filled_cache(model, kind, clock, batch: int, context: int, room: int) -> DecoderCache:
    """A cache per layer holding ``context`` tokens of random keys and values, with ``room`` more reserved."""
    cfg = model.cfg
    hkv, hd = cfg.n_kv_heads or cfg.n_heads, cfg.d_model // cfg.n_heads
    block = torch.randn(batch, hkv, min(1024, context), hd)
    layers = []
    for _ in range(cfg.n_layers):
        cache = kind(clock)
        cache.reserve(context + room)
        with torch.no_grad():
            if isinstance(cache, CatKVCache):
                reps = -(-context // block.shape[2])
                cache.k = block.repeat(1, 1, reps, 1)[:, :, :context].clone()
                cache.v = cache.k.clone()
            else:
                for done in range(0, context, block.shape[2]):
                    piece = block[:, :, :min(block.shape[2], context - done)]
                    cache.update(piece, piece)
        layers.append(cache)
    clock.reset()
    out = DecoderCache(layers)
    out.seen = context
    return out


def step(model, cache, clock, batch, gen) -> tuple[float, float, float, torch.Tensor | None]:
    """One decode step: (seconds, of which cache updates, of which the mechanisms), and the gates."""
    ids = torch.randint(0, model.cfg.vocab_size, (batch, 1), generator=gen)
    clock.reset()
    with torch.inference_mode():
        out, total = timed_call(lambda: model(ids, cache=cache))
    gates = None if out.routing is None else torch.stack([r.gates for r in out.routing.per_layer])
    return total, clock.update, clock.mechanism, gates


def med(xs) -> float:
    return statistics.median(xs) * 1e3


def part_a(a) -> None:
    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads,
                      mechanism=FullConfig())
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    clock = Clock()
    clock.attach(model)
    gen = torch.Generator().manual_seed(0)
    room = a.rounds + a.warmup + 1
    runs, caches = {}, {}
    for b in a.batches:
        for n in a.contexts:
            for kind, name in ((TimedKVCache, "inplace"), (CatKVCache, "cat"))[:1 if a.no_cat else 2]:
                cache = filled_cache(model, kind, clock, b, n, room)
                caches[(b, n, name)] = cache
                runs[(b, n, name)] = (lambda c=cache, b=b: step(model, c, clock, b, gen))
    res = round_robin(runs, a.rounds, a.warmup)
    print(f"\n## (a) cached decode step, FullConfig, {a.layers} layers, d = {a.d_model}, {a.heads} heads of "
          f"{a.d_model // a.heads}, fp32, median of {a.rounds} rounds\n")
    print("| B | context | ms / token | vs first row | keys read vs first row | cache update ms | attention ms "
          "| rest ms | torch.cat cache ms / token | its update ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in a.batches:
        base = None
        for n in a.contexts:
            r, c = res[(b, n, "inplace")], res.get((b, n, "cat"), [(float("nan"),) * 2])
            tot, upd, mech = (med([x[i] for x in r]) for i in range(3))
            base = base or tot
            print(f"| {b} | {n} | {tot:.2f} | {tot / base:.2f}x | {n / a.contexts[0]:.0f}x | {upd:.2f} | "
                  f"{mech - upd:.2f} | {tot - mech:.2f} | {med([x[0] for x in c]):.2f} | "
                  f"{med([x[1] for x in c]):.2f} |",
                  flush=True)
    del caches


def head_rates(heads: int, n_busy: int, gen) -> torch.Tensor:
    """Per head, the share of its (token, head) pairs that go global: ``n_busy`` heads share what the others
    (1-3% each) leave of a 7% mean."""
    rates = 0.01 + 0.02 * torch.rand(heads, generator=gen)
    busy = (0.07 * heads - rates[n_busy:].sum()) / n_busy
    rates[:n_busy] = float(busy.clamp(0.01, 0.99))
    return rates


def set_routers(model, busy: list[int], gen) -> None:
    """Each AHA layer's router: a random direction per head, its bias put at the quantile of the logits over
    the vocabulary (the router input taken as the normalised embedding) that makes the head global at its
    ``head_rates`` (``busy[layer]`` busy heads at 20-85%, the others at 1-3%; ~7% per layer)."""
    emb = model.embed.weight.detach()
    for layer, blk in enumerate(model.blocks):
        mech = blk.attn.mechanism
        heads, d = mech.router.weight.shape
        rates = head_rates(heads, busy[layer % len(busy)], gen)
        with torch.no_grad():
            w = torch.randn(heads, d, generator=gen) / d ** 0.5
            logits = blk.attn_norm(emb) @ w.T  # [vocab, heads]
            q = torch.stack([torch.quantile(logits[:, h], 1 - float(rates[h])) for h in range(heads)])
            mech.router.weight.copy_(w)
            mech.router.bias.copy_(-q)


def part_b(a) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.b_d_model, n_layers=a.layers, n_heads=a.b_heads,
                      mechanism=AHAConfig(window=a.window))
    aha = Decoder(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    set_routers(aha, BUSY, gen)
    dense = swap_mechanism(aha, FullConfig()).eval()
    clock = Clock()
    clock.attach(aha)
    clock.attach(dense)
    room = 3 * (a.rounds + a.warmup + 1) + (3 if a.profile else 0)
    kinds = [(TimedKVCache, "")] + ([(CatKVCache, ", torch.cat cache")] if a.cat else [])
    runs, caches, mu = {}, [], []

    def aha_step(cache):
        out = step(aha, cache, clock, a.b_batch, gen)
        mu.append(out[3].float().mean().item())
        return out

    for kind, label in kinds:
        cache = filled_cache(aha, kind, clock, a.b_batch, a.b_context, room)  # shared by the models
        caches.append(cache)
        runs[f"dense{label}"] = lambda c=cache: step(dense, c, clock, a.b_batch, gen)
        runs[f"AHA w={a.window}{label}"] = lambda c=cache: aha_step(c)
    res = round_robin(runs, a.rounds, a.warmup)
    hd = a.b_d_model // a.b_heads
    print(f"\n## (b) whole-model decode step, {a.layers} layers, d = {a.b_d_model}, {a.b_heads} heads of {hd}, "
          f"fp32, B = {a.b_batch}, context {a.b_context}, median of {a.rounds} rounds\n")
    mu_f = statistics.mean(mu)
    print(f"mu_f of the AHA steps: {mu_f:.3f}; the attention's byte limit 1 / (mu + (1 - mu) w / n) = "
          f"{byte_limit(mu_f, a.window, a.b_context):.1f}x\n")
    print("| model | ms / step | dense / this | cache update ms | attention ms | rest ms |")
    print("|---|---|---|---|---|---|")
    dense_ms = med([x[0] for x in res["dense"]])
    for name, r in res.items():
        tot, upd, mech = (med([x[i] for x in r]) for i in range(3))
        print(f"| {name} | {tot:.1f} | {dense_ms / tot:.2f}x | {upd:.1f} | {mech - upd:.1f} | {tot - mech:.1f} |",
              flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, model in (("AHA", aha), ("dense", dense)):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(3 if name == "AHA" else 1):
                    step(model, caches[0], clock, a.b_batch, gen)
            print(f"\n### torch.profiler, {name} ({3 if name == 'AHA' else 1} step(s)), top ops by self CPU time\n")
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12,
                                                                      max_name_column_width=50,
                                                                      max_shapes_column_width=60))


def part_c(a) -> None:
    """One layer's decode attention at (b)'s shapes and gate rates: dense SDPA and ``aha_attention``; a new
    gate draw each round, the same for every row of the round."""
    from allhere.ops.aha import aha_attention

    b, h, n, hd, w = a.b_batch, a.b_heads, a.b_context + 5, a.b_d_model // a.b_heads, a.window
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(b, h, n + 64, hd, generator=gen)[:, :, :n] for _ in range(2))  # views, as a cache gives
    q = torch.randn(b, h, 1, hd, generator=gen)
    rates = head_rates(h, 2, gen)
    gates = [torch.rand(b, h, 1, generator=gen) < rates[:, None] for _ in range(a.warmup + a.rounds)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns = {"dense SDPA": lambda g: sdpa(q, k, v),
           "aha_attention": lambda g: aha_attention(q, k, v, g, w)}
    calls = {name: iter(gates) for name in fns}
    runs = {name: (lambda name=name: fns[name](next(calls[name]))) for name in fns}
    with torch.inference_mode():
        res = round_robin_times(runs, a.rounds, a.warmup)
    pairs = statistics.mean(int(g.sum()) for g in gates)
    print(f"\n## (c) one layer's decode attention, B = {b}, {h} heads of {hd}, context {n}, w = {w}, "
          f"{pairs:.1f} global (batch, head) pairs of {b * h} on average (2 busy heads), median of {a.rounds} "
          f"rounds\n")
    print("| attention | ms | dense / this |")
    print("|---|---|---|")
    dense_ms = med(res["dense SDPA"])
    for name, r in res.items():
        print(f"| {name} | {med(r):.2f} | {dense_ms / med(r):.2f}x |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="contexts 1k..4k and the AHA step at 4k, 3 rounds")
    p.add_argument("--part", choices=["a", "b", "c", "all"], default="all",
                   help="a: cost per token by context; b: AHA vs dense decode step; c: one layer's AHA decode "
                        "attention against dense SDPA")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--b-context", type=int, default=16384)
    p.add_argument("--b-batch", type=int, default=8)
    p.add_argument("--b-d-model", type=int, default=1024)
    p.add_argument("--b-heads", type=int, default=16)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-cat", action="store_true", help="(a) without the torch.cat cache column")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's). On a shared 2-core machine, 2 threads stall at every "
                        "parallel op while another process holds a core; 1 thread does not")
    p.add_argument("--cat", action="store_true", help="(b) also with the torch.cat cache (twice the memory)")
    p.add_argument("--profile", action="store_true", help="(b) torch.profiler's top ops of the AHA and dense steps")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.contexts, a.b_context, a.rounds = [c for c in a.contexts if c <= 4096] or a.contexts, 4096, 3
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} threads; load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    t0 = time.perf_counter()
    if a.part in ("a", "all"):
        part_a(a)
    if a.part in ("b", "all"):
        part_b(a)
    if a.part in ("c", "all"):
        part_c(a)
    print(f"\n# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
