"""allhere in vLLM: ``plugin`` (the ``vllm.general_plugins`` entry point, which registers the model classes) and
what it loads into vLLM's processes: ``model`` (vLLM's model of each family with the converted layers' attention
replaced), ``install`` (each kind's installer, as its registered Serving says), ``layers`` (AHA's and the masked
patterns' rule and weights on a served block), ``blocks`` (a block's ``Attention`` rebuilt, an argument of its call
found), ``attention`` (the custom op over a layer's paged cache, on ``allhere.ops.paged``), ``sink_cache`` (the
sinks' KV cache group), ``dar`` and ``dar_latent`` (their window and latent caches), ``metrics`` (allhere's gauges on
vLLM's /metrics); ``check`` runs greedy generation through vLLM for comparison. vLLM is an optional dependency: only
``plugin`` and ``metrics`` load without it (``allhere serve``'s launcher reads their names), and ``import allhere``
loads nothing here.
"""
