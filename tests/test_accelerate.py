"""accelerate big-model inference through the Auto classes and remote code: an explicit CPU/disk device map
generates exactly what the plain model does (the placement tests are in test_device_map.py)."""

from conftest import open_gates

from spike_whale.hub_export.folder import save_hub_folder
from spike_whale.hub_export.init_tiny import build_tiny


def test_cpu_disk_offload_generates_identically(tmp_path, fresh_python):
    model, tok = build_tiny(seed=4, mc_segment_len=8)
    open_gates(model)
    folder = tmp_path / "tiny"
    save_hub_folder(model, tok, folder)
    out = fresh_python(f"""
        import torch
        from transformers import AutoModelForCausalLM
        folder = {str(folder)!r}
        ref = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        torch.manual_seed(0)
        ids = torch.randint(4, 2000, (2, 21)); mask = torch.ones_like(ids); mask[0, :3] = 0
        device_map = {{
            "model.embed_tokens": "cpu", "lm_head": "cpu", "model.engram": "disk", "model.layers.0": "cpu",
            "model.layers.1": "disk", "model.layers.2": "cpu", "model.layers.3": "disk",
            "model.loop_pass_embed": "disk", "model.hc_out_mix": "disk", "model.hrm_refine": "disk",
            "model.norm": "cpu", "mtp_heads": "disk",
        }}
        dispatched = AutoModelForCausalLM.from_pretrained(
            folder, trust_remote_code=True, device_map=device_map, offload_folder={str(tmp_path / 'offload')!r}).eval()
        assert hasattr(dispatched, "hf_device_map")
        with torch.no_grad():
            a = ref.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
            b = dispatched.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
            la = ref(ids, attention_mask=mask).logits
            lb = dispatched(ids, attention_mask=mask).logits
        print("SAME", bool((a == b).all()), (la - lb).abs().max().item())
    """)
    same, diff = out.split("SAME")[1].split()
    assert same == "True" and float(diff) == 0.0
