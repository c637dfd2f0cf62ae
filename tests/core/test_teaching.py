"""Routers taught by the full model (``allhere.teaching``): the teacher's labels against a brute-force loop, the
ridge fit, the budget the biases set, the calibration windows with planted facts, and bad settings refused."""

import math

import pytest
import torch

from allhere import AHAConfig, Decoder, FullConfig, ModelConfig, SlidingConfig
from allhere.analysis.static import top_k_heads
from allhere.teaching import teach_routers
from allhere.teaching.fit import fit_router
from allhere.teaching.labels import local_cost
from allhere.teaching.retrieval import retrieval_windows
from allhere.teaching.teach import teach_alike
from allhere.validation import ConfigError


def brute_cost(q, k, v, window, sinks, label):
    b, h, n, d = q.shape
    group = h // k.shape[1]
    out = torch.zeros(b, h, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                kk, vv = k[bi, hi // group, :i + 1].double(), v[bi, hi // group, :i + 1].double()
                p = torch.softmax(kk @ q[bi, hi, i].double() / math.sqrt(d), 0)
                local = torch.tensor([i - j < window or j < sinks for j in range(i + 1)])
                if label == "mass":
                    out[bi, hi, i] = p[~local].sum()
                else:
                    pl = torch.softmax((kk @ q[bi, hi, i].double() / math.sqrt(d)).masked_fill(~local, -math.inf), 0)
                    full = p @ vv
                    out[bi, hi, i] = (full - pl @ vv).norm() / full.norm()
    return out


@pytest.mark.parametrize("label", ["mass", "output"])
@pytest.mark.parametrize("sinks", [0, 2])
def test_local_cost_equals_a_loop(label, sinks):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8,
                                                                                                        generator=g)
    got = local_cost(q, k, v, 5, sinks, label=label)
    want = brute_cost(q, k, v, 5, sinks, label)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert got[..., :5].abs().max() < 1e-6  # the whole prefix is local: nothing lost


def test_fit_finds_a_linearly_separable_top():
    """Costs exp(x w + c) per head, x not centred nor scaled: the fitted logits pick each head's top 20% almost
    exactly (the standardisation folded back into the weights)."""
    g = torch.Generator().manual_seed(0)
    x = 3.0 + 5.0 * torch.randn(3000, 6, generator=g)
    w, c = torch.randn(6, 3, generator=g), torch.randn(3, generator=g)
    cost = torch.exp(0.2 * x @ w + c)
    weight, bias = fit_router(x, cost, 0.2, steps=300)
    z = x @ weight.T + bias
    top = cost > torch.quantile(cost.flatten(), 0.8)
    assert torch.corrcoef(torch.stack([z.flatten(), cost.log().flatten()]))[0, 1] > 0.95
    assert ((z > torch.quantile(z.flatten(), 0.8)) & top).sum() / top.sum() > 0.9


def test_answers_get_their_own_costliest_share():
    """A head whose cost at the answering tokens is high among those tokens' pairs but under the layer's top 20%
    (another head's long tail fills it): with the answers named it goes global there at the layer's budget,
    without them it stays local."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 4, generator=g)
    answers = torch.arange(3000) % 10 == 0
    x[answers, 0] += 3.0  # the answering tokens look alike
    first = torch.exp(2.0 * x[:, 1]) * torch.where(answers, 0.1, 1.0)  # a long tail, low where the answers are
    cost = torch.stack([first, torch.where(answers, 1.0, 0.05)], 1)
    cost[:, 1] += 0.01 * torch.rand(3000, generator=g)
    assert cost[answers, 1].max() < torch.quantile(cost.flatten(), 0.8)  # under the layer's top 20%
    weight = 1.0 + 9.0 * answers.float()

    def opened(**kw):  # the share of the second head's answering pairs global at the layer's 20%
        w, b = fit_router(x, cost, 0.2, weight, **kw)
        z = x @ w.T + b
        return (z[answers, 1] > torch.quantile(z.flatten(), 0.8)).float().mean().item()

    assert opened(answers=answers) > 0.75 and opened() < 0.1


def tiny(mech=None, layers=3):
    mech = mech or AHAConfig(window=6, sinks=1)
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=61, d_model=32, n_layers=layers, n_heads=4, n_kv_heads=2, mechanism=mech))


def test_teaching_sets_the_budget_on_the_calibration_text():
    model = tiny()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 61, (2, 48), generator=g) for _ in range(3)]
    before = [p.clone() for p in model.parameters()]
    taught = teach_routers(model, batches, 0.2)
    assert taught.tokens == 3 * 2 * 48 and abs(taught.mu_f - 0.2) < 0.01
    assert all(abs(m - 0.2) < 0.01 for m in taught.layer_mu_f) and taught.answer_mu_f is None
    with torch.no_grad():
        gates = torch.cat([model(ids).routing.mu_f()[None] for ids in batches])
    assert abs(gates.mean().item() - 0.2) < 0.01  # the model routes as the teaching pass counted
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    names = [n for n, _ in model.named_parameters()]
    assert all(c == (".router." in n) for c, n in zip(changed, names)), "only the routers change"
    assert len(taught.head_cost) == 3 and len(taught.head_cost[0]) == 4
    heads = top_k_heads(torch.tensor(taught.head_cost), 3)
    assert heads.sum() == 3


def test_taught_routers_find_the_costly_pairs_on_held_out_text():
    """allhere's pretrained byte-level base (shipped), AHA at w = 32 with a sink, taught on standard-library code:
    on held-out code its routers send global more than twice the chance share of the (token, head) pairs the full
    model's attention needs most, and its loss lies between every gate local and every gate global."""
    from allhere import swap_mechanism
    from allhere.data.corpus import stdlib_corpus
    from allhere.losses import lm_loss
    from allhere.routing import set_forced_gate
    from allhere.runtime.model_checkpoint import load_model
    from allhere.teaching.observe import observe_routed
    from allhere_recipes.bases import base_files

    base, _ = load_model(base_files("stdlib")[0])
    model = swap_mechanism(base, AHAConfig(window=32, sinks=1)).eval()
    corpus, n = stdlib_corpus(), 256
    cut = lambda text, k: torch.stack([text[i * 3 * n:i * 3 * n + n].long() for i in range(k)])  # noqa: E731
    teach_routers(model, list(cut(corpus.train[1000:], 12).split(4)), 0.15)
    held = cut(corpus.val, 8)
    seen = []
    set_forced_gate(model, True)
    with torch.no_grad(), observe_routed(model, lambda row, m, q, k, v, call: seen.append(
            (local_cost(q, k, v, 32, 1)[..., 32:], m.scores(call.x)[..., 32:]))):
        full = lm_loss(model(held).logits, held).item()
    set_forced_gate(model, False)
    with torch.no_grad():
        local = lm_loss(model(held).logits, held).item()
        set_forced_gate(model, None)
        taught = lm_loss(model(held).logits, held).item()
    cost, scores = torch.stack([c for c, _ in seen]), torch.stack([s for _, s in seen])
    top = cost > torch.quantile(cost.flatten(), 0.85)
    chosen = scores > torch.quantile(scores.flatten(), 0.85)
    assert (top & chosen).sum() / top.sum() > 0.3  # chance: 0.15
    assert full < taught < local


def test_copies_taught_together_get_the_routers_taught_alone():
    """One pass teaches a model with sinks and its copy without them (and another window) as each alone would be
    taught; a copy whose weights differ is refused before anything is taught."""
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 61, (2, 40), generator=g) for _ in range(2)]
    mechs = [AHAConfig(window=6, sinks=1), AHAConfig(window=6, sinks=0), AHAConfig(window=9, sinks=1)]
    together = [tiny(m) for m in mechs]
    got = teach_alike(together, batches, 0.2)
    for mech, model, taught in zip(mechs, together, got):
        alone = tiny(mech)
        want = teach_routers(alone, batches, 0.2)
        assert torch.allclose(torch.tensor(taught.head_cost), torch.tensor(want.head_cost))
        assert taught.mu_f == pytest.approx(want.mu_f)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(model.parameters(), alone.parameters()))
    assert not torch.allclose(torch.tensor(got[0].head_cost), torch.tensor(got[1].head_cost))  # own costs
    other = tiny(mechs[1])
    with torch.no_grad():
        other.embed.weight.add_(1.0)
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(ConfigError, match="weights differ"):
        teach_alike([tiny(), other], batches, 0.2)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


