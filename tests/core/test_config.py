import pytest

from allhere import (
    AHAConfig,
    ConfigError,
    FullConfig,
    ModelConfig,
    SlidingConfig,
    TrainConfig,
)
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
    cfg = ModelConfig(n_layers=3,
                      layer_mechanisms=(FullConfig(), SlidingConfig(window=8), AHAConfig(window=4, lam=1e-3)))
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


@pytest.mark.parametrize("field,value", [("context_parallel", 0), ("context_parallel", 1.5), ("layout", "diagonal"),
                                         ("data_parallel", 0)])
def test_parallel_config_refuses_bad_values_naming_the_field(field, value):
    from allhere.distributed import ParallelConfig

    with pytest.raises(ConfigError, match=rf"ParallelConfig\.{field} = "):
        ParallelConfig(**{field: value})


def test_parallel_config_mesh_against_the_run():
    """The dp x cp mesh on a number of processes: cp divides them, dp (when given) is the rest, the replicas
    share a step's micro-batches evenly, a sequence cuts into the layout's chunks."""
    from allhere.distributed import ParallelConfig

    assert ParallelConfig().mesh(4, grad_accum=8) == (4, 1)
    assert ParallelConfig(context_parallel=2, layout="zigzag").mesh(8, grad_accum=4, seq_len=64) == (4, 2)
    assert ParallelConfig(context_parallel=2, data_parallel=2).mesh(4) == (2, 2)
    for cfg, world, kwargs, match in [
        (ParallelConfig(context_parallel=3), 4, {}, "context parallel 3 needs a multiple of 3 processes"),
        (ParallelConfig(context_parallel=2, data_parallel=3), 4, {}, "data parallel 3 x context parallel 2 needs 6"),
        (ParallelConfig(context_parallel=2), 8, {"grad_accum": 6}, "grad_accum .* = 6 .* 4 data-parallel replicas"),
        (ParallelConfig(context_parallel=2), 2, {"seq_len": 30}, "seq_len = 30 must be a multiple of 4"),
        (ParallelConfig(context_parallel=2, layout="contiguous"), 2, {"seq_len": 31}, "multiple of 2"),
    ]:
        with pytest.raises(ConfigError, match=match):
            cfg.mesh(world, **kwargs)
