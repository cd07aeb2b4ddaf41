"""accelerate big-model placement (`device_map`) of the looped model: every split this machine can make (CPU + disk
offload, and placements computed on the meta device for GPUs it does not have) runs exactly like the plain model,
each loop-plan slot keeps its cache state on its layer's device, and the cache is never copied between steps."""

from __future__ import annotations

import pytest
import torch
from conftest import open_gates

from spike_whale import SpikeWhaleConfig, SpikeWhaleForCausalLM
from spike_whale.hub_export.folder import save_hub_folder
from spike_whale.hub_export.init_tiny import build_tiny


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("device_map") / "tiny"
    model, tok = build_tiny(seed=4, mc_segment_len=8)
    open_gates(model)
    save_hub_folder(model, tok, path)
    return str(path)


def inputs():
    torch.manual_seed(0)
    ids = torch.randint(4, 2000, (2, 19))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    return ids, mask


def nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def execution_device(module) -> torch.device:
    """Where accelerate runs a dispatched module (offloaded ones run on the main device)."""
    return torch.device(module._hf_hook.execution_device)


def slot_tensors(slot) -> list[torch.Tensor]:
    return [slot.keys, slot.values, *(vars(slot.mc).values() if slot.mc is not None else ())]


def decode_steps(model, ids, mask, steps: int):
    """Prefill, then one-token greedy steps through the cache; returns (tokens, per-step logits, the cache and the
    storage address of every slot tensor after each step)."""
    out = model(ids, attention_mask=mask, use_cache=True)
    cache, logits, tokens, addresses = out.past_key_values, [out.logits[:, -1]], [], []
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        tokens.append(token)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        out = model(token, attention_mask=mask, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        addresses.append([[t.data_ptr() for t in slot_tensors(slot)] for slot in cache.layers])
    return torch.cat(tokens, 1), torch.stack(logits), cache, addresses


@torch.no_grad()
def test_cpu_disk_auto_split_is_exact_and_slot_state_lives_on_its_layer(folder, tmp_path):
    ref = SpikeWhaleForCausalLM.from_pretrained(folder).eval()
    # A CPU budget short of the whole model by a third of its layers: the last layers go to disk.
    total, layers = nbytes(ref), nbytes(ref.model.layers)
    budget = {"cpu": int(total - 0.3 * layers)}
    split = SpikeWhaleForCausalLM.from_pretrained(
        folder, device_map="auto", max_memory=budget, offload_folder=str(tmp_path / "offload")).eval()
    placed = {split.hf_device_map.get(f"model.layers.{i}") for i in range(split.config.num_hidden_layers)}
    assert placed == {"cpu", "disk"}, split.hf_device_map  # the layers themselves are split
    ids, mask = inputs()
    torch.testing.assert_close(split(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits,
                               rtol=0, atol=1e-6)
    # Segments of 8 tokens: the 19-token prompt and 9 steps cross Memory-Cache segment boundaries.
    want_tokens, want_logits, _, _ = decode_steps(ref, ids, mask, 9)
    tokens, logits, cache, addresses = decode_steps(split, ids, mask, 9)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-6)
    plan = split.config.loop_plan
    for slot, (layer_idx, _) in zip(cache.layers, plan.entries):
        device = execution_device(split.model.layers[layer_idx])
        assert all(t.device == device for t in slot_tensors(slot)), (layer_idx, device)
    # The hooks never copy the cache: every slot tensor keeps its storage from step to step (K/V are written in
    # place; only the running Memory-Cache sums are new tensors each step, so only K/V and fin_* are compared).
    first, *later = addresses
    for step in later:
        for slot_first, slot_now in zip(first, step):
            assert slot_now[:2] == slot_first[:2] and slot_now[2:5] == slot_first[2:5]


def test_auto_device_map_over_gpus_runs_each_loop_pass_across_the_devices_in_order():
    """Placement for two GPUs this machine does not have, computed on the meta device (the 114M preset): decoder
    layers stay whole (`_no_split_modules`), the tied embedding and head share a device, and every loop pass visits
    the devices in the same order, so a forward hops device 0 → 1 once per pass and back at each pass boundary."""
    from transformers.integrations.accelerate import infer_auto_device_map

    config = SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc")
    with torch.device("meta"):
        model = SpikeWhaleForCausalLM(config)
    assert "SpikeWhaleDecoderLayer" in model._no_split_modules
    dm = infer_auto_device_map(model, max_memory={0: "250MB", 1: "250MB", "cpu": "2GB"},
                               no_split_module_classes=model._no_split_modules)
    assert not any(k.startswith("model.layers.") and k.count(".") > 2 for k in dm), dm
    layer_device = [dm.get(f"model.layers.{i}", dm.get("model.layers", dm.get("model"))) for i in range(16)]
    assert {0, 1} <= set(layer_device), dm
    order = [0, 1, "cpu"]
    passes = {}
    for layer_idx, loop_pass in config.loop_plan.entries:
        passes.setdefault(loop_pass, []).append(layer_device[layer_idx])
    visits = {tuple(dict.fromkeys(devices)) for devices in passes.values()}
    assert len(visits) == 1, passes  # every pass crosses the devices the same way
    (visit,) = visits
    assert list(visit) == sorted(visit, key=order.index) and len(visit) >= 2
    assert dm.get("lm_head", dm.get("model.embed_tokens")) == dm.get("model.embed_tokens", dm.get("model"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the cuda:0 + cpu split)")
@torch.no_grad()
def test_cuda_and_cpu_split_is_exact_and_slot_state_lives_on_its_layer(folder):
    ref = SpikeWhaleForCausalLM.from_pretrained(folder).eval()
    n = ref.config.num_hidden_layers
    device_map = {"model.embed_tokens": 0, "lm_head": 0, "model.engram": 0, "model.loop_pass_embed": 0,
                  "model.hc_out_mix": "cpu", "model.hrm_refine": "cpu", "model.norm": "cpu", "mtp_heads": "cpu",
                  **{f"model.layers.{i}": 0 if i < n // 2 else "cpu" for i in range(n)}}
    split = SpikeWhaleForCausalLM.from_pretrained(folder, device_map=device_map).eval()
    ids, mask = inputs()
    want_tokens, want_logits, _, _ = decode_steps(ref, ids, mask, 9)
    tokens, logits, cache, _ = decode_steps(split, ids.cuda(), mask.cuda(), 9)
    assert torch.equal(tokens.cpu(), want_tokens)
    torch.testing.assert_close(logits.cpu(), want_logits, rtol=1e-4, atol=1e-4)  # cuDNN/cuBLAS vs CPU kernels
    for slot, (layer_idx, _) in zip(cache.layers, split.config.loop_plan.entries):
        device = execution_device(split.model.layers[layer_idx])
        assert all(t.device == device for t in slot_tensors(slot)), (layer_idx, device)


def test_the_segment_layout_is_copied_once_per_forward_for_each_other_device():
    """Each device of a multi-device map gets one copy of the forward's Memory-Cache segment layout, shared by its
    slots (it was rebuilt in every slot of every step)."""
    from spike_whale.modeling_spike_whale import ForwardContext, SegmentLayout

    positions = torch.arange(20)[None].repeat(2, 1)
    valid = torch.ones(2, 20, dtype=torch.bool)
    layout = SegmentLayout.build(positions, valid, torch.zeros(2, dtype=torch.long), 8, 0, 0, False)
    ctx = ForwardContext(positions, valid, None, True, layout)
    assert ctx.segments_on(torch.device("cpu")) is layout
    meta = ctx.segments_on(torch.device("meta"))
    assert meta is ctx.segments_on(torch.device("meta")) and meta.rel.is_meta and meta.base.is_meta