@pytest.mark.parametrize("kwargs, message", [
    ({"mu_f": 0.0}, "mu_f = 0.0 is invalid"), ({"mu_f": 1.0}, "mu_f = 1.0 is invalid"),
    ({"mu_f": 0.1, "label": "loss"}, "label must be one of"), ({"mu_f": True}, "mu_f = True is invalid"),
    ({"mu_f": 0.1, "answers": [torch.zeros(2, 16, dtype=torch.bool)]}, "answers must be one bool tensor per batch")])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        teach_routers(tiny(), [torch.randint(0, 61, (1, 16))], **kwargs)


@pytest.mark.parametrize("mech, message", [(FullConfig(), "no routed"), (SlidingConfig(window=4), "no routed"),
                                           (AHAConfig(window=4, router_bias=False), "router_bias = False")])
def test_models_without_a_router_to_teach_are_refused(mech, message):
    with pytest.raises(ConfigError, match=message):
        teach_routers(tiny(mech), [torch.randint(0, 61, (1, 16))], 0.1)


class Words:
    """A tokenizer of one id per character (enough to plant and find the facts)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 for c in text]}


def test_retrieval_windows_ask_each_fact_beyond_the_distance():
    docs = [torch.randint(97, 123, (3000,), generator=torch.Generator().manual_seed(0))]
    windows = retrieval_windows(Words(), docs, 6, 400, 120, facts=2, seed=3)
    assert windows.shape == (6, 400)
    for row in windows.tolist():
        text = "".join(map(chr, row))
        numbers = [w.strip(".") for w in text.split() if w.strip(".\n").isdigit() and len(w.strip(".\n")) == 5]
        assert len(numbers) == 4  # each fact's number, stated and asked
        first = {n: text.index(n) for n in numbers}
        for n in set(numbers):
            assert text.rindex(n) - first[n] > 120
    assert torch.equal(windows, retrieval_windows(Words(), docs, 6, 400, 120, facts=2, seed=3))
    with pytest.raises(ConfigError, match="cannot hold 2 facts 190 tokens apart"):
        retrieval_windows(Words(), docs, 1, 200, 190)


def test_haystack_windows_repeat_a_short_run_around_the_facts():
    docs = [torch.randint(97, 123, (3000,), generator=torch.Generator().manual_seed(0))]
    plain = retrieval_windows(Words(), docs, 6, 400, 120, facts=2, seed=3)
    both, answers = retrieval_windows(Words(), docs, 6, 400, 120, facts=2, seed=3, with_answers=True, haystacks=3)
    assert both.shape == answers.shape == (9, 400) and torch.equal(both[:6], plain)  # the others unchanged
    def distinct(row):  # different 8-token stretches in a window
        return len({tuple(row[i:i + 8]) for i in range(len(row) - 7)})

    for row, asked in zip(both[6:].tolist(), answers[6:]):
        text = "".join(map(chr, row))
        numbers = [w.strip(".") for w in text.split() if w.strip(".\n").isdigit() and len(w.strip(".\n")) == 5]
        assert len(numbers) == 4 and asked.any()  # each fact stated and asked, its answer marked
        # a run of at most 64 tokens over and over, the facts between: far fewer different stretches than text
        assert distinct(row) < 0.6 * min(distinct(r) for r in plain.tolist())


def test_prose_haystacks_repeat_plain_sentences_made_here():
    from allhere.eval.passkey import FILLER
    from allhere.teaching.retrieval import QUALITIES, THINGS

    docs = [torch.randint(97, 123, (3000,), generator=torch.Generator().manual_seed(0))]
    plain = retrieval_windows(Words(), docs, 6, 1200, 120, facts=2, seed=3)
    both = retrieval_windows(Words(), docs, 6, 1200, 120, facts=2, seed=3, haystacks=3, filler="prose")
    assert torch.equal(both[:6], plain)
    for row in both[6:].tolist():
        text = "".join(map(chr, row))
        sentences = [s for s in (p.strip() for p in text.split(".")) if s.startswith("The ") and s.count(" ") == 3]
        assert len(sentences) > 20  # "The road is cold." again and again
        assert all(s.split()[1] in THINGS and s.split()[3] in QUALITIES for s in sentences)
        assert not any(s.strip() in text for s in FILLER.split(". ") if s.strip())  # not the passkey's
    with pytest.raises(ConfigError, match="filler must be one of"):
        retrieval_windows(Words(), docs, 1, 400, 120, haystacks=1, filler="noise")
