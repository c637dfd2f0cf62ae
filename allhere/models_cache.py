"""The old path of ``allhere.runtime.models_cache``: its names still import from here, with a ``DeprecationWarning``
naming the new path."""

from ._deprecated import moved_names

__getattr__ = moved_names(__name__, {name: ("allhere.runtime.models_cache", name) for name in (
    "CHUNK", "KNOWN", "KnownModel", "cache_dir", "fetch", "known", "known_file", "model_path")})
