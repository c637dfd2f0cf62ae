"""vLLM general plugin: serve folders written by ``allhere convert`` with no user code.

vLLM calls ``register`` in every process it starts (entry point group ``vllm.general_plugins``; the
project's packaging declares ``allhere = "allhere.serve.vllm.plugin:register"``). It registers allhere's
classes under the architecture names a converted folder already carries (config.json ``architectures``,
e.g. ``LlamaForCausalLM``), so the folder needs no other name and still loads in transformers and in
``allhere.hf.load_pretrained``. Those classes are vLLM's own model for a folder without allhere settings,
so plain models served next to converted ones are unchanged.

``register`` imports nothing heavy: vLLM imports the classes lazily (``"module:Class"``). Which mechanisms are
served, and how, each registers itself (``allhere.registry.Serving``, read through ``allhere.serve.serving``).
"""

from __future__ import annotations

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPU attention kernels
STATS_ENV = "ALLHERE_ROUTING_STATS"  # a file the model writes its routing statistics to (allhere serve)
RESET_SUFFIX = ".reset"  # while "<that file>.reset" exists, the next forward zeroes the counts first

TRANSFORMERS_BACKEND = "AllhereTransformersForCausalLM"  # the class of the families vLLM runs through transformers
MODELS = {  # architecture name in config.json -> allhere's class (a subclass of vLLM's own)
    "LlamaForCausalLM": "AllhereLlamaForCausalLM",
    "MistralForCausalLM": "AllhereMistralForCausalLM",
    "Qwen2ForCausalLM": "AllhereQwen2ForCausalLM",
    "Qwen3ForCausalLM": "AllhereQwen3ForCausalLM",
    "Gemma2ForCausalLM": "AllhereGemma2ForCausalLM",
    "Gemma3ForCausalLM": "AllhereGemma3ForCausalLM",
    "GptOssForCausalLM": "AllhereGptOssForCausalLM",
    "GraniteForCausalLM": "AllhereGraniteForCausalLM",
    "Phi3ForCausalLM": "AllherePhi3ForCausalLM",
    # through vLLM's Transformers backend (vLLM 0.32 has no class of its own for these)
    "Olmo2ForCausalLM": TRANSFORMERS_BACKEND,
    "Olmo3ForCausalLM": TRANSFORMERS_BACKEND,
    "SmolLM3ForCausalLM": TRANSFORMERS_BACKEND,
    "GPTNeoXForCausalLM": TRANSFORMERS_BACKEND,
}


def register() -> None:
    """Idempotent (vLLM may call it several times per process)."""
    from vllm import ModelRegistry

    for arch, cls in MODELS.items():
        ModelRegistry.register_model(arch, f"allhere.serve.vllm.model:{cls}")
