"""Serving converted models with other engines.

``allhere.serve.vllm_plugin``: a vLLM general plugin (entry point group ``vllm.general_plugins``) that lets
vLLM load a folder written by ``allhere convert`` (its config.json carries ``allhere_mechanism``) with no
user code; ``allhere.serve.vllm_model`` holds the model classes it registers. Nothing here is imported by
``import allhere``: vLLM is an optional dependency.
"""
