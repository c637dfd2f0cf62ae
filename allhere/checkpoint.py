"""The old path of ``allhere.runtime.model_checkpoint``: its names still import from here, with a
``DeprecationWarning`` naming the new path."""

from ._deprecated import moved_names

__getattr__ = moved_names(__name__, {name: ("allhere.runtime.model_checkpoint", name) for name in (
    "CheckpointError", "atomic_write", "load_model", "read_checkpoint", "restore_model", "restore_optimizer",
    "save_checkpoint")})
