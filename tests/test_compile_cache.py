"""The compiled decode walk persists across processes (issue 12, compile cost): `compile_config` in one process stores
the walk in torch's cache directory, and a second process with the same model runs it without tracing again. The
stored walk is the CPU layer's (`spike_whale.accel.compile.PersistentDecodeWalk`): every model here is optimized for
CPU (`optimize_for_cpu`) first."""

from __future__ import annotations

import json
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version

from conftest import run_fresh_python, tiny_model
from spike_whale.accel import compile as accel_compile
from spike_whale.accel import optimize_for_cpu
from spike_whale.accel.compile import PersistentDecodeWalk


def optimized_tiny_model(**kwargs):
    return optimize_for_cpu(tiny_model(**kwargs))

GENERATE = """
import inspect, json, torch
from torch._dynamo.utils import counters
from transformers import CompileConfig
from spike_whale import SpikeWhaleForCausalLM
from spike_whale.accel import optimize_for_cpu
from spike_whale.accel.compile import PersistentDecodeWalk

model = optimize_for_cpu(SpikeWhaleForCausalLM.from_pretrained({folder!r}).eval())
ids = torch.tensor({ids!r})
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                         do_sample=False, pad_token_id=0, compile_config=CompileConfig())
walk = inspect.getclosurevars(model.model._compiled_run).nonlocals["walk"]  # the stored walk the compiled run calls
assert isinstance(walk, PersistentDecodeWalk), type(walk)
print(json.dumps({{"ids": out.tolist(), "traced": counters["stats"]["unique_graphs"],
                  "stored": len(walk.graphs), "folder": walk.folder}}))
"""


