import pytest

from allhere import AHAConfig, ConfigError, FullConfig, ModelConfig, SlidingConfig, TrainConfig
from allhere.registry import from_dict as mechanism_from_dict
from allhere.registry import to_dict as mechanism_to_dict

BAD = [
    (SlidingConfig, {"window": 0}, "window"),
    (SlidingConfig, {"window": 2.5}, "window"),
    (AHAConfig, {"window": 0}, "window"),
    (AHAConfig, {"window": True}, "window"),
    (AHAConfig, {"tau": 0.0}, "tau"),
    (AHAConfig, {"tau": 1.0}, "tau"),
    (AHAConfig, {"tau": -0.2}, "tau"),
    (AHAConfig, {"lam": -1e-4}, "lam"),
    (AHAConfig, {"router": "mlp"}, "router"),
    (AHAConfig, {"router_bias": 1}, "router_bias"),
    (AHAConfig, {"router_init": "ones"}, "router_init"),
    (AHAConfig, {"router_init_bias": -1.0}, "router_init_bias"),
    (ModelConfig, {"vocab_size": 1}, "vocab_size"),
    (ModelConfig, {"d_model": 0}, "d_model"),
    (ModelConfig, {"n_layers": 0}, "n_layers"),
    (ModelConfig, {"n_heads": 0}, "n_heads"),
    (ModelConfig, {"n_heads": 3}, "n_heads"),
    (ModelConfig, {"n_kv_heads": 3}, "n_kv_heads"),
    (ModelConfig, {"n_kv_heads": 0}, "n_kv_heads"),
    (ModelConfig, {"mlp_hidden": 0}, "mlp_hidden"),
    (ModelConfig, {"rope_theta": 0.0}, "rope_theta"),
    (ModelConfig, {"norm_eps": 0.0}, "norm_eps"),
    (ModelConfig, {"d_model": 24, "n_heads": 8}, "d_model"),
    (ModelConfig, {"mechanism": "full"}, "mechanism"),
    (ModelConfig, {"n_layers": 2, "layer_mechanisms": (FullConfig(),)}, "layer_mechanisms"),
]


@pytest.mark.parametrize("cls,kwargs,field", BAD, ids=[f"{c.__name__}-{f}-{list(k.values())[-1]!r}" for c, k, f in BAD])
def test_invalid_field_names_itself(cls, kwargs, field):
    with pytest.raises(ConfigError, match=rf"\.{field} = "):
        cls(**kwargs)


def test_model_config_round_trip_with_per_layer_mechanisms():
    cfg = ModelConfig(n_layers=3, layer_mechanisms=(FullConfig(), SlidingConfig(window=8), AHAConfig(window=4, lam=1e-3)))
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert again.layer_mechanism(2) == AHAConfig(window=4, lam=1e-3)


def test_mechanism_from_dict_rejects_unknown_kind_and_field():
    assert mechanism_from_dict(mechanism_to_dict(AHAConfig(window=7))) == AHAConfig(window=7)
    with pytest.raises(ConfigError, match="kind"):
        mechanism_from_dict({"kind": "ring"})
    with pytest.raises(ConfigError, match="wndow"):
        mechanism_from_dict({"kind": "sliding", "wndow": 3})
    with pytest.raises(ConfigError, match="window"):
        mechanism_from_dict({"kind": "sliding", "window": -3})


@pytest.mark.parametrize("field,value", [("lr", float("inf")), ("lr", float("nan")), ("lr", 0.0), ("lr", "1e-3"),
                                         ("clip", float("inf")), ("weight_decay", -0.1), ("lam", float("nan")),
                                         ("router_lr_mult", 0.0), ("warmup_ratio", 1.0), ("beta2", 1.0),
                                         ("steps", 0), ("batch_size", 1.5), ("seed", -1), ("device", "tpu"),
                                         ("target_mu_f", 0.0), ("target_mu_f", 1.0), ("lam_rate", 0.0),
                                         ("device", None)])
def test_train_config_refuses_bad_values_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"TrainConfig\.{field} = "):
        TrainConfig(**{field: value})
    assert TrainConfig(lam=None).lam is None and TrainConfig(clip=0).clip == 0
