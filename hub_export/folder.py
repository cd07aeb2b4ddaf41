"""Write a model + tokenizer as a Hub-style folder that loads with the Auto classes and trust_remote_code.

`save_hub_folder` writes the weights, config (with `auto_map`), the flat code files, the tokenizer files and the
serving `generation_config.json`. `write_model_card` adds the README model card (huggingface_hub `ModelCard`,
offline) and `write_provenance` the `provenance.json` (sha256 of the source and of every output file, versions).
`EXPORT_FILES` is the exact file set of an exported folder: what a user needs to load it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
from pathlib import Path

CODE_FILES = ("configuration_spike_whale.py", "modeling_spike_whale.py", "generation_utils.py", "tokenization_spike.py",
              "tokenization_spike_fast.py")
TOKENIZER_FILES = ("spike_vocab.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CARD_FILE = "README.md"
PROVENANCE_FILE = "provenance.json"
EXPORT_FILES = tuple(sorted((
    "config.json", "generation_config.json", "model.safetensors", *CODE_FILES, *TOKENIZER_FILES, CARD_FILE,
    PROVENANCE_FILE,
)))
TRANSFORMERS_RANGE = ">=5.24,<5.40"
DEFAULT_LICENSE = "other"


def register_auto_classes() -> None:
    """Make `save_pretrained`/`push_to_hub` write `auto_map` and copy the flat code files."""
    from ..modeling_spike_whale import SpikeWhaleForCausalLM
    from ..tokenization_spike import SpikeTokenizer
    from ..tokenization_spike_fast import SpikeTokenizerFast

    SpikeWhaleForCausalLM.config_class.register_for_auto_class("AutoConfig")
    SpikeWhaleForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    SpikeTokenizer.register_for_auto_class("AutoTokenizer")
    SpikeTokenizerFast.register_for_auto_class("AutoTokenizer")


def save_hub_folder(model, tokenizer, out_dir: str | os.PathLike) -> str:
    """Save weights (safetensors, tied head stored once), config with `auto_map`, the code files, the
    tokenizer (slow + fast: spike_vocab.json and tokenizer.json, config with its `auto_map`, ChatML template) and the
    serving `generation_config.json`.
    (The model and tokenizer modules are imported here, not at the top: `push` reads this module's file lists.)"""
    from .serving import serving_generation_config
    from ..tokenization_spike_fast import SpikeTokenizerFast

    register_auto_classes()
    if not isinstance(tokenizer, SpikeTokenizerFast):  # the folder ships both; the fast one writes both vocab files
        kept = ("add_bos_token", "model_max_length", "padding_side", "chat_template")
        tokenizer = SpikeTokenizerFast(tokenizer.vocab_data, **{key: getattr(tokenizer, key) for key in kept})
    os.makedirs(out_dir, exist_ok=True)
    model.generation_config = serving_generation_config(model.config)
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


# ---------------------------------------------------------------------------------------------------------------
# provenance
# ---------------------------------------------------------------------------------------------------------------

def sha256_file(path: str | os.PathLike, progress: bool = False) -> str:
    from tqdm import tqdm

    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as handle, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {Path(path).name}",
                                          disable=None if (progress and size > 64 << 20) else True) as bar:
        for block in iter(lambda: handle.read(8 << 20), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("spike-whale", "torch", "transformers", "safetensors", "huggingface_hub", "tokenizers", "gguf",
                 "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def write_provenance(folder: str | os.PathLike, *, source: dict, conversion: dict, verification: dict | None,
                     progress: bool = False) -> dict:
    """`provenance.json`: the source (path, kind, sha256 of each file), the sha256 of every other file of `folder`,
    the versions used, what the conversion did and the verification result. Written last."""
    folder = Path(folder)
    outputs = {p.name: {"sha256": sha256_file(p, progress), "bytes": p.stat().st_size}
               for p in sorted(folder.iterdir()) if p.is_file() and p.name != PROVENANCE_FILE}
    data = {
        "tool": "spike-whale (spike_whale.hub_export)",
        "created_utc": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "source": source,
        "outputs": outputs,
        "versions": versions(),
        "conversion": conversion,
        "verification": verification,
    }
    (folder / PROVENANCE_FILE).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return data


# ---------------------------------------------------------------------------------------------------------------
# model card
# ---------------------------------------------------------------------------------------------------------------

CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

A SpikeWhale v2 / Byrne looped decoder (`model_type: spike_whale`), packaged for 🤗 transformers as remote code.
The same {{ layers }}-layer stack runs {{ loops }} times with shared weights ({{ slots }} loop slots, each with its
own K/V and Memory-Cache state): MLA attention with QK-norm, {{ rope }} RoPE and XSA, depth attention,
a Memory Cache branch, Hyper-Connections, Engram n-gram memory, HRM refinement and an MTP head.

| | |
|---|---|
| stage | {{ stage }} |
| context | {{ context }} tokens (a position past it raises; it never wraps) |
| parameters | {{ params }} |
| weights | `model.safetensors`, {{ dtype }}; the tied output head is stored once and re-tied on load |
| vocabulary | {{ vocab_size }} ids, byte-level Length-MAX, greedy longest match (`spike_vocab.json`) |
| transformers | `{{ transformers_range }}` |

## How to load

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

repo = "{{ repo }}"  # a Hub repo id or this folder
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()

inputs = tokenizer("The capital of France is", return_tensors="pt")  # <bos> is prepended
out = model.generate(**inputs, max_new_tokens=40)  # generation_config.json: temperature 0.7, top_k 40, repetition_penalty 1.3
print(tokenizer.decode(out[0], skip_special_tokens=True))
```

`trust_remote_code=True` runs the code files of this repo (`configuration_spike_whale.py`, `modeling_spike_whale.py`,
`generation_utils.py`, `tokenization_spike.py`, `tokenization_spike_fast.py`); read them first. Install `transformers{{ transformers_range }}`
(the remote code uses the 5.x `cache` argument; the `past_key_values` alias goes away in 5.40).

- Scoring (perplexity, multiple choice): `model(input_ids, use_cache=False).logits`, with `<bos>` first.
- Generation uses the model's own loop-slot cache (`SpikeWhaleCache`: K/V per loop slot plus Memory-Cache
  state); cached decode computes the same function as a full recompute.
- {{ chat_note }}
- Greedy decoding is for identity tests; the serving defaults are in `generation_config.json`.

## Exactness

Converted from `{{ source_name }}` ({{ source_kind }}) by `spike-whale {{ command }}`. After writing, the folder was loaded
in a fresh process through `AutoModelForCausalLM` / `AutoTokenizer` and compared with the source:
**{{ verify_summary }}** (every tensor bit-identical, logits on a fixed prompt equal).
{{ exact_note }}
`provenance.json` has the sha256 of the source and of every file here, and the versions used.
{% if notes %}
Conversion notes:

{% for note in notes -%}
- {{ note }}
{% endfor %}
{% endif -%}
## License

{{ license_text }}
"""


def _count_params(model) -> str:
    n = sum(p.numel() for p in model.parameters())
    return f"{n:,}" if n < 1_000_000 else f"{n / 1e6:.1f}M ({n:,})"


def write_model_card(
    folder: str | os.PathLike,
    model,
    *,
    stage: str | None,
    source_name: str,
    source_kind: str,
    verify_summary: str,
    exact_note: str = "",
    notes: list[str] | None = None,
    license: str | None = None,
    license_name: str | None = None,
    repo: str | None = None,
    command: str = "convert",
) -> Path:
    """Write README.md (huggingface_hub `ModelCard` from a template; no network)."""
    from huggingface_hub import ModelCard, ModelCardData

    config = model.config
    license = license or DEFAULT_LICENSE
    kind = (stage or "").split("_")[0].lower()
    stage_text = {
        "base": "pretrained base: continues text; score it as a language model",
        "sft": "supervised fine-tune (ChatML)",
        "dpo": "DPO on top of SFT (ChatML)",
    }.get(kind, "unspecified")
    tags = ["custom_code", "spike_whale", "looped-transformer", "text-generation"]
    if kind in ("base", "sft", "dpo"):
        tags.append(kind)
    extra = {}
    if license == "other":
        extra = {"license_name": license_name or "same-as-source",
                 "license_link": "LICENSE" if license_name else None}
        extra = {k: v for k, v in extra.items() if v}
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", license=license, tags=tags,
                         **extra)
    if license == "other":
        license_text = ("The weights keep the license of the source checkpoint they were converted from (`license: other` "
                        "here; set it with `spike-whale convert --license`). The conversion code is Apache-2.0.")
    else:
        license_text = f"`{license}`."
    chat_note = ("SFT/DPO stages want ChatML: `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` "
                 "(`chat_template.jinja`); generation stops at `<|im_end|>` or `<eos>`."
                 if kind in ("sft", "dpo") else
                 "A ChatML template ships (`chat_template.jinja`); a base model continues text and will not answer "
                 "questions because of it.")
    title = f"spike_whale {stage}" if stage else f"spike_whale ({Path(source_name).stem})"
    card = ModelCard.from_template(
        data,
        template_str=CARD_TEMPLATE,
        title=title,
        layers=config.num_hidden_layers,
        loops=config.loop_count,
        slots=config.num_loop_slots,
        rope="fractal (Cantor)" if config.use_fractal_rope else "geometric",
        stage=f"{stage} — {stage_text}" if stage else stage_text,
        context=f"{config.max_position_embeddings:,}",
        params=_count_params(model),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        vocab_size=f"{config.vocab_size:,}",
        transformers_range=TRANSFORMERS_RANGE,
        repo=repo or "<user>/<repo>",
        chat_note=chat_note,
        source_name=source_name,
        source_kind=source_kind,
        verify_summary=verify_summary,
        exact_note=exact_note,
        notes=notes or [],
        license_text=license_text,
        command=command,
    )
    path = Path(folder) / CARD_FILE
    card.save(str(path))
    return path
