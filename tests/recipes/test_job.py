"""The whole job's time left (``allhere_recipes.job``): planned runs, paces, the bar's ``job_left``."""

import io

from allhere.config import ModelConfig
from allhere.runtime.progress import LineProgress
from allhere_recipes.job import Job, step_cost


def test_step_cost_grows_with_tokens_model_and_context():
    small = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2)
    big = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=2)
    assert step_cost(small, 8, 64) == 2 * step_cost(small, 4, 64)
    assert step_cost(big, 4, 64) > 4 * step_cost(small, 4, 64)
    assert step_cost(small, 1, 128) > 2 * step_cost(small, 1, 64)  # attention: more than linear in length


def test_time_left_counts_the_runs_to_come_at_the_measured_pace(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("allhere_recipes.job.time.monotonic", lambda: clock[0])
    job = Job()
    (tmp_path / "t" / "b").mkdir(parents=True)
    (tmp_path / "t" / "b" / "checkpoint.json").write_text('{"step": 4}')  # run b is 4 steps in already
    job.plan(tmp_path / "t" / "a" / "checkpoint.safetensors", 10, 1.0)
    job.plan(tmp_path / "t" / "b" / "checkpoint.safetensors", 10, 3.0)
    assert job.left == {"t/a": 10, "t/b": 6} and job.time_left("t/a", None) is None  # nothing measured yet
    out = io.StringIO()
    bar = job.bar(10, "t/a")
    bar.inner = LineProgress(10, "t/a", every_percent=50, stream=out)
    for _ in range(5):
        clock[0] += 2.0  # 2 s per step of cost 1
        bar.update()
        bar.set_postfix(lm="1.0")
    # a: 5 steps left at 2 s; b: 6 steps of cost 3 at 2 s per unit of cost
    assert job.time_left("t/a", 2.0) == 5 * 2.0 + 6 * 3 * 2.0
    assert out.getvalue().splitlines()[0].endswith("job_left 0m46s")
    for _ in range(5):
        clock[0] += 2.0
        bar.update()
    bar.close()
    assert job.seconds == {"t/a": 20.0} and job.time_left("t/b", None) == 6 * 3 * 2.0


def test_a_bar_the_job_did_not_plan_counts_nothing(tmp_path, monkeypatch):
    """Work only some resumptions do (one of two models taught together, the other read back) runs under a bar
    with no planned cost: the job's time left goes on, counting it as nothing (it raised KeyError)."""
    clock = [0.0]
    monkeypatch.setattr("allhere_recipes.job.time.monotonic", lambda: clock[0])
    job = Job()
    job.plan(tmp_path / "t" / "a" / "checkpoint.safetensors", 4, 1.0)
    bar = job.bar(4, "t/a")
    clock[0] += 1.0
    bar.update()
    extra = job.bar(3, "t/unplanned")
    clock[0] += 5.0
    extra.update()
    extra.close()
    assert job.time_left("t/unplanned", None) == 3 * 1.0
