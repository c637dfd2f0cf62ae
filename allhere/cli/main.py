"""The command table, the parser and ``main``.

Every error a user can cause ends in one line ``allhere <command>: error: ...`` on stderr and exit code
2: argparse's own errors (without the usage block), values refused by the argument types
(``allhere.cli.args``), and the library's known errors (a run folder another process writes included:
``allhere.runtime.runlock``). Ctrl-C and SIGTERM end in one line too, ``allhere <command>: interrupted ...`` with how
to resume, and exit code 130 / 143 (``allhere.runtime.interrupt``). Third-party libraries (transformers, datasets,
lm-eval) are kept quiet unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable

from ..data.corpus import DataError
from ..distributed.env import detect
from ..runtime.interrupt import Interrupted, terminate_as_interrupt
from ..runtime.model_checkpoint import CheckpointError
from ..validation import ConfigError
from .bench import bench, bench_arguments
from .comparisons import compare, compare_arguments, patterns, patterns_arguments
from .fetch import fetch, fetch_arguments
from .generate import generate, generate_arguments
from .models import (
    convert,
    convert_arguments,
    eval_arguments,
    evaluate,
    perplexity,
    perplexity_arguments,
    sft,
    sft_arguments,
)
from .quiet import quiet_third_party
from .runs import (
    aamoe,
    aamoe_arguments,
    analyze,
    analyze_arguments,
    demo,
    demo_arguments,
    sweep,
    sweep_arguments,
)
from .serve import serve, serve_arguments

KNOWN_ERRORS = (ConfigError, DataError, CheckpointError, ImportError)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]
    resume: str | None = None  # how a stopped run continues, told after Ctrl-C / SIGTERM (None: start again)


AGAIN = "run the same command again to continue"  # the run folders of demo, sweep, compare, aamoe


COMMANDS = (
    Command("demo", "start from a pretrained full model (shipped with allhere, or --pretrain), swap in AHA, "
            "fine-tune, evaluate, write a report",
            demo_arguments, demo, AGAIN),
    Command("analyze", "routing statistics, sorted-usage curve and static baseline of a demo run",
            analyze_arguments, analyze),
    Command("sweep", "window and lambda sweeps (Tables 1, 2, 4 of the AHA paper, \"Learning When Not to Attend "
            "Globally\"), resumable", sweep_arguments, sweep, AGAIN),
    Command("perplexity", "rolling-window perplexity of a checkpoint on held-out documents",
            perplexity_arguments, perplexity),
    Command("eval", "lm-evaluation-harness tasks, with mu_f next to each task's metrics", eval_arguments, evaluate),
    Command("bench", "AHA against the fastest dense attention: the op's prefill / decode / training, and a whole "
            "model's prefill and decode tokens/s (GPU)",
            bench_arguments, bench),
    Command("fetch", "fetch a known pretrained model (smollm2: SmolLM2-135M-Instruct as a GGUF) into allhere's cache; "
            "then --model NAME takes it", fetch_arguments, fetch),
    Command("convert", "convert a local Hugging Face model to AHA, DAR or a windowed sparse pattern and save it",
            convert_arguments, convert),
    Command("sft", "convert a local Hugging Face model to AHA or DAR and fine-tune it on chat data",
            sft_arguments, sft, "run the same command with --resume to continue"),
    Command("generate", "try a model: continue a prompt or chat over stdin, streamed (tokens/s; mu_f for AHA)",
            generate_arguments, generate),
    Command("serve", "serve a model (plain or converted) with vLLM's OpenAI-compatible server until Ctrl-C",
            serve_arguments, serve),
    Command("patterns", "sparse attention patterns side by side: masks, scores, receptive field, hops, KV cache, "
            "time", patterns_arguments, patterns),
    Command("compare", "full, sliding, sinks, dilated, Longformer, BigBird and AHA fine-tuned at the same attention "
            "budget: quality against scores", compare_arguments, compare, AGAIN),
    Command("aamoe", "AA-MoE against dense, All-Attention, context-only and experts-only budgets (bits/byte vs "
            "FLOPs)", aamoe_arguments, aamoe, AGAIN),
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line naming the command, not the usage block and the message."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    # no abbreviated options: a shortened or misspelt flag is an error, not silently another option
    p = OneLineParser(prog="allhere", description="Local and global attention for decoder-only LMs.",
                      allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        cp = sub.add_parser(command.name, help=command.help, description=command.help, allow_abbrev=False)
        command.add_arguments(cp)
        cp.add_argument("--verbose", action="store_true",
                        help="also show what transformers, datasets and lm-eval print (default: errors only)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (0; 2 after a one-line error on stderr; 130 / 143 after
    SIGINT / SIGTERM, with one line on stderr)."""
    # No command needs the network: transformers, datasets and lm-eval read local files only and fail at
    # once on what is not there, instead of retrying the Hub (HF_HUB_OFFLINE=0 in the environment overrides).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as e:  # an argument error (one line already printed), or --help
        return e.code
    if extra:  # named by the command they were given to (argparse would name only "allhere")
        print(f"allhere {args.command}: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    command = next(c for c in COMMANDS if c.name == args.command)
    try:
        with terminate_as_interrupt(), quiet_third_party(args.verbose):
            command.run(args)
    except KNOWN_ERRORS as e:
        message = " ".join(str(e).split())  # one line, whatever the library put in it
        print(f"allhere {args.command}: error: {message}", file=sys.stderr)
        return 2
    except (Interrupted, KeyboardInterrupt) as e:  # KeyboardInterrupt: Ctrl-C outside a training loop
        stopped = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        env = detect()
        if env is None or env.main:  # under torchrun: one line, from rank 0
            hint = f"; {command.resume}" if command.resume else ""
            print(f"allhere {args.command}: {stopped}{hint}", file=sys.stderr)
        return stopped.exit_code
    return 0
