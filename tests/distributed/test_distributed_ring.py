"""Ring attention over 2 and 4 gloo processes equals the single-process ops, in outputs and gradients."""

import sys
from pathlib import Path

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from allhere import masks  # noqa: E402
from allhere.distributed import layouts  # noqa: E402
from allhere.distributed.ring_blocks import causal, pattern_from, sliding  # noqa: E402
from allhere.distributed.ring_plan import RingSpec, make_plan  # noqa: E402
from allhere.masks import dense_mask  # noqa: E402
from allhere.ops.aha import aha_attention  # noqa: E402
from allhere.ops.full import causal_attention, masked_attention  # noqa: E402
from allhere.ops.sliding import sliding_window_attention  # noqa: E402
from allhere.ops.ste import straight_through  # noqa: E402
from allhere_recipes.cost import Shape, add, aha_training_extra, ring_cost, saved_bytes  # noqa: E402

import dist_worker  # noqa: E402

N = {2: 32, 4: 32}
WINDOW = 3
TAU = 0.7  # about 30% of (token, head) pairs global
HAS_SPARSE = hasattr(masks, "longformer") and hasattr(masks, "sliding_with_sinks")


def GLOBAL(n):  # Longformer's global tokens: the first and one in the middle
    g = torch.zeros(n, dtype=torch.bool)
    g[[0, n // 2 + 1]] = True
    return g


def cases(world):
    n = N[world]
    out = []
    for layout in layouts.LAYOUTS:
        out += [(f"full-{layout}", layout, n, "full", None),
                (f"sliding-{layout}", layout, n, "sliding", WINDOW),
                (f"aha-{layout}", layout, n, "aha", (WINDOW, TAU)),
                (f"aha_ste-{layout}", layout, n, "aha_ste", (WINDOW, TAU))]
        if HAS_SPARSE:  # the sparse predicates of allhere.masks, through the generic path
            out += [(f"longformer-{layout}", layout, n, "predicate", ("longformer", WINDOW, GLOBAL(n))),
                    (f"sinks-{layout}", layout, n, "predicate", ("sliding_with_sinks", WINDOW, 2))]
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ring_run(request, tmp_path_factory):
    world = request.param
    per_rank = dist_worker.launch(dist_worker.ring_cases, world, tmp_path_factory.mktemp(f"ring{world}"), cases(world))
    return world, per_rank


def reference(kind, arg, n):
    q, k, v, dout, scores = dist_worker.full_inputs(n)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    s = scores.clone().requires_grad_(True)
    if kind == "full":
        out = causal_attention(q, k, v)
    elif kind == "sliding":
        out = sliding_window_attention(q, k, v, arg)
    elif kind == "predicate":
        from allhere import masks
        pred = getattr(masks, arg[0])(*arg[1:])
        out = masked_attention(q, k, v, dense_mask(pred, n, n))
    elif kind == "aha":
        out = aha_attention(q, k, v, scores > arg[1], arg[0])
    else:
        out = aha_attention(q, k, v, straight_through(s, arg[1]), arg[0])
    (out * dout).sum().backward()
    res = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if kind == "aha_ste":
        res["ds"] = s.grad
    return res


@pytest.mark.parametrize("case", range(len(cases(2))))
def test_ring_matches_single_process(ring_run, case):
    world, per_rank = ring_run
    name, layout, n, kind, arg = cases(world)[case]
    ref = reference(kind, arg, n)
    for key, want in ref.items():
        got = layouts.unshard([r[name][key] for r in per_rank], layout)
        assert got.shape == want.shape, (name, key)
        err = (got - want).abs().max().item()
        assert err <= 1e-5, f"{name} {key}: max error {err:.2e}"


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_sliding_reads_one_neighbour_block(ring_run, layout):
    world, per_rank = ring_run
    n = N[world]
    b, hkv, d = dist_worker.SHAPE["b"], dist_worker.SHAPE["hkv"], dist_worker.SHAPE["d"]
    shard_kv_bytes = b * hkv * (n // world) * 2 * d * 4  # one rank's K and V, fp32
    for rank, r in enumerate(per_rank):
        fwd = r[f"sliding-{layout}"]["stats"]["forward"]
        assert fwd["bytes_received"] <= shard_kv_bytes, (rank, fwd)
        if layout == "contiguous":
            assert fwd["transfers"] == (0 if rank == 0 else 1), (rank, fwd)
        full = r[f"full-{layout}"]["stats"]["forward"]
        assert fwd["bytes_received"] <= full["bytes_received"]
    if world >= 4:  # with more ranks than neighbours, whole rounds are skipped
        total_full = sum(r[f"full-{layout}"]["stats"]["forward"]["bytes_received"] for r in per_rank)
        total_sliding = sum(r[f"sliding-{layout}"]["stats"]["forward"]["bytes_received"] for r in per_rank)
        assert total_sliding < total_full


SHAPE = Shape(batch=dist_worker.SHAPE["b"], heads=dist_worker.SHAPE["h"], kv_heads=dist_worker.SHAPE["hkv"],
              head_dim=dist_worker.SHAPE["d"], elt=4)


def model_plan(kind, arg, n, world, layout):
    """The plan the cost model walks for a test case (AHA: with the real gate's counts per chunk)."""
    if kind == "full":
        return make_plan(RingSpec(causal()), n, world, layout)
    if kind == "sliding":
        return make_plan(RingSpec(sliding(arg)), n, world, layout)
    if kind == "predicate":
        pred = getattr(masks, arg[0])(*arg[1:])
        return make_plan(RingSpec(pattern_from(pred, batch=SHAPE.batch, heads=SHAPE.heads)), n, world, layout)
    scores = dist_worker.full_inputs(n)[4]
    cpr = layouts.chunks_per_rank(layout)
    rows = []
    for r in range(world):
        sel = layouts.shard(scores > arg[1], layout, world, r)
        rows.append(sel.reshape(SHAPE.batch, SHAPE.heads, cpr, -1).sum(-1).amax(dim=(0, 1)).tolist())
    return make_plan(RingSpec(causal(), sliding(arg[0])), n, world, layout, rows)


@pytest.mark.parametrize("case", range(len(cases(2))))
def test_cost_model_counts_what_the_ring_did(ring_run, case):
    world, per_rank = ring_run
    name, layout, n, kind, arg = cases(world)[case]
    plan = model_plan(kind, arg, n, world, layout)
    for rank, r in enumerate(per_rank):
        want = ring_cost(plan, SHAPE, rank)
        if kind == "aha_ste":
            want = add(want, aha_training_extra(n, world, layout, arg[0], SHAPE, rank))
        assert r[name]["stats"] == want, (name, rank)
        selector = kind.startswith("aha")
        want_saved = saved_bytes(SHAPE, n, world, selector, trained_gate=kind == "aha_ste")
        assert r[name]["saved_bytes"] == want_saved, (name, rank)


def test_activation_memory_per_rank(ring_run):
    """Saved-for-backward bytes per rank at 4 ranks <= 35% of the single-process op's (SDPA)."""
    world, per_rank = ring_run
    n = N[world]
    q, k, v, _, _ = dist_worker.full_inputs(n)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    into = {}
    with torch.autograd.graph.saved_tensors_hooks(*dist_worker.saved_bytes_hooks(into)):
        causal_attention(q, k, v)
    single = sum(into["storages"].values())
    assert single == saved_bytes(SHAPE, n, 1)
    worst = max(r["full-zigzag"]["saved_bytes"] for r in per_rank)
    ratio = worst / single
    print(f"saved bytes per rank at {world} ranks / one process: {worst} / {single} = {ratio:.3f}")
    assert ratio <= (0.35 if world == 4 else 0.6), ratio
