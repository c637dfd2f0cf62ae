"""AHA with sinks (``AHAConfig.sinks``: a local (token, head) also reads the first k tokens of its request) as
served: allhere's batched attention over a paged KV cache (the torch and reference paths of op family "paged",
and the Triton paged kernel once it takes sinks) equals ``aha_attention(..., backend="reference", sinks=k)``
per request, chunked prefill beside decodes, a prefix-cache hit, padding slots and rows (the steps of
test_serve_paged.py); the local class's block test skips exactly the blocks between the sinks and the window.
Under vLLM (where it is installed, as test_serve_vllm.py): a converted model with sinks, routed mostly local,
generates allhere's greedy tokens, and differs from the same model without sinks."""

from __future__ import annotations

import importlib.util
import inspect
from functools import partial

import pytest
import test_serve_paged as paged_steps
import torch
from test_serve_paged import BS, HEADS, KV_HEADS, SCALE, _bhld, _check, _serve

from allhere.ops.aha import aha_attention
from allhere.ops.paged import dispatch as paged_dispatch
from allhere.ops.paged.aha_triton import aha_paged
from allhere.ops.paged.attention import causal_read, window_read
from allhere.ops.paged.chunks import candidates, tile_rows

WINDOW = 6


def _want(sinks: int, scale: float = SCALE):
    """The dense reference of AHA with ``sinks`` on one request's whole sequence (``_check``'s ``want_fn``)."""
    return lambda q, kv, g, c: aha_attention(_bhld(q), _bhld(kv[0]), _bhld(kv[1]), g.T[None], WINDOW, scale,
                                             backend="reference", sinks=sinks)[0].transpose(0, 1)


@pytest.mark.parametrize("path", ["torch", "reference"])
@pytest.mark.parametrize("q_tile", [4, 64])
@pytest.mark.parametrize("sinks", [1, 3, 5], ids=lambda k: f"sinks{k}")  # 5: the sinks span two blocks of 4
def test_aha_with_sinks_equals_reference(sinks, q_tile, path):
    """AHA's two classes as ``install_aha`` builds them (the local one a ``window_read`` with sinks), random gates
    (about 30% global), every step of ``_serve``: requests of 29, 5, 17 and 21 tokens, most past window + sinks."""
    gen = torch.Generator().manual_seed(11)
    reads = [[window_read(WINDOW, n_sinks=sinks)], [causal_read()]]
    outs, data = _serve(reads, gen, q_tile=q_tile, path=path, window_class=0)
    _check(outs, data, _want(sinks))


def test_sinks_change_the_local_rows():
    """The check can fail: the same steps without sinks give other outputs (the local rows past the window)."""
    gen = torch.Generator().manual_seed(11)
    outs, data = _serve([[window_read(WINDOW)], [causal_read()]], gen)
    with pytest.raises(AssertionError):
        _check(outs, data, _want(3))


@pytest.mark.parametrize("sinks", [1, 3, 5])
def test_local_tiles_read_the_sink_blocks_and_the_window_only(sinks):
    """The local class's ``tiles`` test (``masks.sliding_with_sinks``): a query tile of a long request reads the
    blocks holding the first ``sinks`` positions and those its window reaches, no other."""
    n, q_tile = 48, 4
    tok = torch.arange(n).repeat_interleave(HEADS)
    head = torch.arange(HEADS).repeat(n)
    q = torch.zeros(n * HEADS, 8)
    for tiles in tile_rows(tok, head, torch.zeros(n, dtype=torch.long), torch.arange(n), q, HEADS, KV_HEADS, q_tile):
        tile, chunk = candidates(tiles, window_read(WINDOW, n_sinks=sinks).pred, BS)
        for t in range(tiles.count):
            lo, hi = int(tiles.lo[t]), int(tiles.hi[t])
            want = {b for b in range(hi // BS + 1)
                    if b * BS < sinks or (b * BS <= hi and b * BS + BS - 1 > lo - WINDOW)}
            assert set(chunk[tile == t].tolist()) == want, (lo, hi)


def test_the_triton_path_hands_the_sinks_to_the_kernel(monkeypatch):
    """``dispatch``'s Triton path passes the local class's sinks to ``aha_triton.aha_paged`` (as ``n_sinks``,
    not the learned sink logits' ``sinks``)."""
    from allhere.ops.paged import aha_triton

    seen = {}
    monkeypatch.setattr(aha_triton, "aha_paged", lambda *args, **kwargs: seen.update(kwargs))
    out = torch.zeros(3, HEADS, 16)
    paged_dispatch.paged_triton(torch.zeros(3, HEADS, 16), None, torch.tensor([0, 3]), torch.tensor([3]),
                                torch.zeros(1, 1, dtype=torch.int32),
                                [[window_read(WINDOW, n_sinks=2)], [causal_read()]],
                                SCALE, out, row_class=torch.zeros(3, HEADS, dtype=torch.long), window_class=0)
    assert seen == {"n_sinks": 2}


def _kernel_takes_sinks() -> bool:
    from allhere.kernels.aha_paged import paged_aha_attention

    return "sinks" in inspect.signature(paged_aha_attention).parameters


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter on the CPU)")
@pytest.mark.parametrize("sinks", [1, 3])
def test_aha_with_sinks_through_the_triton_paged_kernel(sinks, monkeypatch):
    """The path of a served AHA layer on CUDA (here under Triton's interpreter), keys stored untransposed."""
    if not _kernel_takes_sinks():
        pytest.skip("allhere.kernels.aha_paged.paged_aha_attention takes no sinks yet")
    monkeypatch.setattr(paged_steps, "aha_paged", partial(aha_paged, n_sinks=sinks))
    gen = torch.Generator().manual_seed(11)
    outs, data = _serve(None, gen, d=16, kernel_window=WINDOW)
    _check(outs, data, _want(sinks, 16 ** -0.5))


