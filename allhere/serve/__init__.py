"""Serving converted models with other engines: ``serving`` (which kinds are served, and how: each kind's
registered ``Serving``), ``launch`` (``allhere serve``: vLLM's OpenAI-compatible server with allhere's plugin) and
``server_process`` (the server's process); the vLLM glue in ``allhere.serve.vllm``. What a served layer computes
over its paged cache is an op, ``allhere.ops.paged``. Nothing here is imported by ``import allhere``: vLLM is an
optional dependency.
"""
