"""vLLM general plugin: serve folders written by ``allhere convert`` with no user code.

vLLM calls ``register`` in every process it starts (entry point group ``vllm.general_plugins``; the
project's packaging declares ``allhere = "allhere.serve.vllm_plugin:register"``). It registers allhere's
classes under the architecture names a converted folder already carries (config.json ``architectures``,
e.g. ``LlamaForCausalLM``), so the folder needs no other name and still loads in transformers and in
``allhere.hf.load_pretrained``. Those classes are vLLM's own model for a folder without allhere settings,
so plain models served next to converted ones are unchanged.

``register`` imports nothing heavy: vLLM imports the classes lazily (``"module:Class"``).
"""

from __future__ import annotations

MODELS = {  # architecture name in config.json -> allhere's class (a subclass of vLLM's own)
    "LlamaForCausalLM": "AllhereLlamaForCausalLM",
    "MistralForCausalLM": "AllhereMistralForCausalLM",
    "Qwen2ForCausalLM": "AllhereQwen2ForCausalLM",
}


def register() -> None:
    """Idempotent (vLLM may call it several times per process)."""
    from vllm import ModelRegistry

    for arch, cls in MODELS.items():
        ModelRegistry.register_model(arch, f"allhere.serve.vllm_model:{cls}")
