"""Strategies the model or the world cannot honour fail before any work, naming field, value and fix."""

from __future__ import annotations

import pytest
from plyx.dist import plan
from plyx.specs import ConfigError, DistConfig, ModelConfig, TrainConfig


def _config(dist: dict, **model: object) -> TrainConfig:
    base = {"vocab_size": 320, "d_model": 48, "n_layers": 2, "n_heads": 6, "n_kv_heads": 2, "d_ff": 96,
            "tie_embeddings": False, **model}
    return TrainConfig(model=ModelConfig.from_dict(base), device="cpu", dist=DistConfig(**dist))


def test_valid_plans_give_their_mesh():
    p = plan(_config({"strategy": "fsdp+tp", "tp_size": 2}), 4, 4, cuda=False)
    assert (p.mesh_shape, p.mesh_names, p.dp, p.tp, p.backend) == ((2, 2), ("dp", "tp"), 2, 2, "gloo")
    p = plan(_config({"strategy": "hsdp", "dp_shard": 2}), 8, 8, cuda=False)
    assert (p.mesh_shape, p.mesh_names, p.dp) == ((4, 2), ("dp_replicate", "dp_shard"), 8)
    assert plan(_config({"strategy": "ddp"}), 3, 3, cuda=False).mesh_shape == (3,)
    assert plan(_config({}), 2, 2, cuda=True).backend == "gloo"  # device = cpu: gloo even with CUDA


@pytest.mark.parametrize(("dist", "model", "world", "path", "words"), [
    ({"strategy": "fsdp+tp", "tp_size": 4}, {}, 6, "$.dist.tp_size", "does not divide the world size 6"),
    ({"strategy": "fsdp+tp", "tp_size": 4}, {}, 8, "$.dist.tp_size", "model.n_heads = 6"),
    ({"strategy": "fsdp+tp", "tp_size": 3}, {}, 6, "$.dist.tp_size", "model.n_kv_heads = 2"),
    ({"strategy": "fsdp+tp", "tp_size": 2}, {"tie_embeddings": True}, 4, "$.dist.tp_size", "tied"),
    ({"strategy": "hsdp", "dp_shard": 3}, {}, 4, "$.dist.dp_shard", "must divide the world size 4"),
    ({"strategy": "hsdp", "dp_shard": 2, "dp_replicate": 3}, {}, 4, "$.dist.dp_replicate", "3 x 2"),
    ({"strategy": "fsdp", "dp_shard": 3}, {}, 4, "$.dist.dp_shard", "fsdp shards over all 4 ranks"),
    ({"strategy": "fsdp+tp", "tp_size": 2}, {"moe": {"num_experts": 4, "top_k": 2}}, 4, "$.dist.strategy",
     "mixtures of experts"),
    ({"strategy": "ddp", "backend": "nccl"}, {}, 2, "$.dist.backend", "needs CUDA"),
])
def test_impossible_plans_are_refused_with_field_value_and_fix(dist, model, world, path, words):
    with pytest.raises(ConfigError) as info:
        plan(_config(dist, **model), world, world, cuda=False)
    err = info.value
    assert err.path == path and words in str(err), str(err)
    assert err.fix, "the error must say how to fix it"


@pytest.mark.parametrize(("dist", "path"), [
    ({"strategy": "ddp", "tp_size": 2}, "$.dist.tp_size"),
    ({"strategy": "fsdp+tp", "tp_size": 1}, "$.dist.tp_size"),
    ({"strategy": "fsdp", "dp_replicate": 2}, "$.dist.dp_replicate"),
    ({"strategy": "ddp", "param_dtype": "bfloat16"}, "$.dist.param_dtype"),
    ({"strategy": "zero3"}, "$.dist.strategy"),
])
def test_the_dist_table_is_validated_on_load(dist, path):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"dist": dist})
    assert info.value.path == path, str(info.value)


def test_a_train_config_without_the_table_loads_with_its_defaults():
    config = TrainConfig.from_dict({"version": 1, "steps": 500})
    assert config.dist == DistConfig() and config.dist.version == DistConfig.VERSION
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_the_launch_without_a_strategy_plugin_is_refused(monkeypatch):
    """WORLD_SIZE=2 and no plugin answering the hook: a clear error, not a silent single-process run."""
    from plyx.train._distributed import resolve_strategy

    assert resolve_strategy(TrainConfig(), environ={}) is None  # no launcher: a plain run
    import plyx.train._distributed as mod

    class _Nobody:
        class hook:
            @staticmethod
            def plyx_train_strategy(**_: object) -> None:
                return None

    monkeypatch.setattr(mod, "get_plugin_manager", lambda: _Nobody)
    with pytest.raises(ConfigError, match="pip install plyx-dist"):
        resolve_strategy(TrainConfig(), environ={"WORLD_SIZE": "2", "RANK": "0"})
