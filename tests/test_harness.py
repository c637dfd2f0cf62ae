"""lm-evaluation-harness integration, offline: local task YAMLs and JSONL files shipped in tests/."""

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from allhere import AHAConfig, Decoder, ModelConfig  # noqa: E402
from allhere.checkpoint import save_checkpoint  # noqa: E402
from allhere.cli import main  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"


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


def test_evaluate_reports_metrics_and_mu_f(setup):
    from allhere.eval.harness import evaluate

    tasks_dir, ckpt, model = setup
    res = evaluate(str(ckpt), ["allhere_tiny_choice", "allhere_tiny_rolling"], include_path=str(tasks_dir))
    choice, rolling = res["allhere_tiny_choice"], res["allhere_tiny_rolling"]
    assert choice["acc,none"] == pytest.approx(direct_accuracy(model, TASKS / "tiny_choice.jsonl"))
    assert 0.0 < choice["mu_f"] < 1.0 and 0.0 < rolling["mu_f"] < 1.0
    assert math.isfinite(rolling["bits_per_byte,none"]) and rolling["bits_per_byte,none"] > 0


def test_rolling_loglikelihood_matches_a_direct_forward(setup):
    from allhere.eval.harness import AllhereLM
    from lm_eval.api.instance import Instance

    _, ckpt, model = setup
    lm = AllhereLM(str(ckpt), max_length=4096)
    text = "def f(x):\n    return x + 1\n" * 3
    req = Instance("loglikelihood_rolling", {}, (text,), 0, ("t", 0, 1))
    got = lm.loglikelihood_rolling([req])[0]
    ids = torch.tensor([list(text.encode())])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    assert got == pytest.approx(logp.gather(1, ids[0, 1:, None]).sum().item(), rel=1e-5)


def test_cli_eval(setup, capsys):
    """Results on stdout; on stderr our progress over the requests, lm-eval's own bars only with --verbose."""
    tasks_dir, ckpt, _ = setup
    args = ["eval", "--model", str(ckpt), "--tasks", "allhere_tiny_choice", "--include-path", str(tasks_dir),
            "--limit", "4"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "mu_f" in out.out
    assert "lm-eval loglikelihood requests: 100% (12/12)" in out.err  # 4 documents x 3 choices
    assert "%|" not in out.err  # no tqdm bar (lm-eval builds each task's prompts under one)
    assert main(args + ["--verbose"]) == 0
    assert "%|" in capsys.readouterr().err
    assert main(args + ["--no-progress"]) == 0
    assert "requests" not in capsys.readouterr().err


def test_generate_until_is_greedy_and_stops_at_the_stop_string(setup):
    from allhere.eval.harness import AllhereLM
    from lm_eval.api.instance import Instance

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
