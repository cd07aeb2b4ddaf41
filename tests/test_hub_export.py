"""hub_export: released checkpoints (.pt, safetensors folder, GGUF) -> Hub folders, GGUF, widening, push.

The released weights are not reachable offline, so each released layout is fabricated from a random tiny model with
its zero-init gates opened (every mechanism changes the output). Every converted folder is loaded back in a fresh
process through AutoModelForCausalLM / AutoTokenizer (trust_remote_code) and compared with the original model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_fresh_python, tiny_model
from spike_whale.hub_export import conversion as conversion_mod
from spike_whale.hub_export import push as push_mod
from spike_whale.hub_export.checkpoint import rope_caches
from spike_whale.hub_export.sources import load_checkpoint
from spike_whale.hub_export.cli import build_parser, main
from spike_whale.hub_export.folder import CODE_FILES, EXPORT_FILES, register_auto_classes
from spike_whale.hub_export.gguf_io import ROUND_TRIP_BOUNDS
from spike_whale.hub_export.serving import serving_generation_config
from spike_whale.modeling_spike_whale import rope_inv_freq
from spike_whale.hub_export.train_tokenizer import build_demo_tokenizer
from spike_whale.tokenization_spike import dump_vocab_data

TEXT = "The whale surfaced twice near the breakwater. <|im_start|>user\nÇa va? 港<|im_end|>"
GREEDY = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0, eos_token_id=3)
HF_ONLY = ("transformers_version", "architectures", "dtype", "auto_map", "_name_or_path")


# ---------------------------------------------------------------------------------------------------------------
# fabricated releases
# ---------------------------------------------------------------------------------------------------------------

def config_blob(model) -> dict:
    return {k: v for k, v in model.config.to_dict().items() if k not in HF_ONLY}


def cpu_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


@pytest.fixture(scope="module")
def release(tmp_path_factory, tok):
    """A released repo layout: checkpoints/base_62k.pt (+ config blob), tokenizer.json at the root, and
    safetensors/sft_7100/ (config.json with architectures, model.safetensors without lm_head.weight, tokenizer.json)."""
    root = tmp_path_factory.mktemp("release")
    base, sft = tiny_model(seed=0), tiny_model(seed=1)
    (root / "checkpoints").mkdir()
    torch.save({"model": base.state_dict(), "config": config_blob(base), "step": 62000,
                "train": {"lr": 3e-4, "batch_size": 64}}, root / "checkpoints" / "base_62k.pt")
    (root / "tokenizer.json").write_text(dump_vocab_data(tok.vocab_data), encoding="utf-8")
    folder = root / "safetensors" / "sft_7100"
    folder.mkdir(parents=True)
    cfg = config_blob(sft)
    cfg.update(architectures=["SpikeWhaleLM"], bos_token_id=0, eos_token_id=1)  # config.py's (wrong) defaults
    (folder / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    save_file({k: v.contiguous() for k, v in cpu_state(sft).items() if k != "lm_head.weight"},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(root / "tokenizer.json", folder / "tokenizer.json")
    (folder / "PROVENANCE.md").write_text("Same bits as checkpoints/sft_7100.pt\n", encoding="utf-8")
    return types.SimpleNamespace(root=root, pt=root / "checkpoints" / "base_62k.pt", st=folder, base=base, sft=sft)


@pytest.fixture(scope="module")
def converted_pt(release, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "byrne-base"
    assert main(["convert", str(release.pt), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def converted_st(release, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "byrne-sft"
    assert main(["convert", str(release.st), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def converted_gguf(gguf_files, tmp_path_factory):
    outs = {}
    for qtype, path in gguf_files.items():
        outs[qtype] = tmp_path_factory.mktemp("conv") / f"from-{qtype}"
        assert main(["from-gguf", str(path), str(outs[qtype])]) == 0
    return outs


@pytest.fixture(scope="module")
def fresh(converted_pt, converted_st, converted_gguf, release, tok, tmp_path_factory):
    """Each converted folder loaded in one fresh process through the Auto classes: name -> (state, outputs, info)."""
    folders = {"pt": converted_pt, "st": converted_st, **{f"gguf-{q}": p for q, p in converted_gguf.items()}}
    return fresh_load(folders, tmp_path_factory.mktemp("fresh"), tok(TEXT)["input_ids"])


@pytest.fixture(scope="module")
def gguf_files(release, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    files = {}
    for qtype in ("f16", "q8_0"):
        files[qtype] = d / f"Byrne-tiny-base_62k-{qtype}.gguf"
        assert main(["to-gguf", str(release.pt), str(files[qtype]), "--type", qtype]) == 0
    return files


FRESH_CHECK = r'''
import json, os, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
args = json.loads(__ARGS__)
for name, folder in args["folders"].items():
    out = os.path.join(args["out"], name)
    os.makedirs(out)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    ids = torch.tensor([args["ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=GenerationConfig(**args["greedy"]))
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, out + "/state.safetensors")
    torch.save({"logits": logits, "gen": gen}, out + "/out.pt")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    json.dump({"model_module": type(model).__module__, "tokenizer": type(tok).__module__ + "." + type(tok).__name__,
               "tied": model.lm_head.weight is model.model.embed_tokens.weight, "ids": tok(args["text"])["input_ids"],
               "decoded": tok.decode(tok(args["text"])["input_ids"], skip_special_tokens=False), "len": len(tok),
               "chat": chat, "max_pos": model.config.max_position_embeddings}, open(out + "/info.json", "w"))
'''


def fresh_load(folders: dict[str, Path], tmp_path: Path, ids: list[int]) -> dict[str, tuple[dict, dict, dict]]:
    """Load each folder in one fresh process via the Auto classes: name -> (state dict, outputs, info)."""
    out = tmp_path / "fresh"
    out.mkdir()
    args = {"folders": {k: str(v) for k, v in folders.items()}, "out": str(out), "ids": ids, "text": TEXT,
            "greedy": GREEDY}
    run_fresh_python(FRESH_CHECK.replace("__ARGS__", repr(json.dumps(args))), tmp_path)
    return {name: (load_file(str(out / name / "state.safetensors")),
                   torch.load(out / name / "out.pt", weights_only=True),
                   json.loads((out / name / "info.json").read_text())) for name in folders}


def reference(model, tokenizer) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    from transformers import GenerationConfig

    ids = tokenizer(TEXT)["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits
        gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(**GREEDY))
    return ids, logits, gen


def assert_bit_identical(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} of {len(want)} tensors differ: {bad[:5]}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# ---------------------------------------------------------------------------------------------------------------
# convert: each released layout
# ---------------------------------------------------------------------------------------------------------------

def test_convert_released_pt(release, converted_pt, fresh, tok):
    out = converted_pt
    assert sorted(p.name for p in out.iterdir()) == list(EXPORT_FILES)
    config = json.loads((out / "config.json").read_text())
    assert {"AutoConfig": "configuration_spike_whale.SpikeWhaleConfig",
            "AutoModelForCausalLM": "modeling_spike_whale.SpikeWhaleForCausalLM"}.items() <= config["auto_map"].items()
    assert config["architectures"] == ["SpikeWhaleForCausalLM"] and config["dtype"] == "float32"
    assert "lr" not in config and "train" not in config  # the training blob's other sections are not model config
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["auto_map"]["AutoTokenizer"][0] == "tokenization_spike.SpikeTokenizer"
    assert json.loads((out / "spike_vocab.json").read_text())["vocab"] == tok.vocab_data["vocab"]
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()
    weights = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in weights and len(weights) == len(release.base.state_dict()) - 1
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    serving = serving_generation_config(release.base.config).to_dict()
    for key in ("do_sample", "temperature", "top_k", "repetition_penalty", "max_new_tokens", "eos_token_id",
                "suppress_tokens"):
        assert gen_cfg[key] == serving[key], key

    prov = json.loads((out / "provenance.json").read_text())
    assert set(prov["outputs"]) == set(EXPORT_FILES) - {"provenance.json"}
    for name, entry in prov["outputs"].items():
        assert entry["sha256"] == sha256(out / name), name
    assert prov["source"]["files"][str(release.pt.resolve())]["sha256"] == sha256(release.pt)
    assert prov["versions"]["transformers"] and prov["versions"]["torch"] and prov["versions"]["gguf"]
    n_stored = len(release.base.state_dict()) - 1  # the tied head is stored once, as the embedding
    assert prov["verification"]["mismatches"] == 0 and prov["verification"]["tensors"] == n_stored
    assert prov["verification"]["tied_head_checked"]

    from huggingface_hub import ModelCard

    card = ModelCard.load(str(out / "README.md"))
    assert "custom_code" in card.data.tags and card.data.license == "other"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    for needle in ("base_62k", ">=5.24,<5.40", "trust_remote_code=True", "AutoModelForCausalLM",
                   f"{n_stored} tensors, 0 mismatches", "256 tokens"):
        assert needle in card.text, needle

    ids, logits, gen = reference(release.base, tok)
    state, outs, info = fresh["pt"]
    assert info["model_module"].startswith("transformers_modules.") and info["tied"]
    assert info["tokenizer"].endswith("tokenization_spike_fast.SpikeTokenizerFast") and info["len"] == len(tok)
    assert info["ids"] == ids and info["decoded"] == tok.decode(ids)
    assert info["chat"] == tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                   tokenize=False)
    assert_bit_identical(state, cpu_state(release.base))
    assert torch.equal(outs["logits"], logits) and torch.equal(outs["gen"], gen)


def test_convert_released_safetensors_folder(release, converted_st, fresh, tok):
    out = converted_st
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 0)
    prov = json.loads((out / "provenance.json").read_text())
    assert {Path(p).name for p in prov["source"]["files"]} == {"config.json", "model.safetensors", "tokenizer.json",
                                                               "PROVENANCE.md"}
    assert prov["conversion"]["stage"] == "sft_7100"
    assert any("bos_token_id 0 -> 2" in n for n in prov["conversion"]["notes"])
    readme = (out / "README.md").read_text()
    assert "sft_7100" in readme and "ChatML" in readme and "bos_token_id 0 -> 2" in readme

    ids, logits, gen = reference(release.sft, tok)
    state, outs, info = fresh["st"]
    assert info["tied"]  # the file had no lm_head.weight: the head is the embedding again, not random
    assert_bit_identical(state, cpu_state(release.sft))
    assert torch.equal(state["lm_head.weight"], release.sft.model.embed_tokens.weight.detach())
    assert torch.equal(outs["logits"], logits) and torch.equal(outs["gen"], gen)
    assert info["ids"] == ids


def test_convert_bf16(release, tmp_path):
    out = tmp_path / "bf16"
    assert main(["convert", str(release.st), str(out), "--dtype", "bf16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(str(out / "model.safetensors"))
    keep_fp32 = ("rope", "hash_proj", ".attn.mc.")  # tensors the model keeps in float32 under any dtype
    want = {k: v.to(torch.float32 if any(p in k for p in keep_fp32) else torch.bfloat16)
            for k, v in cpu_state(release.sft).items() if k != "lm_head.weight"}
    assert_bit_identical(weights, want)
    assert weights["model.layers.0.attn.k_proj.weight"].dtype == torch.bfloat16
    assert "bfloat16" in (out / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_gguf_layout_round_trip_and_import(release, gguf_files, converted_gguf, fresh, tok, qtype):
    import gguf

    path = gguf_files[qtype]
    reader = gguf.GGUFReader(path)
    assert reader.get_field("general.architecture").contents() == "spike_whale"
    cfg = json.loads(reader.get_field("spike_whale.config_json").contents())
    blob = config_blob(release.base)
    assert cfg["model_type"] == "spike_whale" and {k: v for k, v in cfg.items() if k != "model_type"} == {
        k: blob[k] for k in cfg if k != "model_type"}
    assert {"hidden_size", "loop_count", "use_fractal_rope", "fractal_rope_gamma", "mc_segment_len",
            "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id"} <= set(cfg)
    source = cpu_state(release.base)
    names = {t.name for t in reader.tensors}
    assert names == {k for k in source if not k.endswith(("cos_cache", "sin_cache")) and k != "lm_head.weight"}
    types_seen = {t.tensor_type.name for t in reader.tensors}
    assert types_seen == ({"F16", "F32"} if qtype == "f16" else {"F16", "F32", "Q8_0"})
    bound = ROUND_TRIP_BOUNDS[qtype]
    for t in reader.tensors:
        back = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(source[t.name].shape)
        delta = float((back - source[t.name]).abs().max())
        assert delta <= bound, (t.name, delta)
        if t.tensor_type.name == "F32":
            assert delta == 0.0, t.name
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    assert len(tokens) == 16512
    assert {s: i for i, s in enumerate(tokens) if s} == {  # byte-faithful: every token's latin-1 bytes survive
        s: i for s, i in tok.vocab_data["vocab"].items()}

    out = converted_gguf[qtype]
    assert "rebuilt" in (out / "README.md").read_text() and qtype.upper() in (out / "README.md").read_text()
    ids, logits, gen = reference(release.base, tok)
    state, outs, info = fresh[f"gguf-{qtype}"]
    assert info["ids"] == ids and info["tied"]
    for name, want in source.items():
        got = state[name]
        if name.endswith(("cos_cache", "sin_cache", "inv_freq")):
            assert torch.equal(got, want), name  # rebuilt with the checkpoint's (fractal) schedule, exactly
        else:
            assert float((got - want).abs().max()) <= bound, name
    assert float((outs["logits"] - logits).abs().max()) < 0.5
    if qtype == "f16":
        assert torch.equal(outs["gen"], gen)  # the f16 file gives the float32 source's greedy output


def test_released_style_gguf_rebuilds_fractal_rope(release, tmp_path):
    """A GGUF written straight with the gguf package in the released layout: no RoPE tensors at all (not even
    inv_freq), every matrix F16, tokens only. Import rebuilds the caches from the config's fractal schedule."""
    import gguf

    model = release.base
    path = tmp_path / "released-f16.gguf"
    w = gguf.GGUFWriter(str(path), arch="spike_whale")
    w.add_string("spike_whale.config_json", json.dumps(config_blob(model)))
    vocab = build_demo_tokenizer().vocab_data["vocab"]
    tokens = [""] * 16512
    for s, i in vocab.items():
        tokens[i] = s
    w.add_token_list(tokens)
    source = cpu_state(model)
    for name, t in source.items():
        if ".rope." in name or name == "lm_head.weight":
            continue
        arr = t.numpy()
        w.add_tensor(name, arr.astype(np.float16) if arr.ndim >= 2 else arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = tmp_path / "from-released"
    assert main(["from-gguf", str(path), str(out)]) == 0
    weights = load_file(str(out / "model.safetensors"))
    rope_keys = [k for k in source if ".rope." in k]
    assert rope_keys
    for k in rope_keys:
        assert torch.equal(weights[k], source[k]), k
    cfg = model.config
    assert cfg.use_fractal_rope
    geometric = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, False, 0.0)
    geo_cos, _ = rope_caches(cfg, geometric)
    assert float((geo_cos - source["model.layers.0.attn.rope.cos_cache"]).abs().max()) > 0.1  # the test can fail
    for k, v in weights.items():
        assert float((v - source[k]).abs().max()) <= ROUND_TRIP_BOUNDS["f16"], k
    assert "rebuilt" in (out / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# failures leave nothing behind
# ---------------------------------------------------------------------------------------------------------------

class Evil:
    """Unpickling this would create a folder: weights_only loading must refuse it."""

    marker = None

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _corrupt(kind: str, release, gguf_files, tmp: Path) -> tuple[list[str], str]:
    if kind == "bad-safetensors-header":
        folder = tmp / "bad_st"
        shutil.copytree(release.st, folder)
        raw = bytearray((folder / "model.safetensors").read_bytes())
        n = int.from_bytes(raw[:8], "little")
        raw[8:8 + n] = b"[" + b"x" * (n - 1)
        (folder / "model.safetensors").write_bytes(bytes(raw))
        return ["convert", str(folder)], "not a valid safetensors file"
    if kind == "truncated-gguf":
        src = gguf_files["f16"]
        path = tmp / "cut.gguf"
        path.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
        return ["from-gguf", str(path)], "truncated"
    if kind == "pickled-object":
        path = tmp / "evil" / "checkpoints" / "base_62k.pt"
        path.parent.mkdir(parents=True)
        Evil.marker = tmp / "pwned"
        torch.save({"model": release.base.state_dict(), "config": config_blob(release.base), "extra": Evil()}, path)
        return ["convert", str(path)], "pickled Python object"
    if kind == "unknown-pt-layout":
        path = tmp / "odd.pt"
        torch.save({"weights_v2": {"a": [1, 2]}, "meta": {"step": 3}}, path)
        return ["convert", str(path), "--tokenizer", str(release.root / "tokenizer.json")], "keys found: ['weights_v2', 'meta']"
    if kind == "truncated-pt":
        path = tmp / "cut.pt"
        path.write_bytes(release.pt.read_bytes()[: release.pt.stat().st_size // 2])
        return ["convert", str(path)], "not a readable PyTorch checkpoint"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["bad-safetensors-header", "truncated-gguf", "pickled-object", "unknown-pt-layout",
                                  "truncated-pt"])
def test_corrupt_inputs_give_clear_error_and_no_folder(kind, release, gguf_files, tmp_path, capsys):
    args, needle = _corrupt(kind, release, gguf_files, tmp_path)
    out = tmp_path / "out" / "model"
    code = main(args[:2] + [str(out)] + args[2:])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and err[0].startswith(f"spike-whale {args[0]}: error:") and needle in err[0], err
    assert not out.exists()
    if out.parent.exists():
        no_leftovers(out.parent)
    assert not (tmp_path / "pwned").exists()


def _pt_with(release, tmp_path, edit) -> Path:
    sd = cpu_state(release.base)
    edit(sd)
    path = tmp_path / "edited" / "checkpoints" / "base_62k.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": sd, "config": config_blob(release.base)}, path)
    shutil.copy(release.root / "tokenizer.json", path.parent.parent / "tokenizer.json")
    return path


