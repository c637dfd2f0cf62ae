"""allhere's recipes: the jobs the ``allhere`` command runs on top of the library, apart from it.

The library (``allhere``) never imports this package; only the command line (``allhere.cli``), the
scripts in ``benchmarks/`` and ``scripts/`` and the tests do. Each job writes its report as markdown and
json; those that train resume from their run directory:

  - ``rundir``: claim a run directory for one set of settings; atomic json / text files;
  - ``report``: the one report writer (``<name>.md`` + ``<name>.json``) and shared formatting;
  - ``plans``: the presets (``TaskPlan``: model, mechanism, pretraining, fine-tuning);
  - ``tasks``: a task's data and evaluations, pretraining and fine-tuning in a run directory;
  - ``bases``: the pretrained bases shipped in ``bases/`` that the demo starts from, checked on load;
  - ``job``: the training runs of a whole job and its time left;
  - ``demo`` (``allhere demo``), ``dar_demo`` (``allhere demo --mechanism dar``), ``sweep``
    (``allhere sweep``), ``analyze`` (``allhere analyze``), ``compare`` (``allhere compare``) with its
    figure ``compare_plot``;
  - ``sparse_patterns`` (``allhere patterns``), with its pieces ``sparse_family`` (the patterns compared),
    ``sparse_graph`` (receptive field and hops over the masks) and ``sparse_plot`` (its figures);
  - ``aamoe`` (``allhere aamoe``) with ``aamoe_grid``, ``aamoe_render`` and ``aamoe_plots``;
  - ``ops_bench`` (``allhere bench``) with ``bench_profile``, ``model_bench``, ``llama_bench`` and
    ``generate_bench``, and the benchmark helpers ``gates`` (gate patterns, FLOP and byte limits) and
    ``timing`` (timers), which the scripts in ``benchmarks/`` use too;
  - ``cost`` and ``model_cost``: the context-parallel cost models of ``benchmarks/ring_scale.py`` and
    ``benchmarks/scale_model.py`` (counted, nothing run).
"""
