"""What the hosts of a mechanism (transformers in ``allhere.hf``, vLLM in ``allhere.serve``) agree on about a
converted model: where the mechanism lives inside an attention module, and the entries of its config.json."""

SUBMODULE = "allhere"  # the mechanism's name inside the host's attention module
CONFIG_KEY = "allhere_mechanism"  # config.json entry holding the mechanism's settings
LAYERS_KEY = "allhere_layers"  # config.json entry: the indices of the converted layers
