import os
import subprocess
import sys

import pytest


def _run(args, tmp_path, check=True):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-m", "spike_whale", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=str(tmp_path))
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_help_lists_commands(tmp_path):
    out = _run(["--help"], tmp_path).stdout
    assert "init-tiny" in out and "generate" in out


@pytest.mark.parametrize("chat", [False, True])
def test_init_tiny_then_generate_in_fresh_process(tmp_path, chat):
    folder = tmp_path / "tiny"
    made = _run(["init-tiny", str(folder), "--seed", "1"], tmp_path).stdout
    assert "loop slots" in made
    for f in ("config.json", "model.safetensors", "tokenizer_config.json", "spike_vocab.json", "generation_config.json",
              "chat_template.jinja", "modeling_spike_whale.py"):
        assert (folder / f).exists(), f
    args = ["generate", str(folder), "-p", "Hello whale", "--max-new-tokens", "12", "--greedy"] + (["--chat"] if chat else [])
    first = _run(args, tmp_path).stdout
    again = _run(args, tmp_path).stdout
    assert first == again and len(first) > len("Hello whale") * (0 if chat else 1)
    if not chat:
        assert first.startswith("Hello whale")


def test_generate_reports_missing_folder(tmp_path):
    proc = _run(["generate", str(tmp_path / "nope"), "-p", "x"], tmp_path, check=False)
    assert proc.returncode != 0 and "error" in proc.stderr.lower()


def test_init_tiny_can_fit_the_demo_corpus(tmp_path):
    out = _run(["init-tiny", str(tmp_path / "t"), "--train-steps", "4"], tmp_path).stdout
    line = next(l for l in out.splitlines() if l.startswith("trained 4 steps"))
    first, last = (float(x) for x in line.split("loss ")[1].split(" -> "))
    assert last < first
