"""``allhere generate``: try a model -- continue a prompt, or chat over stdin -- with the text streamed to
stdout as it comes and the speed (and, for AHA, mu_f) on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..runtime.interrupt import Interrupted
from ..validation import ConfigError
from . import args as a

MU_F_HELP = ("For a model that routes (AHA), stderr also shows mu_f: the share of (layer, head) gates on full "
             "attention over the decode steps, i.e. each generated token as it is fed back (all but the last; "
             "the prompt is not counted).")


def generate_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = MU_F_HELP
    p.add_argument("--model", type=a.checkpoint_or_model, required=True,
                   help="an allhere checkpoint (.safetensors, byte-level), a transformers causal LM folder (plain, "
                        f"or saved by allhere convert / sft), {a.GGUF_HELP} (required)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", type=a.text, help="the text to continue; this or --chat")
    what.add_argument("--chat", action="store_true",
                      help="a conversation: one user turn per line of stdin, rendered with the tokenizer's chat "
                           "template (allhere's fallback template when it has none), each reply streamed and kept "
                           "in the conversation; this or --prompt")
    p.add_argument("--max-new-tokens", type=a.positive, default=256,
                   help="stop after this many new tokens, or at an end-of-sequence token (default 256)")
    p.add_argument("--temperature", type=a.nonnegative, default=0.0,
                   help="0 (default): greedy; > 0: sample from softmax(logits / temperature)")
    p.add_argument("--top-p", type=a.fraction, default=None,
                   help="sample only from the most likely tokens whose probabilities reach p, 0 < p < 1 "
                        "(default: the whole distribution; needs --temperature > 0)")
    p.add_argument("--seed", type=a.positive_or_zero, default=None,
                   help="seed for sampling (default: none, every run differs; needs --temperature > 0)")
    p.add_argument("--static-cache", action="store_true",
                   help="decode over transformers' StaticCache (a transformers model folder, plain or AHA); on a GPU "
                        "transformers then compiles the decode step (torch.compile, CUDA graphs), paying the "
                        "compilation on the first call (default: allhere's in-place cache, eager)")
    a.device_flag(p)


def _report(reply) -> None:
    s = reply.stats
    line = f"[{s.new_tokens} tokens in {s.seconds:.2f} s, {s.tokens_per_s:.1f} tokens/s"
    if s.routed:
        line += (f"; mu_f {100 * s.mu_f:.1f}% over {s.decode_steps} decode steps" if s.mu_f is not None
                 else "; mu_f: no decode step")
    print(line + "]", file=sys.stderr, flush=True)


def _turns():
    """stdin, one line at a time (a prompt on stderr when a person types)."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line


def generate(args) -> None:
    import torch

    from ..data.chat import ensure_chat_template
    from ..generation import chat, load
    from ..generation import generate as generate_text

    if args.temperature == 0 and (args.top_p is not None or args.seed is not None):
        raise ConfigError("--top-p and --seed are sampling settings: give --temperature > 0 too")
    if args.chat and Path(args.model).suffix == ".safetensors" and not Path(args.model).is_dir():
        raise ConfigError("--chat needs a chat template, and an allhere checkpoint is a byte-level model without "
                          "one: use --prompt")
    model, tokenizer = load(args.model, args.device)
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    static_cache=args.static_cache)
    if args.seed is not None:
        torch.manual_seed(args.seed)

    def emit(piece: str) -> None:
        print(piece, end="", flush=True)

    try:
        if args.prompt is not None:
            reply = generate_text(model, tokenizer, tokenizer.encode(args.prompt), emit=emit, **settings)
            print()
            _report(reply)
            return
        if ensure_chat_template(tokenizer):
            print(f"{args.model}: the tokenizer has no chat template; using allhere's fallback (one "
                  "'<|role|>' line per turn, EOS after each), as allhere sft does", file=sys.stderr)
        for reply in chat(model, tokenizer, _turns(), emit=emit, **settings):
            print()
            _report(reply)
    except (KeyboardInterrupt, Interrupted):  # the reply so far stays on its line; main says how it ended (130)
        print()
        raise
