"""vLLM plugin for spike_whale (SpikeWhale v2): registered through the `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts; the model class is given as a string, so vLLM imports it (and
torch's heavier parts) only where a spike_whale folder is served."""

import copyreg
import functools
import sys

# The `architectures` names a spike_whale config.json carries (`SpikeWhaleLM` is the Hub module's alias).
ARCHITECTURES = ("SpikeWhaleForCausalLM", "SpikeWhaleLM")


def register() -> None:
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, "vllm_spike_whale.model:SpikeWhaleForCausalLM")
    if sys.version_info < (3, 12):
        # vLLM sends the config to its engine process with cloudpickle, which pickles trust_remote_code classes by
        # value, and before Python 3.12 a `functools.cached_property` (the config's `LoopPlan.runs`) holds an RLock
        # that cannot be pickled. Pickle it as its function and attribute name instead.
        copyreg.pickle(functools.cached_property, _reduce_cached_property)


def _reduce_cached_property(prop: functools.cached_property):
    return _cached_property, (prop.func, prop.attrname)


def _cached_property(func, attrname):
    prop = functools.cached_property(func)
    prop.attrname = attrname  # what __set_name__ sets when the class is built; a rebuilt class only sets attributes
    return prop
