import json

import pytest

from spike_whale import PRESETS, LoopPlan, SpikeWhaleConfig


def test_seed_defaults_kept_and_checkpoint_ids_corrected():
    cfg = SpikeWhaleConfig()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.o_lora_rank) == (1024, 16, 512, 341)
    assert cfg.use_memory_cache is False and cfg.tie_word_embeddings is False
    assert cfg.moe_layers == list(range(16)) and cfg.engram_fusion_layers == []
    assert cfg.nope_head_dim == 32
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (2, 3, 0)


def test_presets_match_blueprint():
    base = SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc")
    assert (base.hidden_size, base.num_hidden_layers, base.num_attention_heads, base.num_key_value_heads) == (768, 16, 12, 2)
    assert (base.head_dim, base.qk_rope_head_dim, base.nope_head_dim) == (64, 16, 48)
    assert base.max_position_embeddings == 1024 and base.tie_word_embeddings and base.use_memory_cache
    assert base.num_loop_slots == 48
    assert SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc-sft").max_position_embeddings == 4096
    twin = SpikeWhaleConfig.from_preset("byrne-100m-nomc-stdrope")
    assert not twin.use_memory_cache and not twin.use_fractal_rope
    assert SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc", max_position_embeddings=2048).max_position_embeddings == 2048
    with pytest.raises(ValueError, match="Unknown SpikeWhale preset"):
        SpikeWhaleConfig.from_preset("byrne-1t")


def test_released_config_json_loads(tmp_path):
    """A released config.json (with `architectures` and the derived nope_head_dim) loads as-is."""
    blob = dict(PRESETS["byrne-100m-ultra-mc"], architectures=["SpikeWhaleLM"], nope_head_dim=48, model_type="spike_whale")
    cfg = SpikeWhaleConfig(**blob)
    assert cfg.hidden_size == 768
    cfg.save_pretrained(tmp_path)
    again = SpikeWhaleConfig.from_pretrained(tmp_path)
    assert again.to_dict()["mc_segment_len"] == 256 and again.tie_word_embeddings is True
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "spike_whale"


def test_loop_plan_full_and_middle_split():
    cfg = SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc")
    plan = cfg.loop_plan
    assert len(plan) == 48 and plan.entries[:2] == ((0, 0), (1, 0)) and plan.entries[16] == (0, 1)
    assert [i for i, s in enumerate(plan.pass_starts) if s] == [0, 16, 32]
    split = SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc", loop_mode="middle_split", loop_middle_layers=8)
    p = LoopPlan.from_config(split)
    assert len(p) == 4 + 8 * 3 + 4
    assert [layer for layer, _ in p.entries[:4]] == [0, 1, 2, 3]
    assert [e for e, s in zip(p.entries, p.pass_starts) if s] == [(4, 0), (4, 1), (4, 2)]
    assert [layer for layer, _ in p.entries[-4:]] == [12, 13, 14, 15]
    assert SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc", loop_count=1).num_loop_slots == 16


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hrm_gate_init=0.0), "hrm_gate_init"),
        (dict(num_attention_heads=12, num_key_value_heads=5), "num_key_value_heads"),
        (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
        (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
        (dict(loop_mode="middle_split", loop_middle_layers=5), "loop_middle_layers"),
        (dict(use_engram=False, engram_fusion_layers=[2]), "engram_fusion_layers"),
        (dict(engram_fusion_layers=[16]), "engram_fusion_layers"),
        (dict(moe_layers=[-1]), "moe_layers"),
        (dict(loop_count=0), "loop_count"),
        (dict(loop_mode="spiral"), "loop_mode"),
        (dict(fractal_rope_gamma=1.5), "fractal_rope_gamma"),
        (dict(eos_token_id=99999), "eos_token_id"),
        (dict(hidden_size=0), "hidden_size"),
    ],
)
def test_contradictory_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc", **overrides)


def test_fields_are_typed_declarations_with_the_seed_defaults():
    """Fields are declared like transformers' in-library configs (typed class attributes with defaults), one per
    seed field, and the config is a dataclass on transformers releases whose configs are."""
    import dataclasses

    import transformers

    hints = vars(SpikeWhaleConfig)["__annotations__"]
    seed_defaults = {"vocab_size": 16512, "hidden_size": 1024, "o_lora_rank": 341, "use_moe": True, "moe_layers": None,
                     "engram_fusion_layers": None, "loop_middle_layers": None, "use_memory_cache": False,
                     "mc_gate_dim": 64, "hrm_gate_init": 1.0, "use_cache": True}
    for name, default in seed_defaults.items():
        assert name in hints and getattr(SpikeWhaleConfig, name) == default, name
    assert (hints["hidden_size"], hints["rope_theta"], hints["use_xsa"]) == ("int", "float", "bool")
    if dataclasses.is_dataclass(transformers.PretrainedConfig):
        names = {f.name for f in dataclasses.fields(SpikeWhaleConfig)}
        assert {"hidden_size", "mc_segment_len", "use_cache", "engram_fusion_dim"} <= names
    assert not hasattr(SpikeWhaleConfig, "num_mc_segments")  # read by nothing


def test_presets_are_differences_from_the_base_preset():
    from spike_whale.configuration_spike_whale import _PRESET_BYRNE_100M

    base = SpikeWhaleConfig()
    assert all(getattr(base, k) != v for k, v in _PRESET_BYRNE_100M.items())
    for name, preset in PRESETS.items():
        extra = {k: v for k, v in preset.items() if k not in _PRESET_BYRNE_100M or _PRESET_BYRNE_100M[k] != v}
        assert all(getattr(base, k) != v or k in _PRESET_BYRNE_100M for k, v in extra.items()), name
    assert SpikeWhaleConfig.from_preset("byrne-15m-looped").moe_layers == list(range(10))


def test_validation_runs_in_one_place_on_every_route(tmp_path):
    with pytest.raises(ValueError, match="multiple of"):
        SpikeWhaleConfig(num_attention_heads=12, num_key_value_heads=5)
    cfg = SpikeWhaleConfig.from_preset("tiny")
    cfg.num_key_value_heads = 3
    with pytest.raises(ValueError, match="multiple of"):
        cfg.validate_architecture()
    bad = dict(SpikeWhaleConfig.from_preset("tiny").to_dict(), loop_mode="sideways")
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="loop_mode"):
        SpikeWhaleConfig.from_pretrained(tmp_path)
