"""Config family: formats, strict validation with useful errors, migrations."""

from __future__ import annotations

import json

import msgspec
import pytest
from plyx.specs import (
    ConfigBase,
    ConfigError,
    KernelConfig,
    ModelConfig,
    ServeConfig,
    TrainConfig,
    dump_config,
    load_config,
)
from plyx.specs.config import migrations_for

ALL = [ModelConfig, TrainConfig, ServeConfig, KernelConfig]


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("suffix", [".json", ".toml", ".yaml"])
def test_round_trip_every_format(cls, suffix, tmp_path):
    config = cls()
    if cls is ModelConfig:
        config = ModelConfig(d_model=384, n_heads=6, n_kv_heads=2, arch="qwen3", qk_norm=True, head_dim=64)
    if cls is KernelConfig:
        config = KernelConfig(overrides={"rmsnorm": "reference"}, disabled=["triton"])
    path = dump_config(config, tmp_path / f"c{suffix}")
    assert load_config(cls, path) == config
    assert not list(tmp_path.glob(".*tmp*")), "atomic write left a temp file"


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({"n_layerz": 4})
    err = info.value
    assert err.path == "$.n_layerz"
    assert "n_layers" in err.fix
    assert isinstance(err, ValueError)


def test_nested_unknown_key_has_a_full_path():
    with pytest.raises(ConfigError, match=r"\$\.optimizer\.lrr.*did you mean `lr`"):
        TrainConfig.from_dict({"optimizer": {"lrr": 1e-3}})


def test_wrong_type_names_field_value_and_expected_type():
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({"d_model": "512"})
    assert info.value.path == "$.d_model"
    assert info.value.value == "512"
    assert "int" in str(info.value)


def test_out_of_range_value():
    with pytest.raises(ConfigError, match=r">= 1 - at `\$.n_layers`"):
        ModelConfig.from_dict({"n_layers": 0})


def test_n_heads_must_divide_d_model_and_the_fix_lists_divisors():
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({"d_model": 512, "n_heads": 6})
    assert info.value.path == "$.n_heads"
    assert info.value.value == 6
    assert "8" in info.value.fix and "head_dim" in info.value.fix


def test_explicit_head_dim_allows_non_dividing_heads():
    cfg = ModelConfig(d_model=1024, n_heads=16, head_dim=128)  # Qwen3-0.6B's shape
    assert cfg.dim_per_head == 128


def test_n_kv_heads_must_divide_n_heads_nested_path():
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"model": {"n_heads": 8, "n_kv_heads": 3}})
    assert info.value.path == "$.model.n_kv_heads"
    assert "1 for MQA" in info.value.fix


def test_direct_construction_validates_too():
    with pytest.raises(ConfigError, match="n_kv_heads"):
        ModelConfig(n_heads=8, n_kv_heads=5)


def test_cross_field_check_in_train_config():
    with pytest.raises(ConfigError, match=r"data.seq_len"):
        TrainConfig.from_dict({"data": {"seq_len": 4096}, "model": {"max_seq_len": 1024}})


def test_v1_model_document_is_migrated_on_load(tmp_path):
    assert 1 in migrations_for("model")
    v1 = {"version": 1, "n_embd": 256, "n_layer": 3, "n_head": 4, "block_size": 512, "ffn_mult": 4}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(v1))
    cfg = load_config(ModelConfig, path)
    assert (cfg.version, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.max_seq_len, cfg.d_ff) == (2, 256, 3, 4, 512, 1024)
    assert cfg.kv_heads == 4


def test_v1_model_inside_a_train_document_is_migrated():
    cfg = TrainConfig.from_dict({"model": {"version": 1, "n_embd": 128, "n_head": 2, "n_layer": 2}})
    assert (cfg.model.d_model, cfg.model.n_heads) == (128, 2)


def test_v1_names_without_a_version_fail_with_the_unknown_field():
    with pytest.raises(ConfigError, match="n_embd"):
        ModelConfig.from_dict({"n_embd": 128})


def test_newer_version_is_refused_with_upgrade_hint():
    with pytest.raises(ConfigError, match="upgrade plyx-specs"):
        ModelConfig.from_dict({"version": 99})


def test_malformed_file_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("d_model = = 3")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(ModelConfig, path)


def test_unknown_suffix_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="suffix"):
        dump_config(ModelConfig(), tmp_path / "model.ini")


def test_replace_revalidates():
    cfg = ModelConfig()
    assert cfg.replace(n_layers=2).n_layers == 2
    with pytest.raises(ConfigError, match="n_heads"):
        cfg.replace(n_heads=7)


def test_kernel_env_overrides_parse_and_reject_garbage():
    assert KernelConfig.parse_env("rmsnorm=reference, rope=triton") == {"rmsnorm": "reference", "rope": "triton"}
    with pytest.raises(ConfigError, match="PLYX_KERNELS"):
        KernelConfig.parse_env("rmsnorm")


def test_serve_config_cross_field():
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        ServeConfig(max_batch_size=64, max_batch_tokens=8)



class _Item(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    name: str = ""
    size: int = 1


class _Doc(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    SCHEMA = "doc"
    items: list[_Item] = []


def test_unknown_field_inside_a_list_of_structs_lists_the_known_fields():
    with pytest.raises(ConfigError) as info:
        _Doc.from_dict({"items": [{"name": "a"}, {"nmae": "b"}]})
    assert info.value.path == "$.items[1].nmae"
    assert "did you mean `name`" in info.value.fix


def test_moe_fields_round_trip_and_top_k_is_bounded_by_the_experts(tmp_path):
    doc = {"arch": "qwen2", "qkv_bias": True, "d_ff": 96,
           "moe": {"num_experts": 6, "top_k": 2, "shared_expert_d_ff": 64, "norm_topk_prob": False}}
    cfg = ModelConfig.from_dict(doc)
    assert cfg.d_expert == 96 and cfg.moe.aux_loss_coef == 0.01 and cfg.moe.z_loss_coef == 0.0
    assert ModelConfig(d_ff=96).d_expert == 96 and ModelConfig.from_dict({"moe": {"d_expert": 32}}).d_expert == 32
    path = tmp_path / "moe.toml"
    dump_config(cfg, path)
    assert load_config(ModelConfig, path) == cfg
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"model": {"moe": {"num_experts": 4, "top_k": 5}}})
    assert info.value.path == "$.model.moe.top_k" and "at most 4 experts" in info.value.fix
    with pytest.raises(ConfigError, match=r"unknown field - at .\$.moe.num_expert.; did you mean .num_experts."):
        ModelConfig.from_dict({"moe": {"num_expert": 4}})
    with pytest.raises(ConfigError, match="qk_norm_scope"):
        ModelConfig.from_dict({"qk_norm_scope": "layer"})
