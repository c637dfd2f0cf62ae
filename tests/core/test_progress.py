"""Progress where stderr is not a terminal: a plain line every few percent, with an estimate of the time left."""

import io
import re

import torch

from allhere.config import ModelConfig, TrainConfig
from allhere.model import Decoder
from allhere.runtime.progress import LineProgress
from allhere.train import train


def test_a_line_every_five_percent_with_time_left():
    out = io.StringIO()
    bar = LineProgress(200, "run/pretrain", initial=20, every_percent=5, stream=out)
    for _ in range(180):
        bar.update()
        bar.set_postfix(lm="1.234")
    lines = out.getvalue().splitlines()
    assert [int(re.search(r"(\d+)%", line).group(1)) for line in lines] == list(range(15, 101, 5))
    assert all(line.startswith("run/pretrain: ") and "elapsed" in line for line in lines)
    assert all("left" in line for line in lines[:-1]) and "left" not in lines[-1]
    assert lines[-1].startswith("run/pretrain: 100% (200/200)") and lines[-1].endswith("; lm 1.234")
    silent = LineProgress(10, "x", stream=None)
    silent.update(10)  # prints nothing, fails nothing


def test_training_reports_lines_when_stderr_is_not_a_terminal(tmp_path, capsys):
    torch.manual_seed(0)
    model = Decoder(ModelConfig(d_model=16, n_layers=1, n_heads=2))
    cfg = TrainConfig(steps=40, batch_size=2, warmup_ratio=0.0, eval_every=0, ckpt_every=40)
    data = torch.randint(0, 256, (64, 8))
    train(model, lambda step, micro, g: data[torch.randint(0, 64, (2,), generator=g)], cfg,
          tmp_path / "run" / "x" / "checkpoint.safetensors")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 20 and lines[0].startswith("run/x: 5% (2/40)") and "left" in lines[0]
    assert "\r" not in "".join(lines) and lines[-1].startswith("run/x: 100% (40/40)")
