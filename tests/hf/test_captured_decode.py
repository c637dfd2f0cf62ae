"""Greedy decoding over transformers' StaticCache with one step captured as a CUDA graph
(``allhere.hf.captured``). Without a GPU the step runs eagerly: the tokens it gives, the absence of host
reads in a step, and a step whose ops do not depend on the cache's length are what a capture needs."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from allhere import AHAConfig, SlidingConfig  # noqa: E402
from allhere.backend import use_backend  # noqa: E402
from allhere.hf import convert  # noqa: E402
from allhere.hf.captured import CapturedDecode  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG)
    plain = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    aha = convert(copy.deepcopy(plain), AHAConfig(window=4))
    for layer in aha.model.layers:  # sharp routers: about half the (token, head) pairs global
        torch.nn.init.normal_(layer.self_attn.allhere.router.weight, std=2.0)
    return plain, aha


def prompt(batch=2, n=12):
    return torch.randint(3, 97, (batch, n), generator=torch.Generator().manual_seed(1))


def greedy(model, ids, new):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)[:, ids.shape[1]:]


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_static_cache_decoding_gives_generates_tokens(models, backend):
    """The plain model and the converted one (AHA at w = 4 over 22 tokens: local heads read a window of the
    static buffers) give generate's greedy tokens; AHA on the Triton decode kernel (lengths read on the
    device) as on the PyTorch path (each sequence's keys taken apart)."""
    plain, aha = models
    ids = prompt()
    with use_backend(backend):
        for model in (plain, aha) if backend == "auto" else (aha,):
            got = CapturedDecode(model, 2, 40, capture=False).generate(ids, 10)
            assert torch.equal(got, greedy(model, ids, 10))


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_transformers_generate_with_a_static_cache(models, backend):
    """transformers' own ``generate(cache_implementation="static")`` on the converted model (its masks built ahead
    of each step and handed back to the forward) gives the tokens of its default cache, a left-padded row
    included (its first keys masked: the decode reads from its first real key on)."""
    _, aha = models
    ids = prompt()
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with use_backend(backend):
        static = aha.generate(ids, cache_implementation="static", **kwargs)
        assert torch.equal(static, aha.generate(ids, **kwargs))


@pytest.mark.slow
def test_transformers_generate_with_a_static_cache_compiled(models):
    """The same with the forward compiled as transformers compiles it for a static cache on a GPU (here forced on
    the CPU): allhere's checks that read a value back are left out while torch.compile traces."""
    _, aha = models
    ids = prompt()
    compile_config = transformers.CompileConfig()
    compile_config._compile_all_devices = True
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                  pad_token_id=0)
    want = aha.generate(ids, **kwargs)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        got = aha.generate(ids, cache_implementation="static", compile_config=compile_config, **kwargs)
        compiled = counters["frames"]["ok"]
    finally:
        torch._dynamo.reset()
    assert compiled > 0  # the forward did go through torch.compile
    assert torch.equal(got, want)


class Reads(TorchDispatchMode):
    """Every op of a step, with its inputs' shapes; the host reads among them (``.item()`` and the like)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def test_a_step_reads_nothing_back_and_repeats_the_same_ops(models, monkeypatch):
    """What a CUDA graph replays, in the steps after the first (which allocates what later steps reuse), run as
    under a capture (``capturing``: the host-side checks left out): the ops and shapes are the same at every
    length, and none reads a value back or makes a shape from one (``aten._local_scalar_dense``: .item(),
    bool(), int() of a tensor; nonzero, boolean indexing). Host reads that bypass the dispatcher (.tolist()
    of a CPU tensor) are not seen here: the GPU test below captures for real."""
    from allhere.hf import attention

    _, aha = models
    run = CapturedDecode(aha, 2, 40, capture=False)
    with use_backend("triton"):
        token = run.step(run.prefill(prompt()).argmax(-1)).argmax(-1)
        monkeypatch.setattr(attention, "capturing", lambda: True)
        steps = []
        for _ in range(3):
            with Reads() as reads:
                token = run.step(token).argmax(-1)
            steps.append(reads.ops)
    assert steps[0] == steps[1] == steps[2] and len(steps[0]) > 20
    host = ("_local_scalar_dense", "item", "nonzero", "masked_select", "index.Tensor")
    assert not [op for op, _ in steps[0] if any(name in op for name in host)]


def test_a_decode_mask_with_holes_is_refused_or_zero_under_a_capture(monkeypatch):
    """Over a static cache a decode row's keys are read from its first allowed key to the query: a mask with
    holes is refused (eager), or gives that row zero while a graph is captured (nothing can be read back)."""
    from allhere.hf import attention

    row = torch.tensor([[False, True, True, True, False, False], [True, False, True, True, False, False]])
    lens = torch.tensor([4, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="left padding only"):
        attention.decode_start(row, lens)
    monkeypatch.setattr(attention, "capturing", lambda: True)
    assert attention.decode_start(row, lens).tolist() == [[1], [-1]]


def test_refusals(models):
    """A mechanism that cannot read a static cache's buffers is refused with the reason; the decoder's
    own misuse too."""
    plain, _ = models
    sliding = convert(copy.deepcopy(plain), SlidingConfig(window=4))
    with pytest.raises(NotImplementedError, match="static cache.*does not decode over a static cache"):
        CapturedDecode(sliding, 2, 40, capture=False).prefill(prompt())
    run = CapturedDecode(plain, 2, 14, capture=False)
    with pytest.raises(RuntimeError, match="prefill a prompt first"):
        run.step(torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"prefill takes one prompt of \[2, < 14\]"):
        run.prefill(prompt(n=14))
    run.prefill(prompt(n=12))
    run.step(torch.zeros(2, dtype=torch.long))
    run.step(torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="holds 14 tokens"):
        run.step(torch.zeros(2, dtype=torch.long))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            CapturedDecode(plain, 2, 40, capture=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU")
def test_the_captured_step_gives_the_eager_steps_tokens(models):
    """On a GPU: the step captured once and replayed gives the tokens of the same step run eagerly (bf16: the
    converted layers on the Triton decode kernel)."""
    for model in models:
        model = copy.deepcopy(model).to("cuda", torch.bfloat16)
        ids = prompt().cuda()
        eager = CapturedDecode(model, 2, 40, capture=False).generate(ids, 12)
        captured = CapturedDecode(model, 2, 40)
        assert captured.capture and torch.equal(captured.generate(ids, 12), eager)
        assert captured.graph is not None
