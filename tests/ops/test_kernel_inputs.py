"""The Triton kernels read q, k, v where they lie (in Triton's interpreter on the CPU, compiled on a GPU).

A decode step over allhere's ``KVCache`` (the Decoder) and over the ``InPlaceLayer`` of a converted
Hugging Face model hands the decode kernel the cache's own buffer (same storage, the buffer's strides) and
copies no cache-sized tensor outside the kernel launches; prefill and training hand the kernels the
projections' transposed views. The logits are those of the reference backend."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")  # on the CPU, conftest.py has chosen Triton's interpreter

from allhere import AHAConfig, Decoder, ModelConfig, use_backend  # noqa: E402
from allhere.kernels import aha_decode, aha_prefill, aha_train, interpreted  # noqa: E402

from helpers import mixed_routers, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE, TOL = (torch.bfloat16, 2e-2) if DEVICE == "cuda" else (torch.float32, 1e-5)
interpreted()  # asked once, before any kernel is replaced by a spy below
COPIES = {torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default}


class CopyCounter(TorchDispatchMode):
    """Sizes of the copies made while ``counting`` (the kernel spies switch it off during a launch: the
    interpreter moves every argument to and from its own buffers)."""

    def __init__(self):
        super().__init__()
        self.sizes, self.counting = [], True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting and func in COPIES:
            self.sizes.append(out.numel())
        return out


class Spy:
    """Stands in for a Triton kernel: records the tensor arguments of each launch, then launches."""

    def __init__(self, kernel, counter=None):
        self.kernel, self.counter, self.launches = kernel, counter, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append([a for a in args if isinstance(a, torch.Tensor)])
            if self.counter is not None:
                self.counter.counting = False
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                if self.counter is not None:
                    self.counter.counting = True
        return launch


def spy(monkeypatch, module, name, counter=None):
    s = Spy(getattr(module, name), counter)
    monkeypatch.setattr(module, name, s)
    return s


def decode_steps(model, ids, prefill, cache, call, counter):
    """Logits of a prefill of ``prefill`` tokens, then one token at a time, on the Triton backend; the
    copies of the one-token steps are counted."""
    with torch.no_grad(), use_backend("triton"):
        logits = [call(ids[:, :prefill], cache)]
        with counter:
            logits += [call(ids[:, t:t + 1], cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(logits, 1).float()


def storage(t):
    return t.untyped_storage().data_ptr()


def check_decode_read_the_buffers(decode, counter, buffers, cache_tokens, kv_numel):
    """Every decode launch read K and V (args 1, 2) from a cache buffer, as a strided view of it (the
    buffer holds more tokens than the view), and nothing of a cache's size was copied meanwhile."""
    assert decode.launches
    for args in decode.launches:
        k, v = args[1], args[2]
        assert storage(k) in buffers and storage(v) in buffers
        assert not k.is_contiguous() and k.shape[2] < cache_tokens  # a view of a larger buffer, not a copy
    assert max(counter.sizes, default=0) < kv_numel  # only the new token's k, v were written


def test_decode_over_the_decoders_kv_cache_reads_it_in_place(monkeypatch):
    torch.manual_seed(0)
    model = mixed_routers(Decoder(ModelConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                              mechanism=AHAConfig(window=4)))).to(DEVICE, DTYPE).eval()
    ids = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    counter = CopyCounter()
    decode = spy(monkeypatch, aha_decode, "_decode_kernel", counter)
    sliding = spy(monkeypatch, aha_prefill, "_sliding_kernel")
    cache = model.new_cache(tokens=64)  # room for 64 tokens: the 30 used are a view of the buffer
    got = decode_steps(model, ids, 20, cache, lambda x, c: model(x, cache=c).logits, counter)
    buffers = {storage(layer._k.data) for layer in cache.layers} | {storage(layer._v.data) for layer in cache.layers}
    check_decode_read_the_buffers(decode, counter, buffers, 64, 2 * 2 * 20 * 16)
    q, k, v = sliding.launches[0][:3]  # the prefill: the projections' [b, n, h, d] memory, read transposed
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    with torch.no_grad(), use_backend("reference"):
        want = model(ids).logits.float()
    assert rel_err(got, want) < TOL


@pytest.mark.slow
def test_decode_over_a_converted_hf_models_in_place_layer_reads_it_in_place(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from allhere.hf import convert, new_cache
    from allhere.hf.cache import cache_kwargs

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model = mixed_routers(convert(model, AHAConfig(window=4))).to(DEVICE, DTYPE)
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    counter = CopyCounter()
    decode = spy(monkeypatch, aha_decode, "_decode_kernel", counter)
    cache = new_cache(model)
    got = decode_steps(model, ids, 20, cache, lambda x, c: model(x, **cache_kwargs(c)).logits, counter)
    layers = [layer._kv for layer in cache.layers]
    buffers = {storage(kv._k.data) for kv in layers} | {storage(kv._v.data) for kv in layers}
    assert all(kv.capacity > 40 for kv in layers)  # the buffers double: the 40 tokens are a view
    check_decode_read_the_buffers(decode, counter, buffers, layers[0].capacity, 2 * 2 * 20 * 16)
    with torch.no_grad(), use_backend("reference"):
        want = model(ids).logits.float()
    assert rel_err(got, want) < TOL


def test_training_kernels_take_the_projections_views_and_give_gradients_in_their_layout(monkeypatch):
    """Forward and backward on q, k, v laid out [b, n, heads, d] and read transposed: no kernel gets a
    copy, and dq, dk, dv come back in that layout (the projections' backward needs no copy either)."""
    b, n, h, hkv, d = 2, 40, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(b, n, heads, d, generator=g).to(DEVICE, DTYPE).requires_grad_() for heads in (h, hkv, hkv)]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    hard = (torch.rand(b, h, n, generator=g) < 0.3).to(DEVICE)
    kernels = [spy(monkeypatch, aha_prefill, name) for name in ("_sliding_kernel", "_global_kernel")]
    kernels += [spy(monkeypatch, aha_train, name) for name in ("_local_dq_kernel", "_global_dq_kernel", "_dkdv_kernel")]
    out, _ = aha_train.aha_train_triton(q, k, v, hard, 6, d ** -0.5)
    grads = torch.autograd.grad(out.float().square().sum(), [q, k, v])
    for spied in kernels:
        got_q, got_k, got_v = spied.launches[0][:3]
        assert (storage(got_q), storage(got_k), storage(got_v)) == tuple(storage(t) for t in leaves)
    for grad, view in zip(grads, (q, k, v)):
        assert grad.stride() == view.stride()
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    from allhere.ops.aha import aha_attention_reference

    want_out = aha_attention_reference(*ref, hard.cpu() if DEVICE == "cpu" else hard.float().cpu().bool(), 6)
    want = torch.autograd.grad(want_out.square().sum(), ref)
    assert rel_err(out.float().cpu(), want_out.detach().cpu()) < TOL
    for got, w in zip(grads, want):
        assert rel_err(got.float().cpu(), w.cpu()) < 2 * TOL