@pytest.mark.parametrize("case", ["unplaceable", "missing", "shape", "distinct-head"])
def test_unplaceable_or_missing_tensors_fail_loudly(case, release, tmp_path, capsys):
    edits = {
        "unplaceable": (lambda sd: sd.update({"jepa.pred.weight": torch.zeros(4, 4)}),
                        "have no place in the model: ['jepa.pred.weight']"),
        "missing": (lambda sd: sd.pop("model.layers.1.attn.mc.mc_gate"),
                    "left uninitialised (absent from the checkpoint): ['model.layers.1.attn.mc.mc_gate']"),
        "shape": (lambda sd: sd.update({"model.norm.weight": torch.ones(3)}), "model.norm.weight: checkpoint (3,)"),
        "distinct-head": (lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"] + 1}),
                          "lm_head.weight differs from model.embed_tokens.weight"),
    }
    edit, needle = edits[case]
    path = _pt_with(release, tmp_path, edit)
    out = tmp_path / "out"
    assert main(["convert", str(path), str(out)]) == 1
    err = capsys.readouterr().err
    assert needle in err, err
    assert not out.exists()
    no_leftovers(tmp_path)


def test_failed_verification_leaves_no_folder(release, tmp_path, monkeypatch, capsys):
    real_save = conversion_mod.save_hub_folder

    def save_then_corrupt(model, tokenizer, out_dir):
        real_save(model, tokenizer, out_dir)
        path = Path(out_dir) / "model.safetensors"
        weights = load_file(str(path))
        weights["model.layers.0.ffn.up_proj.weight"][0, 0] += 1.0
        save_file(weights, str(path), metadata={"format": "pt"})

    monkeypatch.setattr(conversion_mod, "save_hub_folder", save_then_corrupt)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("previous export")
    assert main(["convert", str(release.pt), str(out), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "1 mismatches" in err and "model.layers.0.ffn.up_proj.weight" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # the old folder is untouched
    no_leftovers(tmp_path)


def test_existing_output_is_refused_before_work(release, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    assert main(["convert", str(release.pt), str(out)]) == 1
    assert "not empty" in capsys.readouterr().err


def test_checkpoint_layouts_and_config_sources(release, tmp_path):
    sd = cpu_state(release.base)
    blob = config_blob(release.base)
    nested = tmp_path / "nested.pt"
    torch.save({"state_dict": {f"_orig_mod.{k}": v for k, v in sd.items()},
                "hparams": {"model": blob, "optim": {"lr": 1e-3}}}, nested)
    ckpt = load_checkpoint(nested, tokenizer=release.root / "tokenizer.json")
    assert set(ckpt.state_dict) == set(sd) and all(torch.equal(ckpt.state_dict[k], sd[k]) for k in sd)
    assert ckpt.config.hidden_size == release.base.config.hidden_size
    assert any("_orig_mod." in n for n in ckpt.notes) and any("'hparams'" in n for n in ckpt.notes)

    bare = tmp_path / "bare" / "weights.pt"
    bare.parent.mkdir()
    torch.save(sd, bare)
    with pytest.raises(ValueError, match="pass --config"):
        load_checkpoint(bare)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(blob))
    ckpt = load_checkpoint(bare, config=str(cfg_file))
    assert ckpt.config.to_dict()["mc_segment_len"] == blob["mc_segment_len"] and ckpt.vocab is None
    with pytest.raises(ValueError, match="no tokenizer found"):
        conversion_mod.export_checkpoint(ckpt, tmp_path / "never")
    assert not (tmp_path / "never").exists()


# ---------------------------------------------------------------------------------------------------------------
# widening
# ---------------------------------------------------------------------------------------------------------------

WIDEN_CHECK = r'''
import json, torch
from transformers import AutoModelForCausalLM
args = json.loads(__ARGS__)
torch.manual_seed(0)
wide = AutoModelForCausalLM.from_pretrained(args["wide"], trust_remote_code=True).eval()
old = AutoModelForCausalLM.from_pretrained(args["old"], trust_remote_code=True).eval()
old_ctx, n = args["old_ctx"], args["n"]
ids = torch.cat([torch.tensor([[2]]), torch.randint(4, 2000, (1, n - 1))], 1)
res = {}
with torch.no_grad():
    full = wide(input_ids=ids, use_cache=False).logits
    # chunked cached decode: prefill below the old boundary, single tokens across it, a chunk, single tokens
    out = wide(input_ids=ids[:, :old_ctx - 6], use_cache=True)
    steps, cache, pos = [out.logits], out.cache, old_ctx - 6
    for size in [1] * 12 + [n - (old_ctx + 6) - 4] + [1] * 4:
        out = wide(input_ids=ids[:, pos:pos + size], cache=cache, use_cache=True)
        steps.append(out.logits)
        cache, pos = out.cache, pos + size
    cached = torch.cat(steps, 1)
    res["positions"] = pos
    res["max_abs"] = float((cached - full).abs().max())
    res["argmax_equal"] = bool(torch.equal(cached.argmax(-1), full.argmax(-1)))
    short = ids[:, :old_ctx]
    res["inside_equal"] = bool(torch.equal(wide(input_ids=short, use_cache=False).logits,
                                           old(input_ids=short, use_cache=False).logits))
    for name, model, length in (("old_raises", old, old_ctx + 1), ("wide_raises", wide, args["new_ctx"] + 1)):
        try:
            model(input_ids=torch.full((1, length), 5), use_cache=False)
            res[name] = ""
        except ValueError as err:
            res[name] = str(err)
print(json.dumps(res))
'''


def test_widen_4x_keeps_cached_decode_exact_across_old_boundary(release, converted_pt, tmp_path, capsys):
    old_ctx = release.base.config.max_position_embeddings
    new_ctx = 4 * old_ctx
    out = tmp_path / "wide"
    assert main(["widen", str(converted_pt), str(out), "--max-position-embeddings", str(new_ctx)]) == 0
    assert "0 mismatches" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == new_ctx
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == new_ctx
    weights = load_file(str(out / "model.safetensors"))
    source = cpu_state(release.base)
    for k, v in weights.items():
        if k.endswith(("cos_cache", "sin_cache")):
            assert v.shape[0] == new_ctx and torch.equal(v[:old_ctx], source[k]), k
            inv = source[k.rsplit(".", 1)[0] + ".inv_freq"]
            want = torch.outer(torch.arange(new_ctx, dtype=torch.float32), inv)
            want = want.cos() if k.endswith("cos_cache") else want.sin()
            assert torch.equal(v, want), k  # from the checkpoint's own (fractal) inv_freq
        else:
            assert torch.equal(v, source[k]), k
    assert "base_62k" in (out / "README.md").read_text()  # the stage carries over from the source export

    n = old_ctx + 32
    args = {"wide": str(out), "old": str(converted_pt), "old_ctx": old_ctx, "new_ctx": new_ctx, "n": n}
    res = json.loads(run_fresh_python(WIDEN_CHECK.replace("__ARGS__", repr(json.dumps(args))), tmp_path))
    assert res["positions"] == n
    assert res["argmax_equal"] and res["max_abs"] < 1e-4, res
    assert res["inside_equal"]
    assert "max_position_embeddings" in res["old_raises"] and "max_position_embeddings" in res["wide_raises"]


def test_widen_refuses_narrowing_and_inconsistent_caches(release, converted_pt, tmp_path, capsys):
    assert main(["widen", str(converted_pt), str(tmp_path / "narrow"), "--max-position-embeddings", "64"]) == 1
    assert "only widening" in capsys.readouterr().err
    bad = tmp_path / "bad"
    shutil.copytree(converted_pt, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.2.attn.rope.cos_cache"][10, 0] += 1e-3
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert main(["widen", str(bad), str(tmp_path / "w"), "--max-position-embeddings", "1024"]) == 1
    assert "does not follow the stored inv_freq" in capsys.readouterr().err
    assert not (tmp_path / "narrow").exists() and not (tmp_path / "w").exists()


# ---------------------------------------------------------------------------------------------------------------
# push
# ---------------------------------------------------------------------------------------------------------------

class RecordingHfApi:
    """Stands in for huggingface_hub.HfApi: records the calls; the committed files are computed from the recorded
    upload_folder arguments with huggingface_hub's own pattern filter."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        RecordingHfApi.calls.append(("init", kwargs))

    def create_repo(self, **kwargs):
        RecordingHfApi.calls.append(("create_repo", kwargs))
        return types.SimpleNamespace(repo_id=kwargs["repo_id"])

    def create_branch(self, **kwargs):
        RecordingHfApi.calls.append(("create_branch", kwargs))

    def upload_folder(self, **kwargs):
        from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

        folder = Path(kwargs["folder_path"])
        listing = sorted(p.relative_to(folder).as_posix() for p in folder.glob("**/*") if p.is_file())
        ignore = list(kwargs.get("ignore_patterns") or []) + DEFAULT_IGNORE_PATTERNS  # as upload_folder does
        committed = list(filter_repo_objects(listing, allow_patterns=kwargs.get("allow_patterns"),
                                             ignore_patterns=ignore))
        RecordingHfApi.calls.append(("upload_folder", dict(kwargs, committed=committed)))
        return types.SimpleNamespace(commit_url=f"https://hub.invalid/{kwargs['repo_id']}/commit/0")


HUB_USER = r"""
import json, types
import torch
import transformers.utils.hub as hub
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, AutoTokenizer
res = {}
# 1. the pushed files, as a Hub snapshot, load through the Hub code path (offline)
model = AutoModelForCausalLM.from_pretrained("me/byrne-tiny", trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained("me/byrne-tiny", trust_remote_code=True)
ids = tok(__TEXT__, return_tensors="pt")["input_ids"]
with torch.no_grad():
    res["logits"] = model(input_ids=ids, use_cache=False).logits[0, -1, :8].tolist()
res["module"], res["ids"] = type(model).__module__, ids[0].tolist()
# 2. that user pushes the model and tokenizer again with transformers (Hub calls recorded, nothing sent)
commits = []
class FakeApi:
    def create_repo(self, repo_id, **kw):
        return types.SimpleNamespace(repo_id=repo_id)
    def create_branch(self, **kw):
        pass
    def create_commit(self, repo_id, operations, **kw):
        commits.append({op.path_in_repo: json.load(open(op.path_or_fileobj)) if op.path_in_repo.endswith("config.json")
                        else None for op in operations})
        return types.SimpleNamespace(commit_url="fake")
api = FakeApi()
hub.hf_api = lambda: api
for name in ("create_repo", "create_branch", "create_commit"):  # transformers < 5.24 calls these functions directly
    if hasattr(hub, name):
        setattr(hub, name, getattr(api, name))
hub.create_and_tag_model_card = lambda repo_id, tags=None, token=None: ModelCard("---\nlibrary_name: transformers\n---\n")
model.push_to_hub("me/finetuned")
tok.push_to_hub("me/finetuned")
res["commits"] = commits
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def pushed(converted_pt, tmp_path_factory):
    """`spike-whale push` with a recording HfApi; then the committed files as a Hub snapshot, used by a fresh process."""
    tmp = tmp_path_factory.mktemp("push")
    folder = tmp / "export"
    shutil.copytree(converted_pt, folder)
    (folder / "notes.txt").write_text("scratch")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "modeling_spike_whale.cpython-311.pyc").write_bytes(b"\0")
    RecordingHfApi.calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(push_mod, "make_api", lambda timeout: RecordingHfApi())
        code = main(["push", str(folder), "me/byrne-tiny", "--private", "--revision", "step-62000"])
    calls = dict((name, kw) for name, kw in RecordingHfApi.calls)
    committed = sorted(calls["upload_folder"]["committed"])
    repo_dir = tmp / "hf_home" / "hub" / "models--me--byrne-tiny"  # run_fresh_python uses HF_HOME=tmp/hf_home
    commit = hashlib.sha1("".join(committed).encode()).hexdigest()
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for name in committed:
        shutil.copy(folder / name, snap / name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    out = run_fresh_python(HUB_USER.replace("__TEXT__", repr(TEXT)), tmp)
    return types.SimpleNamespace(code=code, calls=calls, committed=committed,
                                 user=json.loads(out.strip().splitlines()[-1]))


def test_push_commits_exactly_what_a_user_needs(pushed, release, tok):
    assert pushed.code == 0
    calls = pushed.calls
    assert calls["create_repo"]["repo_id"] == "me/byrne-tiny" and calls["create_repo"]["private"] is True
    assert calls["create_branch"]["branch"] == "step-62000"
    upload = calls["upload_folder"]
    assert upload["revision"] == "step-62000" and upload["repo_id"] == "me/byrne-tiny"
    assert pushed.committed == list(EXPORT_FILES)  # not notes.txt, not __pycache__
    # exactly these files are enough: the snapshot holding only them loads through the Hub code path
    assert pushed.user["module"].startswith("transformers_modules.me.byrne")
    ids, logits, _ = reference(release.base, tok)
    assert pushed.user["ids"] == ids and pushed.user["logits"] == logits[0, -1, :8].tolist()


def test_push_refuses_incomplete_folder(converted_pt, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "partial"
    shutil.copytree(converted_pt, folder)
    (folder / "tokenization_spike.py").unlink()
    RecordingHfApi.calls = []
    monkeypatch.setattr(push_mod, "make_api", lambda timeout: RecordingHfApi())
    assert main(["push", str(folder), "me/x"]) == 1
    assert "missing ['tokenization_spike.py']" in capsys.readouterr().err
    assert not [c for c in RecordingHfApi.calls if c[0] != "init"]


def test_push_reports_hub_errors_in_one_line(converted_pt, monkeypatch, capsys):
    from huggingface_hub.errors import OfflineModeIsEnabled

    class OfflineHfApi(RecordingHfApi):
        def create_repo(self, **kwargs):
            raise OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/repos/create: offline mode is enabled.\n"
                                       "To disable it, please unset the `HF_HUB_OFFLINE` environment variable.")

    monkeypatch.setattr(push_mod, "make_api", lambda timeout: OfflineHfApi())
    assert main(["push", str(converted_pt), "me/x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "push to me/x failed: OfflineModeIsEnabled" in err[0]


def test_from_gguf_refuses_other_formats(release, tmp_path, capsys):
    assert main(["from-gguf", str(release.pt), str(tmp_path / "out")]) == 1
    assert "expected a gguf file, found pt" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_transformers_push_to_hub_carries_code_and_auto_map(pushed, monkeypatch):
    model_files, tok_files = pushed.user["commits"]
    # a model loaded through the Auto classes (remote code) re-pushes its code files and auto_map
    for name in ("config.json", "generation_config.json", "model.safetensors", "configuration_spike_whale.py",
                 "modeling_spike_whale.py", "generation_utils.py"):
        assert name in model_files, name
    assert model_files["config.json"]["auto_map"]["AutoModelForCausalLM"] == "modeling_spike_whale.SpikeWhaleForCausalLM"
    for name in ("tokenization_spike.py", "tokenization_spike_fast.py", "spike_vocab.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert name in tok_files, name
    assert tok_files["tokenizer_config.json"]["auto_map"]["AutoTokenizer"] == [
        "tokenization_spike.SpikeTokenizer", "tokenization_spike_fast.SpikeTokenizerFast"]

    # the package classes too, once `register_auto_classes()` ran (in this process)
    import transformers.utils.hub as hub
    from huggingface_hub import ModelCard

    commits = []

    class FakeApi:
        def create_repo(self, repo_id, **kw):
            return types.SimpleNamespace(repo_id=repo_id)

        def create_commit(self, repo_id, operations, **kw):
            commits.append({op.path_in_repo: (json.load(open(op.path_or_fileobj))
                                              if op.path_in_repo.endswith("config.json") else None)
                            for op in operations})

    fake = FakeApi()
    monkeypatch.setattr(hub, "hf_api", lambda: fake, raising=False)
    for name in ("create_repo", "create_commit"):  # transformers < 5.24 calls these functions directly
        if hasattr(hub, name):
            monkeypatch.setattr(hub, name, getattr(fake, name))
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *a, **k: ModelCard("---\nlicense: other\n---\n"))
    register_auto_classes()
    tiny_model(seed=3).push_to_hub("me/direct")
    model_code = {f for f in CODE_FILES if not f.startswith("tokenization")}  # the tokenizer's go with tok.push_to_hub
    assert model_code <= set(commits[0]) and "auto_map" in commits[0]["config.json"]


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command,phrases", [
    ("convert", ["weights_only=True", "lm_head.weight", "fresh process", "bit-identical", "--max-position-embeddings",
                 "--dtype", "provenance.json"]),
    ("to-gguf", ["spike_whale.config_json", "0.008", "0.079", "RoPE caches not stored"]),
    ("from-gguf", ["dequantized", "fractal stays fractal", "fresh process"]),
    ("widen", ["inverse frequencies", "fractal", "--max-position-embeddings"]),
    ("push", ["create_repo", "upload_folder", "HF_TOKEN", "--private", "--revision"]),
])
def test_help_explains_each_command(command, phrases, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in phrases:
        assert phrase in text, (command, phrase)


# ---------------------------------------------------------------------------------------------------------------
# issue 11: nothing a user owns is ever lost
# ---------------------------------------------------------------------------------------------------------------

def tree_digest(root: Path) -> dict[str, str]:
    """Every file under `root` (symlinks not followed) -> sha256."""
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture
def user_tree(release, converted_pt, gguf_files, tmp_path):
    """A user's models/ folder holding their only copies: a .pt + tokenizer, a safetensors folder, an export, a GGUF."""
    models = tmp_path / "models"
    (models / "ckpt").mkdir(parents=True)
    shutil.copy(release.pt, models / "run.pt")
    shutil.copy(release.root / "tokenizer.json", models / "tokenizer.json")
    shutil.copytree(release.st, models / "sft")
    shutil.copytree(converted_pt, models / "export")
    shutil.copy(gguf_files["f16"], models / "model.gguf")
    (tmp_path / "link").symlink_to(models, target_is_directory=True)
    return models


# (command line, expected phrase); {m} is the models folder, {l} a symlink to it.
DESTINATION_CASES = {
    "convert-out-holds-source": (["convert", "{m}/run.pt", "{m}", "--overwrite"], "contains the source"),
    "convert-out-is-source-folder": (["convert", "{m}/sft", "{m}/sft", "--overwrite"], "is the source"),
    "convert-out-inside-source": (["convert", "{m}/sft", "{m}/sft/hub"], "lies inside the source"),
    "convert-through-symlink": (["convert", "{m}/run.pt", "{l}", "--overwrite"], "contains the source"),
    "convert-out-holds-tokenizer": (["convert", "{m}/ckpt/../run.pt", "{m}/..", "--overwrite"], "contains the source"),
    "to-gguf-over-source-file": (["to-gguf", "{m}/sft", "{m}/sft/model.safetensors", "--type", "f16", "--overwrite"],
                                 "lies inside the source"),
    "to-gguf-over-source-gguf": (["to-gguf", "{m}/model.gguf", "{l}/model.gguf", "--type", "f16", "--overwrite"],
                                 "is the source"),
    "to-gguf-existing-file": (["to-gguf", "{m}/run.pt", "{m}/tokenizer.json", "--type", "f16"], "exists (pass --overwrite"),
    "to-gguf-existing-non-gguf": (["to-gguf", "{m}/sft", "{m}/tokenizer.json", "--type", "f16", "--overwrite"],
                                  "is not a GGUF file"),
    "from-gguf-out-holds-source": (["from-gguf", "{m}/model.gguf", "{m}", "--overwrite"], "contains the source"),
    "widen-out-is-source": (["widen", "{m}/export", "{l}/export", "--max-position-embeddings", "512", "--overwrite"],
                            "is the source"),
    "widen-out-inside-source": (["widen", "{m}/export", "{m}/export/wide", "--max-position-embeddings", "512"],
                                "lies inside the source"),
    "init-tiny-non-empty": (["init-tiny", "{m}/export"], "not empty (pass --overwrite"),
    "init-tiny-foreign-files": (["init-tiny", "{m}", "--overwrite"], "holds files spike-whale does not write"),
    "convert-foreign-files": (["convert", "{m}/sft", "{m}/ckpt/..", "--overwrite"], "contains the source"),
    "convert-over-source-file": (["convert", "{m}/run.pt", "{l}/run.pt", "--overwrite"], "is the source"),
    "convert-existing": (["convert", "{m}/run.pt", "{m}/export"], "not empty (pass --overwrite"),
    "from-gguf-over-source-file": (["from-gguf", "{m}/model.gguf", "{m}/model.gguf", "--overwrite"], "is the source"),
    "from-gguf-existing": (["from-gguf", "{m}/model.gguf", "{m}/export"], "not empty (pass --overwrite"),
    "widen-existing": (["widen", "{m}/sft", "{m}/export", "--max-position-embeddings", "512"], "not empty (pass --overwrite"),
    "widen-into-foreign-folder": (["widen", "{m}/export", "{m}/sft", "--max-position-embeddings", "512", "--overwrite"],
                                  "holds files spike-whale does not write"),
}


@pytest.mark.parametrize("case", sorted(DESTINATION_CASES))
def test_writing_commands_never_touch_their_source(case, user_tree, tmp_path, capsys):
    args, phrase = DESTINATION_CASES[case]
    args = [a.format(m=user_tree, l=tmp_path / "link") for a in args]
    before = tree_digest(user_tree)
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0], err
    assert tree_digest(user_tree) == before
    no_leftovers(user_tree)


def test_overwrite_refuses_a_folder_with_other_files(release, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "thesis.tex").write_text("years of work")
    assert main(["convert", str(release.pt), str(out), "--overwrite"]) == 1
    assert "holds files spike-whale does not write (thesis.tex)" in capsys.readouterr().err
    assert (out / "thesis.tex").read_text() == "years of work"


def test_to_gguf_overwrites_only_a_gguf_and_only_when_asked(release, gguf_files, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    shutil.copy(gguf_files["q8_0"], out)
    before = sha256(out)
    assert main(["to-gguf", str(release.pt), str(out), "--type", "f16"]) == 1
    assert "exists (pass --overwrite" in capsys.readouterr().err and sha256(out) == before
    assert main(["to-gguf", str(release.pt), str(out), "--type", "f16", "--overwrite"]) == 0
    assert sha256(out) == sha256(gguf_files["f16"])
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_verification_child_dies_with_its_parent(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from spike_whale.hub_export.output_paths import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=die_with_parent())
open({str(pid_file)!r}, "w").write(str(child.pid))
time.sleep(60)
"""])
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break  # killed, waiting to be reaped by init
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its SIGKILLed parent")


def test_init_tiny_overwrite_replaces_the_whole_folder_with_umask_permissions(tmp_path):
    out = tmp_path / "tiny"
    assert main(["init-tiny", str(out)]) == 0
    (out / "README.md").write_text("stale card")
    (out / "provenance.json").write_text("{}")
    old = os.umask(0o027)
    try:
        assert main(["init-tiny", str(out), "--overwrite", "--seed", "3"]) == 0
    finally:
        os.umask(old)
    assert not (out / "README.md").exists() and not (out / "provenance.json").exists()
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o640} and out.stat().st_mode & 0o777 == 0o750, modes


def test_push_refuses_a_folder_changed_since_export(converted_pt, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "export"
    shutil.copytree(converted_pt, folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] += 1
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    RecordingHfApi.calls = []
    monkeypatch.setattr(push_mod, "make_api", lambda timeout: RecordingHfApi())
    assert main(["push", str(folder), "me/x"]) == 1
    err = capsys.readouterr().err
    assert "['model.safetensors'] differ from the checksums in provenance.json" in err
    assert not RecordingHfApi.calls

    tiny = tmp_path / "tiny"  # init-tiny writes no provenance: never pushable as an export
    assert main(["init-tiny", str(tiny)]) == 0
    assert main(["push", str(tiny), "me/x"]) == 1
    assert "missing ['README.md', 'provenance.json']" in capsys.readouterr().err


def test_push_retries_transient_errors_a_bounded_number_of_times(monkeypatch):
    httpx2 = push_mod.http_library()
    calls = []

    class FlakyApi:
        def create_repo(self, **kwargs):
            calls.append("create_repo")
            if len(calls) < 3:
                raise httpx2.ReadTimeout("timed out")

        def upload_folder(self, **kwargs):
            calls.append("upload_folder")
            raise httpx2.ConnectError("connection refused")

    monkeypatch.setattr(push_mod.time, "sleep", lambda s: None)
    lines = []
    push_mod._with_retries("creating me/x", FlakyApi().create_repo, 2, lines.append)
    with pytest.raises(httpx2.ConnectError):
        push_mod._with_retries("uploading", FlakyApi().upload_folder, 2, lines.append)
    assert calls == ["create_repo"] * 3 + ["upload_folder"] * 3
    assert sum("retrying" in line for line in lines) == 4


def test_push_gives_up_on_a_hub_that_never_answers(converted_pt, tmp_path):
    import socket
    import subprocess
    import sys
    import threading
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []

    def accept_and_say_nothing():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{server.getsockname()[1]}", HF_TOKEN="hf_test",
               HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "spike_whale", "push", str(converted_pt), "me/x", "--timeout", "0.5",
                               "--retries", "1"], capture_output=True, text=True, env=env, timeout=120)
    finally:
        server.close()
        for conn in held:
            conn.close()
    elapsed = time.time() - t0
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1, proc.stderr
    assert err[0].startswith("spike-whale push: error: push to me/x failed:") and "Timeout" in err[0], err
    assert "push: creating me/x (retry 1/1) ..." in proc.stdout.splitlines(), proc.stdout
    assert elapsed < 60


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _one_line_case(case: str, release, tmp: Path) -> tuple[list[str], str]:
    tok_json = str(release.root / "tokenizer.json")
    if case in ("config-bool", "config-list", "config-nan"):
        folder = tmp / "st"
        shutil.copytree(release.st, folder)
        cfg = json.loads((folder / "config.json").read_text())
        data = {"config-bool": dict(cfg, max_position_embeddings=True), "config-list": [cfg],
                "config-nan": dict(cfg, rope_theta=float("nan"))}[case]
        (folder / "config.json").write_text(json.dumps(data))
        phrase = {"config-bool": "max_position_embeddings is true, expected an integer",
                  "config-list": "a config must be a JSON object, found a list",
                  "config-nan": "rope_theta is NaN, expected a finite number"}[case]
        return ["convert", str(folder)], phrase
    if case == "config-huge":  # a lying size is refused before any model (even a meta one) is built from it
        path = tmp / "huge.pt"
        torch.save({"model": cpu_state(release.base), "config": dict(config_blob(release.base), num_hidden_layers=200_000)},
                   path)
        return ["convert", str(path), "--tokenizer", tok_json], "num_hidden_layers 200000 vs layers 0..3 in the tensors"
    if case == "empty-pt":
        return ["convert", str(_write(tmp / "empty.pt", "")), "--tokenizer", tok_json], "empty.pt: the file is empty (0 bytes)"
    sd = cpu_state(release.base)
    if case == "int32-weight":
        sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
        phrase = "model.norm.weight (int32, the model holds float32)"
    elif case == "nan-weight":
        sd["model.layers.1.ffn.up_proj.weight"][3, 4] = float("nan")
        phrase = "tensors hold NaN or inf values: ['model.layers.1.ffn.up_proj.weight']"
    else:  # key mismatch: the message names the file
        sd["model.mystery.weight"] = sd.pop("model.norm.weight")
        phrase = "odd.pt: 1 checkpoint tensors have no place in the model: ['model.mystery.weight']"
    path = tmp / "odd.pt"
    torch.save({"model": sd, "config": config_blob(release.base)}, path)
    return ["convert", str(path), "--tokenizer", tok_json], phrase


@pytest.mark.parametrize("case", ["config-bool", "config-list", "config-nan", "config-huge", "empty-pt", "int32-weight",
                                  "nan-weight", "key-mismatch-names-file"])
def test_bad_inputs_fail_in_one_line(case, release, tmp_path, capsys):
    args, phrase = _one_line_case(case, release, tmp_path)
    out = tmp_path / "out"
    assert main(args[:2] + [str(out)] + args[2:]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spike-whale convert: error:") and phrase in err[0], err
    assert not out.exists()


def _gguf_with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of the GGUF `src` whose spike_whale.config_json has `changes` (the rest of the metadata kept)."""
    import gguf

    from spike_whale.hub_export.gguf_io import CONFIG_KEY, GGUF_ARCH

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), arch=GGUF_ARCH)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == CONFIG_KEY:
            value = json.dumps(dict(json.loads(value), **changes))
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("changes,phrase", [
    (dict(max_position_embeddings=4_000_000), "max_position_embeddings 4000000 vs spike_whale.context_length 256"),
    (dict(vocab_size=1 << 30), "vocab_size 1073741824 vs spike_whale.vocab_size"),
    (dict(q_lora_rank=48), "contradicts the file's tensor shapes"),
])
def test_gguf_config_must_agree_with_the_file(changes, phrase, gguf_files, tmp_path, capsys):
    src = _gguf_with_config(gguf_files["f16"], tmp_path / "lying.gguf", **changes)
    assert main(["from-gguf", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0], err
    assert not (tmp_path / "out").exists()


def test_gguf_rope_allocation_is_bounded(gguf_files, tmp_path, monkeypatch, capsys):
    from spike_whale.hub_export import gguf_io

    src = _gguf_with_config(gguf_files["f16"], tmp_path / "huge.gguf", max_position_embeddings=100_000_000)
    monkeypatch.setattr(gguf_io, "METADATA_FIELDS", {})  # as if the file carried no context_length to check against
    assert main(["from-gguf", str(src), str(tmp_path / "out")]) == 1
    assert "max_position_embeddings 100000000 would need" in capsys.readouterr().err


def test_rename_report_and_rename_map(release, tmp_path, capsys):
    sd = cpu_state(release.base)
    theirs = {"model.layers.0.hc_attn.pre_logits": "layers.0.hc.attn_alpha",
              "model.loop_pass_embed.weight": "pass_emb.weight"}
    for ours, name in theirs.items():
        sd[name] = sd.pop(ours)
    path = tmp_path / "real" / "base_62k.pt"
    path.parent.mkdir()
    torch.save({"model": sd, "config": config_blob(release.base)}, path)
    tok_json = str(release.root / "tokenizer.json")
    out = tmp_path / "out"
    assert main(["convert", str(path), str(out), "--tokenizer", tok_json]) == 1
    captured = capsys.readouterr()
    report = captured.out
    assert "model tensors matched, 2 checkpoint tensors unplaceable, 2 model tensors absent (2 of them guessed names" in report
    assert "absent: model.loop_pass_embed.weight  (guessed name)" in report
    assert "unplaceable: pass_emb.weight -> same-shape candidates: model.loop_pass_embed.weight" in report
    line = next(l for l in report.splitlines() if "a rename map for these" in l)
    rename_map = json.loads(line.split(": '", 1)[1].rstrip("'"))
    assert rename_map == {v: k for k, v in theirs.items()}
    assert "base_62k.pt: 2 checkpoint tensors have no place" in captured.err and len(captured.err.splitlines()) == 1
    assert main(["convert", str(path), str(out), "--tokenizer", tok_json, "--rename-map", json.dumps(rename_map)]) == 0
    assert "renamed 2 checkpoint keys through --rename-map" in (out / "README.md").read_text()


def test_guessed_keys_name_real_state_dict_entries():
    import re

    from spike_whale import SpikeWhaleForCausalLM
    from spike_whale.hub_export.checkpoint import GUESSED_KEYS
    from conftest import tiny_config

    everything_on = dict(use_moe=True, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_layers=[0, 1],
                         moe_intermediate_size=48, use_elo=True, engram_fusion_layers=[1], engram_fusion_dim=16,
                         use_abstain_head=True)
    names = set()
    for overrides in ({}, everything_on):
        with torch.device("meta"):
            names |= set(SpikeWhaleForCausalLM(tiny_config(**overrides)).state_dict())
    unmatched = [p for p in GUESSED_KEYS if not any(re.fullmatch(p, n) for n in names)]
    assert not unmatched, f"GUESSED_KEYS patterns that name no tensor of the model: {unmatched}"
    # every alternative of every pattern names a real tensor, too (a renamed leaf cannot hide behind its siblings)
    for pattern in GUESSED_KEYS:
        for leaf in re.findall(r"[a-z_]+(?:\\\.[a-z_]+)*(?=[|)])", pattern):
            leaf = leaf.replace("\\.", ".")
            assert any(re.fullmatch(pattern, n) and leaf in n for n in names), (pattern, leaf)


def test_hub_export_modules_import_no_cycle():
    import ast

    root = Path(__file__).resolve().parent.parent / "hub_export"
    graph = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
        graph[path.stem] = {d.split(".")[0] for d in deps}

    def reaches(start, goal, seen=()):
        return any(d == goal or (d not in seen and reaches(d, goal, (*seen, d))) for d in graph.get(start, ()))

    cycles = sorted(m for m in graph if reaches(m, m))
    assert not cycles, f"hub_export modules that import themselves back: {cycles}"
    assert "__main__" not in (root / "verify.py").read_text()


def test_verify_bf16_does_not_accuse_a_healthy_model():
    from spike_whale.hub_export.cache_check import logits_scale, run_checks, tolerance

    model = tiny_model(seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(16.0)  # logits of ~14: one bf16 rounding is 0.0625, above the old fixed 5e-2
    model = model.to(torch.bfloat16)
    results = run_checks(model, new_tokens=6)
    ran = [r for r in results if not r.skipped]
    assert ran and all(r.ok and r.identical == r.total for r in ran), [(r.name, r.max_dlogit, r.tol) for r in ran]
    assert max(r.max_dlogit for r in ran) > 5e-2
    assert tolerance(torch.float32, logits_scale(model.float())) == 1e-4  # float32 keeps its bound
    assert tolerance(torch.bfloat16, 14.0) == pytest.approx(8 * 2 ** -7 * 14.0)


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                state = (proc / "stat").read_text().split()[2]
            except OSError:
                continue
            if text in cmdline and state != "Z":
                pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("command", ["convert", "to-gguf"])
def test_sigkill_at_random_moments_loses_nothing(command, release, tmp_path):
    """SIGKILL a real run at random moments; after each: the source is byte-identical, the destination is absent or
    complete and verified, no child survives; the next run removes what the killed one left and succeeds."""
    import random
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from spike_whale.hub_export.push import check_export_folder

    src_root = tmp_path / "release"
    (src_root / "checkpoints").mkdir(parents=True)
    shutil.copy(release.pt, src_root / "checkpoints" / "base_62k.pt")
    shutil.copy(release.root / "tokenizer.json", src_root / "tokenizer.json")
    before = tree_digest(src_root)
    work = tmp_path / "work"
    work.mkdir()
    out = work / ("model" if command == "convert" else "model.gguf")
    args = [sys.executable, "-m", "spike_whale", command, str(src_root / "checkpoints" / "base_62k.pt"), str(out),
            "--overwrite", *(["--type", "f16"] if command == "to-gguf" else [])]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TRANSFORMERS_VERBOSITY="error",
               OMP_NUM_THREADS="1")

    def check_destination_state():
        if command == "convert":
            if out.exists():
                check_export_folder(out)  # every file present and equal to its provenance checksum
        elif out.exists():
            assert load_checkpoint(out, progress=False).config.hidden_size == release.base.config.hidden_size

    rng = random.Random(1234)
    killed = []
    for _ in range(3):
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=str(tmp_path))
        time.sleep(rng.uniform(1.0, 9.0 if command == "convert" else 6.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed.append(proc.pid)
        assert tree_digest(src_root) == before
        check_destination_state()
        deadline = time.time() + 5
        while _processes_mentioning(str(work)) and time.time() < deadline:
            time.sleep(0.1)
        assert not _processes_mentioning(str(work)), "a child of the killed command survived it"
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    assert tree_digest(src_root) == before
    check_destination_state()
    assert out.exists()
    leftovers = [p.name for p in work.iterdir() if p.name.startswith(".")]
    assert not leftovers, (leftovers, done.stderr)
    stale_verify = [p for p in Path(tempfile.gettempdir()).glob("spike-whale-verify-*")
                    if any(p.name.startswith(f"spike-whale-verify-{pid}-") for pid in killed)]
    if command == "convert":  # the next verification cleans up its predecessors' temp folders
        assert not stale_verify, stale_verify
