"""Shared test fixtures: tiny configs that exercise every mechanism, with the zero-init gates opened."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from spike_whale import SpikeWhaleConfig, SpikeWhaleForCausalLM

# Names of the parameters that start at zero (or at an exact no-op) so that a broken mechanism would be
# invisible at init; tests open them so that every mechanism changes the output.
ZERO_INIT_GATES = (
    "mc_gate", "depth_gate", "loop_pass_embed", "hrm_refine.up", "mtp_heads", "pre_logits", "post_scale",
    "mix_logits", "gate_bias", "elo_gain", "ve_gate", "engram_fusion.o_proj",
)


def tiny_config(**overrides) -> SpikeWhaleConfig:
    """hidden 64, 4 layers × 2 loops (8 slots), depth stride 2, Memory-Cache segments of 8 tokens."""
    return SpikeWhaleConfig.from_preset("tiny", **{"mc_segment_len": 8, "max_position_embeddings": 256, **overrides})


def open_gates(model: torch.nn.Module, std: float = 0.5, seed: int = 1) -> torch.nn.Module:
    """Give every zero-init gate / pass embedding / MTP & HRM projection a non-zero value.

    Scalar-like gates get N(0, std); weight matrices and embeddings get N(0, initializer_range) so that no
    single mechanism drowns the others out.
    """
    g = torch.Generator().manual_seed(seed)
    small = getattr(getattr(model, "config", None), "initializer_range", 0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ZERO_INIT_GATES):
                scale = std if p.numel() <= 8 else small
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def tiny_model(seed: int = 0, gates_open: bool = True, **overrides) -> SpikeWhaleForCausalLM:
    torch.manual_seed(seed)
    model = SpikeWhaleForCausalLM(tiny_config(**overrides)).eval()
    return open_gates(model) if gates_open else model


# The child processes the tests start (CLI runs, fresh interpreters) are single-threaded too: under pytest-xdist two
# workers share the 2 cores, and children with a thread per core would oversubscribe them.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and when the 2 cores are shared OpenMP's spinning makes
    them 10-40x slower; run the tests single-threaded (`run_fresh_python` children follow)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_compiled_products_carried_over():
    """The compiled walks' product choices are a per-process table (`COMPILED_PRODUCTS`); a test's forced or faked
    choices end with it."""
    yield
    from spike_whale.accel.kernels import COMPILED_PRODUCTS

    COMPILED_PRODUCTS.clear()


@pytest.fixture
def make_tiny_model():
    return tiny_model


def run_fresh_python(code: str, tmp_path, timeout: int = 240) -> str:
    """Run `code` in a fresh interpreter (remote-code loading must not see this process's registrations)."""
    # The child uses this process's thread count, so float reductions run in the same order and logits
    # computed on both sides compare bit for bit.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TRANSFORMERS_VERBOSITY="error",
               OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=timeout,
        cwd=str(tmp_path),
    )
    if proc.returncode != 0:
        raise AssertionError(f"fresh subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


@pytest.fixture
def fresh_python(tmp_path):
    return lambda code, timeout=240: run_fresh_python(code, tmp_path, timeout)