@pytest.mark.skipif(
    version.parse(transformers.__version__) < version.parse("5.24"),
    reason="transformers < 5.24 refuses assisted decoding with a compileable cache, so compile_config does not apply",
)
def test_a_second_process_decodes_from_the_stored_walk(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch_cache"))
    # 2 layers x 2 passes: the first process compiles the walk with inductor's caches cold, about 30% faster than
    # with the tiny model's 4 layers (test_decode_step compiles those, in-process).
    model = tiny_model(seed=2, num_hidden_layers=2)
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(10, 500, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                               do_sample=False, pad_token_id=0)
    code = GENERATE.format(folder=str(tmp_path / "model"), ids=ids.tolist())
    first = json.loads(run_fresh_python(code, tmp_path, timeout=900).strip().splitlines()[-1])
    second = json.loads(run_fresh_python(code, tmp_path, timeout=900).strip().splitlines()[-1])
    assert first["traced"] == 1 and first["stored"] == 1  # traced once, for every pass and step
    assert first["folder"].startswith(str(tmp_path / "torch_cache"))
    assert second["traced"] == 0 and second["stored"] == 1  # read back, not traced
    assert second["folder"] == first["folder"]
    assert first["ids"] == second["ids"] == eager.tolist()


def test_the_stored_walk_is_keyed_by_the_weights_layout_not_by_how_the_model_was_made(tmp_path):
    """A model saved and loaded again finds its walk (the benchmark's second process); other shapes, dtypes, options
    or thread counts do not."""
    model = optimized_tiny_model(seed=2)
    model.save_pretrained(tmp_path)
    reloaded = optimize_for_cpu(type(model).from_pretrained(tmp_path).eval())
    options = {"size_asserts": False}
    key = PersistentDecodeWalk.key(model.model, options, {"dynamic": True})
    assert PersistentDecodeWalk.key(reloaded.model, options, {"dynamic": True}) == key
    assert PersistentDecodeWalk.key(optimized_tiny_model(seed=5).model, options, {"dynamic": True}) == key  # values
    assert PersistentDecodeWalk.key(optimized_tiny_model(q_lora_rank=16).model, options, {"dynamic": True}) != key
    assert PersistentDecodeWalk.key(model.to(torch.float64).model, options, {"dynamic": True}) != key
    assert PersistentDecodeWalk.key(reloaded.model, {"size_asserts": True}, {"dynamic": True}) != key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert PersistentDecodeWalk.key(reloaded.model, options, {"dynamic": True}) != key
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        for linear in accel_compile.column_major_linears(reloaded):
            linear.weight.data = linear.weight.data.t().contiguous().t()
    assert PersistentDecodeWalk.key(reloaded.model, options, {"dynamic": True}) != key  # strides are part of it


def test_the_stored_walk_is_keyed_by_the_package_folder(tmp_path, monkeypatch):
    """The same sources in another folder (a new environment) take an entry of their own: the stored graphs' guards
    read the folder, so sharing the entry would add a graph per folder, every one loaded by each later process."""
    import sys

    model = optimized_tiny_model(seed=2)
    key = PersistentDecodeWalk.key(model.model, {}, {})
    module = sys.modules[type(model.model).__module__]
    copy = tmp_path / "elsewhere"
    (copy / "accel").mkdir(parents=True)
    # The sources the key reads, unchanged, in a folder of their own.
    for source_module, folder in ((module, copy), (accel_compile, copy / "accel")):
        for source in Path(source_module.__file__).parent.glob("*.py"):
            (folder / source.name).write_bytes(source.read_bytes())
        monkeypatch.setattr(source_module, "__file__", str(folder / Path(source_module.__file__).name))
    assert PersistentDecodeWalk.key(model.model, {}, {}) != key
    monkeypatch.undo()
    assert PersistentDecodeWalk.key(model.model, {}, {}) == key


class _FakeCompile:
    """Stands in for torch's ahead-of-time compile: what a walk runs and stores when nothing stored fits."""

    def __init__(self):
        self.calls = 0

    def aot_compile(self, example):
        self.calls += 1
        return _FakeGraph()


class _FakeGraph:
    def guard_check(self, *args):
        return True

    def fn(self, *args):
        return "compiled here"

    def save_compiled_function(self, path):
        from torch._dynamo.aot_compile import atomic_write_binary

        atomic_write_binary(path, b"stored")


class _Payload:
    """A pickle that runs code when loaded: creates `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _walk(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch_cache"))
    walk = PersistentDecodeWalk(optimized_tiny_model(num_hidden_layers=2).model, {}, {})
    walk.compile = _FakeCompile()
    return walk


def _plant(path, marker, mode=0o600):
    path.write_bytes(pickle.dumps(_Payload(marker)))
    os.chmod(path, mode)


def test_only_the_users_own_stored_walks_are_read_and_a_cut_short_one_is_compiled_again(tmp_path, monkeypatch):
    """A stored walk is code: entries others may write, links and other users' files are never loaded, and one
    that cannot be read back is compiled again instead of raising."""
    walk = _walk(tmp_path, monkeypatch)
    folder = Path(walk.folder)
    folder.mkdir(mode=0o700, parents=True)
    os.chmod(folder.parent, 0o700)
    marker = tmp_path / "ran"
    _plant(folder / "a.bin", marker, mode=0o666)  # writable by others
    outside = tmp_path / "outside.bin"
    _plant(outside, marker)
    (folder / "b.bin").symlink_to(outside)
    if os.getuid() == 0:  # root can hand a file to another user
        _plant(folder / "c.bin", marker)
        os.chown(folder / "c.bin", 12345, 12345)
    (folder / "d.bin").write_bytes(pickle.dumps({"state": list(range(100))})[:20])  # cut short
    os.chmod(folder / "d.bin", 0o600)
    assert walk(torch.zeros(1)) == "compiled here"
    assert not marker.exists() and walk.compile.calls == 1
    assert not (folder / "d.bin").exists()  # dropped, and compiled again
    assert len(set(os.listdir(folder)) - {"a.bin", "b.bin", "c.bin"}) == 1  # the walk compiled here


def test_the_cache_folders_are_created_for_the_user_alone(tmp_path, monkeypatch):
    walk = _walk(tmp_path, monkeypatch)
    walk(torch.zeros(1))
    folder = Path(walk.folder)
    assert stat.S_IMODE(os.stat(folder).st_mode) == stat.S_IMODE(os.stat(folder.parent).st_mode) == 0o700
    assert [stat.S_IMODE(os.stat(folder / name).st_mode) for name in os.listdir(folder)] == [0o600]


@pytest.mark.parametrize("foreign", ["writable by others", "another user's"])
def test_a_cache_folder_that_is_not_the_users_alone_is_neither_read_nor_written(tmp_path, monkeypatch, foreign):
    if foreign == "another user's" and os.getuid() != 0:
        pytest.skip("handing a folder to another user needs root")
    walk = _walk(tmp_path, monkeypatch)
    folder = Path(walk.folder)
    folder.mkdir(parents=True)
    marker = tmp_path / "ran"
    _plant(folder / "a.bin", marker)
    if foreign == "another user's":
        os.chown(folder.parent, 12345, 12345)
    else:
        os.chmod(folder.parent, 0o777)
    assert walk(torch.zeros(1)) == "compiled here"
    assert not marker.exists() and not walk.stores
    assert os.listdir(folder) == ["a.bin"]  # nothing stored there


def test_the_key_holds_the_transformers_version_and_the_cpu_isa(monkeypatch):
    """A walk built under one transformers release or vector ISA is not read under another."""
    model = optimized_tiny_model(num_hidden_layers=2)
    key = PersistentDecodeWalk.key(model.model, {}, {})
    installed = accel_compile.transformers  # the module the key reads (the test session may hold another)
    monkeypatch.setattr(installed, "__version__", installed.__version__ + ".other")
    assert PersistentDecodeWalk.key(model.model, {}, {}) != key
    monkeypatch.undo()
    assert PersistentDecodeWalk.key(model.model, {}, {}) == key
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "another ISA")
    assert PersistentDecodeWalk.key(model.model, {}, {}) != key


@pytest.mark.parametrize("content", ["5", "null", "[1]", '{"cut short'])
def test_compiled_products_json_of_another_shape_is_ignored(tmp_path, monkeypatch, content):
    from spike_whale.accel.kernels import FewRowsKernel

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch_cache"))
    monkeypatch.setattr(FewRowsKernel, "forced", "linear")  # no timing: only the file's reading is under test
    root = Path(PersistentDecodeWalk.root())
    root.mkdir(mode=0o700, parents=True)
    (root / "compiled_products.json").write_text(content)
    model = optimized_tiny_model(num_hidden_layers=2)
    accel_compile.choose_compiled_products(model, persistent=True)
    assert all(accel_compile.compiled_kinds(o)[0] == "linear" for o in accel_compile.compiled_owners(model)
               if o.weight.numel() >= 1 << 16)


def test_the_key_holds_the_torch_and_triton_versions_and_the_cpu_isa(monkeypatch):
    """A walk built under one torch release, with another triton (or with triton against without: None), or for
    another vector ISA (`torch.backends.cpu.get_cpu_capability()`) is not read: its kernels were written for them."""
    model = optimized_tiny_model(num_hidden_layers=2)
    try:
        import triton
    except ImportError:
        installed = None
    else:
        installed = triton.__version__
    assert accel_compile.triton_version() == installed
    key = PersistentDecodeWalk.key(model.model, {}, {})
    changes = (
        (torch, "__version__", str(torch.__version__) + ".other"),
        (accel_compile, "triton_version", lambda: "0.0.other" if installed is None else None),
        (torch.backends.cpu, "get_cpu_capability", lambda: "another ISA"),
    )
    for owner, name, value in changes:
        with monkeypatch.context() as changed:
            changed.setattr(owner, name, value)
            assert PersistentDecodeWalk.key(model.model, {}, {}) != key, name
    assert PersistentDecodeWalk.key(model.model, {}, {}) == key
