"""What a long command needs around the model while it runs: its checkpoints (``model_checkpoint``: one
safetensors file, written atomically), a model folder written whole or not at all (``atomic_folder``), one writer
per run folder (``runlock``), a clean stop on Ctrl-C or SIGTERM (``interrupt``), progress shown as it goes
(``progress``), a training run's TensorBoard events (``reporting``) and the cache of known pretrained models that
``allhere fetch`` fills (``models_cache``).

Nothing is imported here: each module is imported where it is used, so that ``import allhere.runtime.progress``
loads that module alone and ``import allhere`` loads none of them.
"""
