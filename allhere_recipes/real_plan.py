"""The real-model job's settings (``allhere demo --model``): per device, the sequence length, the window, the
fine-tuning and the probes. Every number is chosen here once, with its reason.

The AHA paper ("Learning When Not to Attend Globally") fine-tunes OLMo-2-1B-SFT for one epoch of the data its
base was tuned on (Tulu-3, about a billion tokens) at w = 256 and 4k tokens, AdamW 3e-5, lambda 3e-4, tau 0.5,
warmup 3%. Two CPU cores train SmolLM2-135M at about 100 tokens/s, so the CPU job fine-tunes on some 10^5
tokens, four orders of magnitude less; what it keeps of the paper's protocol and what it changes:

- data: the Python standard library of the running interpreter (offline everywhere). SmolLM2's base was
  pretrained on code among others; its instruction data is not to be had offline. Held-out text is the
  library's validation files (``allhere.data.corpus``: split by a hash of the path), never trained on.
- length and window: 512 tokens at w = 64 on the CPU, the paper's ratio of a 2,048-token context at w = 256
  (1/8 of the context local); 8,192 tokens at w = 256 on a GPU, the paper's window at SmolLM2's whole context.
- learning rates: the paper's 3e-5 for the model. The routers start open (``router_init="global"``: the
  converted model computes what the pretrained one did) and must close most gates within a few hundred
  steps, not thousands: they train at ``router_lr_mult`` x the model's rate, and lambda is steered towards
  ``target_mu_f`` (``TrainConfig.target_mu_f``: the dual update of ``allhere.train``), starting from ``lam``,
  because at a fixed lambda the gates of a short run stay where they start (see docs/real-model.md).
- the control is the same model, full attention, the same data, steps and learning rate, so that what plain
  fine-tuning on the library gains is not credited to AHA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from allhere.validation import ConfigError

PRESETS = ("cpu", "gpu", "tiny")


@dataclass(frozen=True)
class RealPlan:
    """One real-model job: fine-tuning, evaluation and probes."""

    seq_len: int  # tokens per training and held-out sequence
    window: int  # AHA's w (and DAR's)
    steps: int  # optimizer steps of each fine-tuning run (AHA, the control; each DAR stage)
    batch_size: int  # sequences per micro-batch
    grad_accum: int  # micro-batches per optimizer step
    lr: float  # the model's peak learning rate (the paper's 3e-5)
    router_lr_mult: float  # routers train at lr x this
    lam: float  # lambda of L_reg at the start
    target_mu_f: float | None  # lambda steered towards this share of full attention (None: fixed lambda)
    lam_rate: float  # step size of that steering (``TrainConfig.lam_rate``)
    eval_sequences: int  # held-out sequences scored
    passkey_prompts: int  # passkey prompts per model
    passkey_length: int  # tokens per passkey prompt
    chat_tokens: int  # new tokens per chat reply
    speed_prompt: int  # tokens of the prompt whose decode is timed
    speed_tokens: int  # decode steps timed
    dar_steps: int  # optimizer steps of each DAR stage and of its control
    dar_stage1_lr: float  # DAR stage 1 (the bottleneck only): the DAR paper's 3e-4
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.window >= self.seq_len:
            raise ConfigError(f"window = {self.window} must be shorter than seq_len = {self.seq_len}")
        if self.passkey_length < 2 * self.window:
            raise ConfigError(f"passkey_length = {self.passkey_length} leaves no room beyond the window "
                              f"({self.window})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def preset_plan(preset: str, device: str) -> RealPlan:
    """"cpu": the default, about 45 minutes on 2 cores; "gpu": 8k tokens at w = 256; "tiny": seconds, for tests."""
    if preset == "tiny":
        return RealPlan(seq_len=64, window=8, steps=3, batch_size=1, grad_accum=1, lr=3e-5, router_lr_mult=100.0,
                        lam=0.01, target_mu_f=0.1, lam_rate=0.1, eval_sequences=2, passkey_prompts=2,
                        passkey_length=320, chat_tokens=4, speed_prompt=48, speed_tokens=3, dar_steps=2,
                        dar_stage1_lr=3e-4, device=device)
    if preset == "cpu":
        return RealPlan(seq_len=512, window=64, steps=150, batch_size=1, grad_accum=1, lr=3e-5,
                        router_lr_mult=100.0, lam=0.01, target_mu_f=0.08, lam_rate=0.1, eval_sequences=24,
                        passkey_prompts=20, passkey_length=480, chat_tokens=48, speed_prompt=2048, speed_tokens=32,
                        dar_steps=60, dar_stage1_lr=3e-4, device=device)
    if preset == "gpu":
        return RealPlan(seq_len=8192, window=256, steps=200, batch_size=1, grad_accum=4, lr=3e-5,
                        router_lr_mult=100.0, lam=0.01, target_mu_f=0.06, lam_rate=0.1, eval_sequences=16,
                        passkey_prompts=40, passkey_length=8000, chat_tokens=64, speed_prompt=8192, speed_tokens=64,
                        dar_steps=200, dar_stage1_lr=3e-4, device=device)
    raise ConfigError(f"preset = {preset!r} is invalid: expected one of {', '.join(map(repr, PRESETS))}")
