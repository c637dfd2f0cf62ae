"""lm-evaluation-harness integration, offline: local task YAMLs and JSONL files shipped in tests/."""

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from allhere import AHAConfig, Decoder, ModelConfig  # noqa: E402
from allhere.cli import main  # noqa: E402
from allhere.runtime.model_checkpoint import save_checkpoint  # noqa: E402

TASKS = Path(__file__).resolve().parents[1] / "lm_eval_tasks"


@pytest.fixture
def setup(tmp_path):
    for name in ("tiny_choice", "tiny_rolling"):  # point the YAMLs at the JSONL files by absolute path
        text = (TASKS / f"{name}.yaml").read_text().replace("tests/lm_eval_tasks/", str(TASKS) + "/")
        (tmp_path / f"{name}.yaml").write_text(text)
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2,
                                mechanism=AHAConfig(window=8, router_init="neutral")))
    ckpt = tmp_path / "m.safetensors"
    save_checkpoint(ckpt, model, None, {"step": 0})
    return tmp_path, ckpt, model


@torch.no_grad()
def direct_accuracy(model, path) -> float:
    """Share of documents whose gold choice has the highest log-likelihood after "{question} =" (the
    YAML's prompt; lm-eval puts one space before each choice), computed here from the model's byte-level
    log-probabilities (one sequence at a time, as the harness scores them)."""
    docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    right = 0
    for doc in docs:
        ctx = list(f"{doc['question']} =".encode())
        scores = []
        for choice in doc["choices"]:
            ids = ctx + list(f" {choice}".encode())
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
            n = len(ids) - len(ctx)
            scores.append(logp[-n:].gather(1, torch.tensor(ids[-n:])[:, None]).sum().item())
        right += max(range(len(scores)), key=scores.__getitem__) == doc["label"]
    return right / len(docs)


@pytest.mark.slow
def test_evaluate_reports_metrics_and_mu_f(setup):
    from allhere.eval.harness import evaluate

    tasks_dir, ckpt, model = setup
    res = evaluate(str(ckpt), ["allhere_tiny_choice", "allhere_tiny_rolling"], include_path=str(tasks_dir))
    choice, rolling = res["allhere_tiny_choice"], res["allhere_tiny_rolling"]
    assert choice["acc,none"] == pytest.approx(direct_accuracy(model, TASKS / "tiny_choice.jsonl"))
    assert 0.0 < choice["mu_f"] < 1.0 and 0.0 < rolling["mu_f"] < 1.0
    assert math.isfinite(rolling["bits_per_byte,none"]) and rolling["bits_per_byte,none"] > 0


def test_rolling_loglikelihood_matches_a_direct_forward(setup):
    """Every byte is scored, the first one after the prefix token (a newline, as documents start in the
    training corpus); with a short max_length in lm-eval's windows: each predicts the next max_length
    bytes from the byte before them, the last one reads max_length bytes back."""
    from lm_eval.api.instance import Instance

    from allhere.eval.harness import AllhereLM

    _, ckpt, model = setup
    text = "def f(x):\n    return x + 1\n" * 3
    req = Instance("loglikelihood_rolling", {}, (text,), 0, ("t", 0, 1))
    ids = [10] + list(text.encode())
    with torch.no_grad():
        def score(first, end, width):  # targets ids[first + 1:end + 1], from the width ids before each
            logp = torch.log_softmax(model(torch.tensor([ids[max(0, end - width):end]])).logits[0].float(), -1)
            return logp[first - end:].gather(1, torch.tensor(ids[first + 1:end + 1])[:, None]).sum().item()

        whole = score(0, len(ids) - 1, 4096)
        windows = sum(score(s, min(s + 32, len(ids) - 1), 32) for s in range(0, len(ids) - 1, 32))
    assert AllhereLM(str(ckpt), max_length=4096).loglikelihood_rolling([req])[0] == pytest.approx(whole, rel=1e-5)
    assert AllhereLM(str(ckpt), max_length=32).loglikelihood_rolling([req])[0] == pytest.approx(windows, rel=1e-5)


