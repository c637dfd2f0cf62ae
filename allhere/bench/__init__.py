"""Benchmarks shipped with the package (``allhere bench``) and the gate patterns they use."""
