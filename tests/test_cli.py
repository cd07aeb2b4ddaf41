import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture(scope="module")
def init_tiny(tmp_path_factory):
    """One `init-tiny` run, fitted for 4 steps, shared by the tests of what it prints and of what it wrote (each run is
    a fresh interpreter: several seconds)."""
    tmp_path = tmp_path_factory.mktemp("init_tiny")
    folder = tmp_path / "tiny"
    out = _run(["init-tiny", str(folder), "--seed", "1", "--train-steps", "4"], tmp_path).stdout
    return folder, out


@pytest.mark.parametrize("chat", [False, True])
def test_init_tiny_then_generate_in_fresh_process(init_tiny, tmp_path, chat):
    folder, made = init_tiny
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


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao (the `int8` extra) is not installed")
def test_generate_prints_no_torchao_import_noise(init_tiny, tmp_path):
    """transformers imports torchao whenever it is installed, and torchao and torch then log warnings about CUDA
    kernels and enum registrations that no command can act on."""
    proc = _run(["generate", str(init_tiny[0]), "-p", "Hello", "--max-new-tokens", "2", "--greedy"], tmp_path)
    noise = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert noise == [], proc.stderr  # transformers' own progress bar is all that stderr holds


def test_generate_reports_missing_folder(tmp_path):
    proc = _run(["generate", str(tmp_path / "nope"), "-p", "x"], tmp_path, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"spike-whale generate: error: {tmp_path / 'nope'}: no such folder"


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_generate_reports_a_truncated_file_in_one_line(init_tiny, tmp_path, name):
    folder = tmp_path / "cut"
    shutil.copytree(init_tiny[0], folder)
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    proc = _run(["generate", str(folder), "-p", "x"], tmp_path, check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1, proc.stderr
    assert err[0].startswith(f"spike-whale generate: error: {path} is damaged or truncated (") and \
        err[0].endswith("re-download it or re-convert the folder with `spike-whale convert`"), err


def test_init_tiny_can_fit_the_demo_corpus(init_tiny):
    line = next(l for l in init_tiny[1].splitlines() if l.startswith("trained 4 steps"))
    first, last = (float(x) for x in line.split("loss ")[1].split(" -> "))
    assert last < first


FAKE_PYTHON = """#!/bin/sh
# Stands in for python3 and for every command of a venv: `-m venv DIR` gives DIR/bin/python this script; any other
# call is recorded as "VENV COMMAND ARGS" and succeeds.
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit; fi
echo "$(basename "$(dirname "$(dirname "$0")")") $(basename "$0") $*" >> "$CALLS"
"""


def test_the_tests_install_their_extras_outside_the_demo_venv(tmp_path):
    """torchao (the int8 extra the tests install) logs on every import: the demo's .venv keeps the package alone."""
    root = Path(__file__).resolve().parents[1]
    repo = tmp_path / "repo"
    shutil.copytree(root / "scripts", repo / "scripts")
    shutil.copy(root / "setup.cfg", repo)
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(fake, repo / ".venv" / "bin" / "spike-whale")
    env = dict(os.environ, PYTHON=str(fake), CALLS=str(tmp_path / "calls"))
    for script in (["demo.sh"], ["test.sh"], ["test.sh", "--transformers", "floor"]):
        subprocess.run(["bash", f"scripts/{script[0]}", *script[1:]], cwd=repo, env=env, check=True, timeout=60,
                       capture_output=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    floor = re.search(r"^ *transformers>=([0-9.]+),", (root / "setup.cfg").read_text(), re.M).group(1)
    assert sorted(line for line in calls if " -e " in line) == [
        ".venv python -m pip install -q -e .",
        ".venv-test python -m pip install -q -e .[test,int8]",
        f".venv-transformers-{floor} python -m pip install -q -e .[test,int8] transformers=={floor}",
    ], calls
    assert [line.split()[0] for line in calls if " -m pytest " in line] == [".venv-test", f".venv-transformers-{floor}"]
    assert [line.split()[0] for line in calls if " spike-whale " in line] == [".venv"]


NO_TORCH = r"""
import sys
from spike_whale.hub_export.cli import main
from spike_whale.hub_export.commands import COMMANDS
for argv in [["--help"], ["--version"], ["nope"], *([name, "--help"] for name in {names}), ["convert"], ["push", "d"]]:
    try:
        main(argv)
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "transformers", "huggingface_hub", "gguf") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_help_version_and_argument_errors_import_nothing_heavy(tmp_path):
    mine = ["init-tiny", "convert", "to-gguf", "from-gguf", "widen", "push", "verify"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", NO_TORCH.replace("{names}", repr(mine))], capture_output=True,
                          text=True, env=env, timeout=120, cwd=str(tmp_path))
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr
    assert "spike-whale " in proc.stdout and "invalid choice: 'nope'" in proc.stderr


def test_command_help_lines_match_their_modules(capsys):
    from spike_whale.hub_export.cli import build_parser
    from spike_whale.hub_export.commands import COMMANDS

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    assert {name: helps[name] for name in COMMANDS} == {name: h for name, (_, h) in COMMANDS.items()}


def test_verify_reports_a_missing_folder_in_one_line(tmp_path):
    proc = _run(["verify", str(tmp_path / "nope")], tmp_path, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"spike-whale verify: error: {tmp_path / 'nope'}: no such folder (give the folder of " \
                                  "an exported model)"


def test_verify_bf16_prints_progress_and_passes(tmp_path):
    from spike_whale.hub_export.init_tiny import build_tiny, write_tiny_folder

    folder = write_tiny_folder(tmp_path / "tiny", *build_tiny(max_position_embeddings=128))
    out = _run(["verify", str(folder), "--dtype", "bf16", "--new-tokens", "2", "--threads", "1"], tmp_path).stdout
    lines = out.splitlines()
    assert any(line.startswith("tolerance: max |Δlogit| <=") and "bf16 rounding" in line for line in lines), out
    progress = [line for line in lines if line.startswith("[")]
    assert progress[0].startswith("[1/8] ") and progress[-1].startswith("[8/8] ") and "tokens identical" in progress[0]
    assert "all 9 checks passed" in out


def test_sigint_prints_one_line_and_leaves_nothing(tmp_path):
    import signal
    import time

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TRANSFORMERS_VERBOSITY="error")
    out = tmp_path / "t"
    # The child starts with SIGINT's default action, as from a terminal: a runner launched as a background job of a
    # non-interactive shell ignores SIGINT, and Python then keeps it ignored (no KeyboardInterrupt ever).
    proc = subprocess.Popen([sys.executable, "-u", "-m", "spike_whale", "init-tiny", str(out), "--train-steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:  # training has started once the first loss line appears
        if line.startswith("step"):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    # The interrupt adds one line, last, and no traceback.
    assert err.strip().splitlines()[-1:] == ["spike-whale init-tiny: interrupted"] and "Traceback" not in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".t.")]
