"""Offline corpora and tasks: the Python standard library as text, the user's own text, a recall task."""
