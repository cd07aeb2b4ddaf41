import json
import os
import re

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


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps", "a finite number > 0"),
        (dict(rms_norm_eps=-1), "rms_norm_eps", "a finite number > 0"),
        (dict(rope_theta=float("inf")), "rope_theta", "a finite number > 1"),
        (dict(num_hidden_layers=True), "num_hidden_layers", "an integer >= 1"),
        (dict(hidden_size=64.0), "hidden_size", "an integer >= 1"),
        (dict(attention_dropout=-0.1), "attention_dropout", "a finite number in [0, 1)"),
        (dict(loop_mode="middle_split", loop_middle_layers=True), "loop_middle_layers", "an integer >= 1"),
        (dict(mc_segment_len=0), "mc_segment_len", "an integer >= 1"),
        (dict(use_abstain_head=True, abstain_threshold=1.0), "abstain_threshold", "a finite number in (0, 1)"),
        (dict(eos_token_id=[3, True]), "eos_token_id", "an integer in [0, 16512)"),
    ],
)
def test_numeric_fields_out_of_range_raise_one_line_naming_field_value_and_range(overrides, field, allowed):
    """A NaN or negative rms_norm_eps built a model whose every logit was NaN; a bool layer count was taken for 1."""
    with pytest.raises(ValueError) as err:
        SpikeWhaleConfig.from_preset("tiny", **overrides)
    message = str(err.value)
    assert f"`{field}`" in message and allowed in message and repr(overrides[field]) in message, message
    assert "\n" not in message and "moe_layers" not in message


def test_every_numeric_field_has_a_range_that_refuses_nan_and_bools():
    from spike_whale.configuration_spike_whale import _NUMERIC_FIELDS, _declared_fields

    def numeric(name):
        default, hint = getattr(SpikeWhaleConfig, name), vars(SpikeWhaleConfig)["__annotations__"][name]
        optional_number = hint in ("int | None", "float | None")
        return not isinstance(default, bool) and (isinstance(default, (int, float)) or optional_number)

    token_ids = {"bos_token_id", "eos_token_id", "pad_token_id"}
    assert {n for n in _declared_fields(SpikeWhaleConfig) if numeric(n)} - token_ids == set(_NUMERIC_FIELDS)
    # Every mechanism on, so that no field's check is skipped.
    on = dict(use_moe=True, use_elo=True, use_abstain_head=True, engram_fusion_layers=[1])
    base = SpikeWhaleConfig.from_preset("tiny", **on)
    assert all(switch is None or getattr(base, switch) for _, switch in _NUMERIC_FIELDS.values())
    for name, (allowed, _) in _NUMERIC_FIELDS.items():
        for bad in (True, "1") + (() if allowed.integer else (float("nan"), float("inf"))):
            with pytest.raises(ValueError, match=f"`{name}` must be {re.escape(str(allowed))}, got"):
                SpikeWhaleConfig.from_preset("tiny", **on, **{name: bad})


def test_bool_layer_count_in_a_config_json_names_the_field(tmp_path):
    blob = dict(SpikeWhaleConfig.from_preset("tiny").to_dict(), num_hidden_layers=True)
    (tmp_path / "config.json").write_text(json.dumps(blob))
    with pytest.raises(ValueError, match="`num_hidden_layers` must be an integer >= 1, got True"):
        SpikeWhaleConfig.from_pretrained(tmp_path)


def test_committed_model_and_every_preset_validate():
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "spike-whale-demo")
    assert SpikeWhaleConfig.from_pretrained(folder).hidden_size == 256
    for name in PRESETS:
        SpikeWhaleConfig.from_preset(name).validate_architecture()


def test_base_model_tp_plan_takes_the_assignment_transformers_post_init_makes():
    """transformers 5.15-5.20's `__post_init__` adds a tied-embedding rule by assignment (the plan had no setter, so
    every tied config failed to build there); the added rule stays, the plan still follows the fields, and it is
    never saved."""
    cfg = SpikeWhaleConfig.from_preset("tiny")
    computed = cfg.base_model_tp_plan
    cfg.base_model_tp_plan = {**cfg.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    assert cfg.base_model_tp_plan == {**computed, "embed_tokens": "embedding_rowwise"}
    cfg.use_hrm_refine = False
    plan = cfg.base_model_tp_plan
    assert "hrm_refine.down" not in plan and plan["embed_tokens"] == "embedding_rowwise"
    assert "base_model_tp_plan" not in cfg.to_dict()


@pytest.mark.parametrize(
    "value, expected",
    [
        ("[1,2]", "--config: [1,2] is a JSON array, not a JSON object (nor a file)"),
        ("42", "--config: 42 is a JSON number, not a JSON object (nor a file)"),
        ("missing.json", "--config: no such file: missing.json (nor is it an inline JSON object)"),
    ],
)
@pytest.mark.parametrize("command, src", [("convert", "model.pt"), ("from-gguf", "model.gguf")])
def test_convert_config_neither_file_nor_object_says_which(command, src, value, expected, tmp_path, monkeypatch,
                                                           capsys):
    from spike_whale.hub_export.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([command, src, "out", "--config", value]) == 1
    assert capsys.readouterr().err.strip() == f"spike-whale {command}: error: {expected}"
    assert not (tmp_path / "out").exists()
