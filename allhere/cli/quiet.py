"""Third-party output on the command line: load reports, advisory warnings and progress bars of
transformers, datasets and lm-eval hidden unless ``--verbose`` (their errors still reach the user, as
allhere's one-line errors or their own)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

ENV = {"TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "DATASETS_VERBOSITY": "error",
       "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
LOGGERS = ("transformers", "datasets", "huggingface_hub", "lm_eval", "lm-eval")


@contextlib.contextmanager
def _libraries_already_imported():
    """Libraries imported before (in the same process) read the environment no more: tell them directly."""
    undo = []
    if "transformers" in sys.modules:
        from transformers.utils import logging as tf

        level, bars = tf.get_verbosity(), tf.is_progress_bar_enabled()
        tf.set_verbosity_error()
        tf.disable_progress_bar()
        undo.append(lambda: (tf.set_verbosity(level), tf.enable_progress_bar() if bars else None))
    if "datasets" in sys.modules:
        from datasets.utils import logging as ds

        level, bars = ds.get_verbosity(), ds.is_progress_bar_enabled()
        ds.set_verbosity_error()
        ds.disable_progress_bar()
        undo.append(lambda: (ds.set_verbosity(level), ds.enable_progress_bar() if bars else None))
    try:
        yield
    finally:
        for fn in undo:
            fn()


@contextlib.contextmanager
def quiet_third_party(verbose: bool):
    """Within: third-party chatter hidden unless ``verbose``; everything restored afterwards."""
    if verbose:
        yield
        return
    saved_env = {k: os.environ.get(k) for k in ENV}
    loggers = [logging.getLogger(n) for n in LOGGERS]
    saved_levels = [lg.level for lg in loggers]
    os.environ.update(ENV)  # read by the libraries when they are first imported
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), _libraries_already_imported():
            warnings.filterwarnings("ignore", module=r"(transformers|datasets|huggingface_hub|lm_eval)(\.|$)")
            yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for lg, level in zip(loggers, saved_levels):
            lg.setLevel(level)
