"""`spike-whale generate` sampling switches: they reach generate, a seed repeats, bad values are one line."""

from __future__ import annotations

import pytest

from _tiny_folder import write_tiny_folder
from spike_whale.hub_export import cli


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("gen") / "tiny")


def generate(folder, capsys, *switches):
    assert cli.main(["generate", folder, "-p", "The whale", "--max-new-tokens", "8", *switches]) == 0
    return capsys.readouterr().out


def test_switches_reach_generate(folder, capsys, monkeypatch):
    from transformers import GenerationMixin

    seen = {}
    parent = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        return parent(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    generate(folder, capsys, "--temperature", "0.9", "--top-k", "5", "--top-p", "0.8", "--repetition-penalty", "1.1",
             "--seed", "3", "--dtype", "bf16", "--threads", "1")
    assert (seen["temperature"], seen["top_k"], seen["top_p"], seen["repetition_penalty"]) == (0.9, 5, 0.8, 1.1)
    assert seen["max_new_tokens"] == 8


def test_seed_repeats_and_switches_change_the_sample(folder, capsys):
    a = generate(folder, capsys, "--seed", "1", "--temperature", "1.5", "--top-k", "0")
    assert generate(folder, capsys, "--seed", "1", "--temperature", "1.5", "--top-k", "0") == a
    assert generate(folder, capsys, "--seed", "1", "--top-k", "1") == generate(folder, capsys, "--greedy")


@pytest.mark.parametrize("switches,message", [
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--greedy", "--temperature", "0.5"], "--greedy ignores sampling"),
])
def test_bad_switch_is_one_line(folder, capsys, switches, message):
    assert cli.main(["generate", folder, "-p", "x", *switches]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_missing_folder_is_named(tmp_path, capsys):
    assert cli.main(["generate", str(tmp_path / "nope"), "-p", "x"]) == 1
    assert "no such folder" in capsys.readouterr().err


def test_token_healing_is_the_default_and_can_be_turned_off(folder, capsys, monkeypatch):
    from spike_whale.hub_export import generate_text

    seen, load = [], generate_text.load

    def recording_load(args):
        tokenizer, model = load(args)
        generate = model.generate

        def record(*a, **kw):
            seen.append(kw.get("token_healing"))
            return generate(*a, **kw)

        model.generate = record
        return tokenizer, model

    monkeypatch.setattr(generate_text, "load", recording_load)
    healed = generate(folder, capsys, "--greedy")
    assert healed.startswith("The wh") and len(healed) > len("The wh")  # the streamer prints the healed prompt
    assert generate(folder, capsys, "--greedy") == healed  # healing is greedy too
    plain = generate(folder, capsys, "--greedy", "--no-token-healing")
    assert plain.startswith("The whale") and seen == [True, True, None]
