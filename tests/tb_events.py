"""TensorBoard event files read back with TensorBoard's own reader, as TensorBoard shows them."""

import pytest


def events(folder):
    """Every scalar and image of the run whose events are in ``folder`` (skipped without tensorboard)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    return accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0}).Reload()


def scalars(acc, tag):
    """(step, value) of every point of ``tag``."""
    return [(e.step, e.value) for e in acc.Scalars(tag)]
