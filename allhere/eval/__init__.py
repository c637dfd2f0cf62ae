"""Held-out evaluation: language-model loss and the recall task, each with routing statistics."""

from .heldout import evaluate_lm
from .recall_accuracy import evaluate_recall

__all__ = ["evaluate_lm", "evaluate_recall"]
