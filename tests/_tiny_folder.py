"""A tiny spike_whale model folder (every mechanism on, gates open) shared by the chat/eval/diagnose tests."""

from __future__ import annotations

import os

from conftest import tiny_model


def write_tiny_folder(path, seed: int = 0, **overrides) -> str:
    from spike_whale.hub_export.folder import save_hub_folder
    from spike_whale.hub_export.train_tokenizer import build_demo_tokenizer

    model = tiny_model(seed=seed, **overrides)
    tokenizer = build_demo_tokenizer(model_max_length=model.config.max_position_embeddings)
    save_hub_folder(model, tokenizer, path)
    return os.fspath(path)


def load_folder(path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    return tokenizer, model
