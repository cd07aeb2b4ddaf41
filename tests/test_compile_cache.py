"""The compiled decode walk persists across processes (issue 12, compile cost): `compile_config` in one process stores
the walk in torch's cache directory, and a second process with the same model runs it without tracing again."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from packaging import version

from conftest import run_fresh_python, tiny_model
from spike_whale.modeling_spike_whale import PersistentDecodeWalk

GENERATE = """
import json, torch
from torch._dynamo.utils import counters
from transformers import CompileConfig
from spike_whale import SpikeWhaleForCausalLM

model = SpikeWhaleForCausalLM.from_pretrained({folder!r}).eval()
ids = torch.tensor({ids!r})
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                         do_sample=False, pad_token_id=0, compile_config=CompileConfig())
print(json.dumps({{"ids": out.tolist(), "traced": counters["stats"]["unique_graphs"],
                  "stored": len(model.model._compiled_run.graphs), "folder": model.model._compiled_run.folder}}))
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
    model = tiny_model(seed=2)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    options = {"size_asserts": False}
    key = PersistentDecodeWalk.key(model.model, options, {"dynamic": True})
    assert PersistentDecodeWalk.key(reloaded.model, options, {"dynamic": True}) == key
    assert PersistentDecodeWalk.key(tiny_model(seed=5).model, options, {"dynamic": True}) == key  # other values
    assert PersistentDecodeWalk.key(tiny_model(q_lora_rank=16).model, options, {"dynamic": True}) != key
    assert PersistentDecodeWalk.key(model.to(torch.float64).model, options, {"dynamic": True}) != key
    assert PersistentDecodeWalk.key(reloaded.model, {"size_asserts": True}, {"dynamic": True}) != key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert PersistentDecodeWalk.key(reloaded.model, options, {"dynamic": True}) != key
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        for linear in reloaded._column_major_linears():
            linear.weight.data = linear.weight.data.t().contiguous().t()
    assert PersistentDecodeWalk.key(reloaded.model, options, {"dynamic": True}) != key  # strides are part of it
