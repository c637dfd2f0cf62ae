"""Experiments: the only layer that knows about tasks, presets and run directories.

Each job writes its report as markdown and json; those that train resume from their run directory:

  - ``rundir``: claim a run directory for one set of settings; atomic json / text files;
  - ``report``: the one report writer (``<name>.md`` + ``<name>.json``) and shared formatting;
  - ``plans``: the presets (``TaskPlan``: model, mechanism, pretraining, fine-tuning);
  - ``tasks``: a task's data and evaluations, pretraining and fine-tuning in a run directory;
  - ``demo`` (``allhere demo``), ``dar_demo`` (``allhere demo --mechanism dar``), ``sweep``
    (``allhere sweep``), ``analyze`` (``allhere analyze``), ``bench`` (``allhere bench``);
  - ``sparse_patterns`` (``allhere patterns``), with its pieces ``sparse_family`` (the patterns compared),
    ``sparse_graph`` (receptive field and hops over the masks) and ``sparse_plot`` (its figures);
  - ``gates``, ``timing``: gate patterns and timers of the benchmarks (also used by ``benchmarks/``).

The library never imports it: only the command line (``allhere.cli``) and the scripts in ``benchmarks/`` do.
"""
