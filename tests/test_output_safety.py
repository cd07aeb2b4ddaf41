"""What the writing commands may remove or overwrite: only what this program provably wrote (an owner marker names
the writer, which must be gone), never a user's entry that merely has a matching name; `eval` / `diagnose --json`
never write over their inputs or, without `--overwrite`, over an existing file, and write the JSON whole."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from _tiny_folder import write_tiny_folder
from spike_whale.hub_export import cli
from spike_whale.hub_export import output_paths
from spike_whale.hub_export.output_paths import remove_stale_temps, staging_folder

TEXT = "The harbour was quiet before dawn. Nobody noticed the whale until the tide turned.\n"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def tree(root: Path) -> dict:
    """Every path under `root` with its content's digest (None for a folder)."""
    return {str(p.relative_to(root)): None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def run_child(code: str, tmp_path, env=None) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})), cwd=str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("safety") / "tiny")


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """A private temp dir for this test (the cleanup also scans the temp dir)."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def test_cleanup_never_touches_what_only_has_a_matching_name(tmp_path, temp_dir, capsys):
    """The issue's reproduction (`.mymodel.old-4242` next to `mymodel`, deleted before) and the other name shapes
    the cleanup used to act on: user entries, their writer pids dead, none with a marker of ours."""
    pid = dead_pid()
    parent = tmp_path / "P"
    (parent / "mymodel").mkdir(parents=True)
    (parent / "mymodel" / "config.json").write_text("the user's model")
    (parent / ".mymodel.old-4242").mkdir()
    (parent / ".mymodel.old-4242" / "w.bin").write_text("v1")
    (parent / f".notes.old-{pid}").mkdir()  # no `notes` next to it: used to be renamed to `notes`
    (parent / f".notes.old-{pid}" / "draft.txt").write_text("mine")
    (parent / f".X.{pid}-abcd1234.tmp").write_text("a user's file")
    (parent / f".cache.tmp-{pid}-abcd1234").mkdir()
    (parent / f".cache.tmp-{pid}-abcd1234" / "model.safetensors").write_bytes(b"\0" * 10)
    (parent / ".export.tmp-abcd1234").mkdir()  # an earlier version's name shape, without a pid
    (parent / ".export.tmp-abcd1234" / "model.safetensors").write_bytes(b"\0" * 10)
    (parent / ".m.gguf.abcd1234.tmp").write_bytes(b"GGUF....")
    # A marker that does not prove ownership (its token is not in the entry's name) is no marker.
    forged = parent / f".data.tmp-{pid}-abcd1234"
    forged.mkdir()
    (forged / "results.csv").write_text("1,2,3")
    Path(f"{forged}.spike-whale-owner").write_text(json.dumps(
        {"writer": "spike-whale", "kind": "folder", "entry": forged.name, "token": "0" * 16, "pid": pid}))
    (temp_dir / f"spike-whale-verify-{pid}-abcd1234").mkdir()
    (temp_dir / f"spike-whale-verify-{pid}-abcd1234" / "report.json").write_text("{}")
    (temp_dir / "spike-whale-trainer-k2j4h5g6").mkdir()
    before, before_tmp = tree(parent), tree(temp_dir)
    assert cli.main(["init-tiny", str(parent / "out")]) == 0
    assert remove_stale_temps(temp_dir) == []
    after = tree(parent)
    assert {k: v for k, v in after.items() if not k.startswith("out")} == before
    assert tree(temp_dir) == before_tmp
    assert "note:" not in capsys.readouterr().err


def test_cleanup_removes_what_a_dead_writer_left_and_puts_its_backup_back(tmp_path, temp_dir, capsys):
    """A run killed mid-way (here: a child that exits without cleaning up, one of them between the two renames of
    a folder swap) leaves marked temporaries; the next run removes them and puts the moved-aside export back."""
    parent = tmp_path / "P"
    parent.mkdir()
    (parent / "old-export").mkdir()
    (parent / "old-export" / "config.json").write_text("the user's previous export")
    run_child(f"""
        import os
        from pathlib import Path
        from spike_whale.hub_export import output_paths as op

        parent = Path({str(parent)!r})
        (op.staging_folder(parent / "a") / "model.safetensors").write_bytes(b"\\0" * 1000)
        op.staging_file(parent / "b.gguf").write_bytes(b"GGUF")
        op.temp_folder("spike-whale-trainer")
        swap = op.staging_folder(parent / "old-export")
        (swap / "config.json").write_text("the new export")
        real = os.replace

        def replace(src, dst):
            real(src, dst)
            if ".old-" in str(dst):
                os._exit(0)  # killed between moving the old export aside and moving the new one in

        os.replace = replace
        op.replace_folder(swap, parent / "old-export", overwrite=True)
    """, tmp_path, env={"TMPDIR": str(temp_dir)})
    left = sorted(p.name for p in parent.iterdir())
    assert "old-export" not in left and sum(name.endswith(output_paths.OWNER_SUFFIX) for name in left) == 4, left
    assert cli.main(["init-tiny", str(parent / "new")]) == 0
    err = capsys.readouterr().err
    assert (parent / "old-export" / "config.json").read_text() == "the user's previous export"
    assert f"restored {parent / 'old-export'}" in err and "a temporary output left by an interrupted run" in err
    assert sorted(p.name for p in parent.iterdir()) == ["new", "old-export"]
    assert len(remove_stale_temps(temp_dir, log=lambda msg: None)) == 1 and not any(temp_dir.iterdir())


def test_cleanup_leaves_a_live_writer_alone_and_knows_a_reused_pid(tmp_path):
    live = staging_folder(tmp_path / "live")
    reused = staging_folder(tmp_path / "reused")
    marker = Path(f"{reused}{output_paths.OWNER_SUFFIX}")
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps(dict(record, started="1")))  # this pid, but not the process that wrote it
    done = remove_stale_temps(tmp_path, log=lambda msg: None)
    assert len(done) == 1 and str(reused) in done[0]
    assert live.is_dir() and not reused.exists() and not marker.exists()
    assert Path(f"{live}{output_paths.OWNER_SUFFIX}").exists()


def test_sigkilled_finetune_leaves_nothing_the_next_run_keeps(folder, tmp_path, temp_dir):
    """A finetune SIGKILLed while training leaves its Trainer work folder in the temp dir; the next finetune
    removes it (it is marked as that run's) and leaves a user's folder of the same name shape alone."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 8)
    train = ["--steps", "1", "--batch-size", "2", "--seq-len", "16"]
    (temp_dir / "spike-whale-trainer-mine").mkdir()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, sys
        from spike_whale.hub_export import cli, finetune
        finetune.train_loop = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
        cli.main(sys.argv[1:])
    """), "finetune", folder, str(tmp_path / "killed"), "--text", str(text), *train],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TMPDIR=str(temp_dir)))
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert len([p for p in temp_dir.glob("spike-whale-trainer-*") if p.is_dir()]) == 2
    assert cli.main(["finetune", folder, str(tmp_path / "out"), "--text", str(text), *train]) == 0
    assert sorted(p.name for p in temp_dir.iterdir()) == ["spike-whale-trainer-mine"]


def test_json_report_never_overwrites_an_input_or_an_existing_file(folder, tmp_path, capsys):
    """The issue's reproduction (`eval ev ev_in.txt --json ev/config.json` replaced the model's config) and its
    kin: a --json path that is an input is refused even with --overwrite, an existing file without it."""
    text = tmp_path / "ev_in.txt"
    text.write_text(TEXT)
    other = tmp_path / "other.json"
    other.write_text("a user's file")
    before = tree(Path(folder))
    cases = [
        (["eval", folder, str(text), "--json", f"{folder}/config.json"], "lies inside the source"),
        (["eval", folder, str(text), "--json", f"{folder}/config.json", "--overwrite"], "lies inside the source"),
        (["eval", folder, str(text), "--json", str(text), "--overwrite"], "is the source"),
        (["eval", folder, str(text), "--json", str(other)], "exists (pass --overwrite"),
        (["diagnose", folder, "--only", "context", "--json", f"{folder}/config.json"], "lies inside the source"),
        (["diagnose", folder, str(text), "--json", str(text), "--overwrite"], "is the source"),
        (["diagnose", folder, "--only", "context", "--json", str(other)], "exists (pass --overwrite"),
    ]
    for args, message in cases:
        assert cli.main([*args, "--quiet"]) == 1, args
        err = capsys.readouterr().err.strip()
        assert message in err and "--json" in err and len(err.splitlines()) == 1, (args, err)
    assert tree(Path(folder)) == before and text.read_text() == TEXT and other.read_text() == "a user's file"
    assert cli.main(["eval", folder, str(text), "--json", str(other), "--overwrite", "--quiet"]) == 0
    assert json.loads(other.read_text())["files"][0]["tokens"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev_in.txt", "other.json"]


def test_json_report_is_written_whole_or_not_at_all(folder, tmp_path, monkeypatch):
    """A report that fails to serialise leaves the previous file as it was (it used to be truncated first)."""
    from spike_whale.hub_export.perplexity import TextScore

    text = tmp_path / "ev_in.txt"
    text.write_text(TEXT)
    report = tmp_path / "report.json"
    report.write_text('{"previous": "report"}')
    monkeypatch.setattr(TextScore, "report", lambda self: {"nll": object()})
    with pytest.raises(TypeError):
        cli.main(["eval", folder, str(text), "--json", str(report), "--overwrite", "--quiet"])
    assert report.read_text() == '{"previous": "report"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev_in.txt", "report.json"]
