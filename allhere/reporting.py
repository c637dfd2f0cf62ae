"""The old path of ``allhere.runtime.reporting``: its names still import from here, with a ``DeprecationWarning``
naming the new path."""

from ._deprecated import moved_names

__getattr__ = moved_names(__name__, {name: ("allhere.runtime.reporting", name) for name in (
    "EVENTS_PREFIX", "INSTALL", "NoReport", "REPORT_TO", "Reporting", "TensorBoardReport", "check_report_to",
    "default_report_to", "events_dir", "open_report", "report_to", "say_on_stderr", "stale_events",
    "tensorboard_installed")})