# ---- under vLLM ------------------------------------------------------------------------------------------------

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here (scripts/install_serve.sh makes .venv-serve)")
SINKS = 2


def _convert_mostly_local(plain, out, mech):
    """``allhere convert`` in Python with routers that send most (token, head) pairs local: small weights and a
    bias below tau's logit, the same draw for every ``mech`` (a model with and without sinks routes alike)."""
    from allhere.hf import convert, save_pretrained
    from allhere.hf.io import load_local

    tokenizer, model = load_local(plain, convertible=True, dtype=torch.float32, layers="full")
    convert(model, mech, layers="full")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".allhere.router." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05 if name.endswith("weight")
                        else torch.full_like(p, -1.0))
    save_pretrained(model, out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vllm_sinks(tmp_path_factory):
    """(test_serve_vllm's helpers, folders: a Llama with N(0, 0.1^2) weights converted to AHA with window 8 and
    sinks 1, 2 and none; prompts: test_serve_vllm's and a long one)."""
    pytest.importorskip("vllm")
    import transformers

    import allhere as ah

    import test_serve_vllm as served
    from hf_fixtures import write_model

    root = tmp_path_factory.mktemp("serve_sinks")
    plain = write_model("Llama-3.2-1B", root / "llama", init_std=0.1, **served.SIZES)
    folders = {k: _convert_mostly_local(plain, root / f"aha_sinks{k}",
                                        ah.AHAConfig(window=served.WINDOW, sinks=k, router_init="neutral"))
               for k in (1, SINKS, 0)}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(plain))
    prompts = [tokenizer.encode(t) for t in served.TEXTS + [served.LONG]]
    yield served, folders, prompts
    served._ENGINES.close()


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("sinks", [1, SINKS])
def test_vllm_serves_aha_with_sinks(vllm_sinks, sinks):
    """Routed (mostly local) and forced local: vLLM's greedy tokens = allhere's generate (fp32), again through
    the prefix cache (whose shared blocks hold the sinks), and with the long prompt read in chunks of 32 beside
    the others' decoding; the test can fail: without sinks the same model generates other tokens. The cache keeps
    every key (KV bytes per token as the plain model's). One sink: the decode tokens' windows in vLLM's windowed
    kernel with the sink swapped in; two: allhere's attention."""
    served, folders, prompts = vllm_sinks
    folder = folders[sinks]
    out = served._vllm(folder, prompts, forced="none,false", again=True)
    routed, local = out["none"], out["false"]
    assert 0.0 < routed["routing"]["mu_f"] < 0.3, routed["routing"]  # mostly local: the sinks matter
    ours, ours_local = served._allhere(folder, prompts), served._allhere(folder, prompts, forced=False)
    assert routed["tokens"] == ours and routed["again"]["tokens"] == ours
    assert routed["again"]["cached"][-1] >= 64, routed["again"]["cached"]
    assert local["tokens"] == ours_local
    assert routed["kv"]["per_token"] == routed["kv"]["plain_per_token"] and routed["kv"]["per_request"] == 0
    assert ours != served._allhere(folders[0], prompts)
    assert ours_local != served._allhere(folders[0], prompts, forced=False)
    long = prompts[-1]
    mixed = [long[:12], long[5:25], long]  # the long prompt in chunks while the short ones decode
    assert served._vllm(folder, mixed, step_tokens=32)["none"]["tokens"] == served._allhere(folder, mixed)


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_vllm_serves_aha_with_sinks_on_other_paged_backends(vllm_sinks, backend):
    """The dense float32 reference over the paged cache, and the Triton paged kernel (Triton's interpreter inside
    vLLM's CPU backend; once the kernel takes sinks): allhere's tokens."""
    if backend == "triton":
        pytest.importorskip("triton")
        if not _kernel_takes_sinks():
            pytest.skip("allhere.kernels.aha_paged.paged_aha_attention takes no sinks yet")
    served, folders, prompts = vllm_sinks
    routed = served._vllm(folders[SINKS], prompts, backend=backend)["none"]
    assert 0.0 < routed["routing"]["mu_f"] < 0.3, routed["routing"]
    assert routed["tokens"] == served._allhere(folders[SINKS], prompts)
