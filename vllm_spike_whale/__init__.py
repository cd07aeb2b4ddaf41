"""vLLM plugin for spike_whale (SpikeWhale v2): registered through the `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts; the model class is given as a string, so vLLM imports it (and
torch's heavier parts) only where a spike_whale folder is served."""

# The `architectures` names a spike_whale config.json carries (`SpikeWhaleLM` is the Hub module's alias).
ARCHITECTURES = ("SpikeWhaleForCausalLM", "SpikeWhaleLM")


def register() -> None:
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, "vllm_spike_whale.model:SpikeWhaleForCausalLM")