@pytest.mark.slow
def test_cli_eval(setup, capsys, monkeypatch):
    """Results on stdout; on stderr our progress over the requests, lm-eval's own bars only with --verbose;
    --batch-size reaches the model."""
    from allhere.eval import harness

    tasks_dir, ckpt, _ = setup
    sizes, real = [], harness.AllhereLM
    monkeypatch.setattr(harness, "AllhereLM", type("Spy", (real,), {
        "__init__": lambda self, *a, **kw: sizes.append(kw["batch_size"]) or real.__init__(self, *a, **kw)}))
    args = ["eval", "--model", str(ckpt), "--tasks", "allhere_tiny_choice", "--include-path", str(tasks_dir),
            "--limit", "4"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "mu_f" in out.out
    assert "lm-eval loglikelihood requests: 100% (12/12)" in out.err  # 4 documents x 3 choices
    assert "%|" not in out.err  # no tqdm bar (lm-eval builds each task's prompts under one)
    assert main(args + ["--verbose"]) == 0
    assert "%|" in capsys.readouterr().err
    assert main(args + ["--no-progress", "--batch-size", "2"]) == 0
    assert "requests" not in capsys.readouterr().err
    assert sizes == [16, 16, 2]


def test_generate_until_is_greedy_and_stops_at_the_stop_string(setup):
    from lm_eval.api.instance import Instance

    from allhere.eval.harness import AllhereLM

    _, ckpt, model = setup
    lm = AllhereLM(str(ckpt), max_gen_toks=12)
    context = "x = 1\n"
    ids = list(context.encode())
    greedy = []
    with torch.no_grad():  # greedy decoding by hand, one full forward per token
        for _ in range(12):
            greedy.append(int(model(torch.tensor([ids + greedy])).logits[0, -1].argmax()))
    text = bytes(greedy).decode("utf-8", errors="replace")
    req = lambda until: Instance("generate_until", {}, (context, {"until": until}), 0, ("t", 0, 1))  # noqa: E731
    assert lm.generate_until([req([])]) == [text]
    stop = text[3:5]  # a stop string that occurs in the greedy text: the answer ends before it
    assert lm.generate_until([req([stop])]) == [text.split(stop)[0]]


def requests(kinds=("loglikelihood", "loglikelihood_rolling")):
    from lm_eval.api.instance import Instance

    texts = ["def f(x):\n    return x + 1\n", "import os", "class A:\n    pass\n" * 3, "x = [1, 2, 3]"]
    out = {}
    if "loglikelihood" in kinds:
        conts = [" y", "\n", " = 1", "", " b", " ok", " z", "x"]
        out["loglikelihood"] = [Instance("loglikelihood", {}, (t, c), i, ("ll", 0, 1))
                                for i, (t, c) in enumerate(zip(texts * 2, conts))]
    if "loglikelihood_rolling" in kinds:
        out["loglikelihood_rolling"] = [Instance("loglikelihood_rolling", {}, (t * 3,), i, ("roll", 0, 1))
                                        for i, t in enumerate(texts)]
    if "generate_until" in kinds:
        out["generate_until"] = [Instance("generate_until", {}, (t, {"until": ["\n"], "max_gen_toks": 6}), i,
                                          ("gen", 0, 1)) for i, t in enumerate(texts)]
    return out


def test_decoder_batches_equal_one_request_at_a_time(setup):
    """Right-padded batches through the segment path (padding: segment start -1) give what batches of 1
    give, in the requests' order; mu_f per task counts the real tokens only, so it is the same too."""
    from allhere.eval.harness import AllhereLM

    _, ckpt, _ = setup
    batched, single = (AllhereLM(str(ckpt), batch_size=n, max_length=40, show_progress=False) for n in (3, 1))
    calls = []
    inner = batched.runner.model.forward
    batched.runner.model.forward = lambda ids, **kw: calls.append(kw.get("segment_starts")) or inner(ids, **kw)
    for kind, reqs in requests(("loglikelihood", "loglikelihood_rolling", "generate_until")).items():
        got, want = getattr(batched, kind)(reqs), getattr(single, kind)(reqs)
        if kind == "loglikelihood":
            assert [g for _, g in got] == [g for _, g in want] and got[3] == (0.0, True)  # an empty continuation
            got, want = [s for s, _ in got], [s for s, _ in want]
        assert got == (want if kind == "generate_until" else pytest.approx(want, rel=1e-5))
    assert any(s is not None and bool((s == -1).any()) for s in calls)  # padded batches went through segments
    mu = batched.mu_f()
    assert set(mu) == {"ll", "roll", "gen"} and mu == pytest.approx(single.mu_f(), rel=1e-6)


def test_a_model_that_refuses_padding_gets_unpadded_batches(tmp_path):
    """AA-MoE shares its budget over the whole sequence and refuses segment boundaries: its requests run
    in batches of equal lengths, unpadded, and still equal one request at a time."""
    from allhere import AAMoEConfig
    from allhere.eval.harness import AllhereLM

    model = Decoder(ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2,
                                mechanism=AAMoEConfig(chunk=4, experts=2)))
    save_checkpoint(tmp_path / "m.safetensors", model, None, {"step": 0})
    batched, single = (AllhereLM(str(tmp_path / "m.safetensors"), batch_size=n, show_progress=False) for n in (4, 1))
    reqs = requests(("loglikelihood",))["loglikelihood"]
    got, want = batched.loglikelihood(reqs), single.loglikelihood(reqs)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in want]
    assert [score for score, _ in got] == pytest.approx([score for score, _ in want], rel=1e-5)
    assert batched.runner.pads is False


def test_the_task_index_is_built_once_per_include_path_as_its_files_stand(tmp_path, monkeypatch):
    """lm-eval's TaskManager (seconds to build) is reused for the same include path, and built again when a
    task file there is added or changed, or for another path."""
    import lm_eval.tasks

    from allhere.eval import harness

    built = []
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None: built.append(include_path) or object())
    harness._task_manager.cache_clear()
    try:
        (tmp_path / "a.yaml").write_text("task: a\n")
        first = harness.task_manager(str(tmp_path))
        assert harness.task_manager(str(tmp_path)) is first and harness.task_manager(tmp_path / ".") is first
        (tmp_path / "notes.txt").write_text("not a task")
        assert harness.task_manager(str(tmp_path)) is first
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "b.yml").write_text("task: b\n")
        second = harness.task_manager(str(tmp_path))
        assert second is not first
        (tmp_path / "a.yaml").write_text("task: a2\n")
        assert harness.task_manager(str(tmp_path)) is not second
        assert harness.task_manager(None) is harness.task_manager(None)
        assert built == [str(tmp_path)] * 3 + [None]
    finally:
        harness._task_manager.cache_clear()
