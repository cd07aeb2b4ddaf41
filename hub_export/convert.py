"""`spike-whale convert SRC OUT_DIR`: a released checkpoint (`.pt`, safetensors folder, GGUF) -> verified Hub folder.

The work is `conversion.convert_checkpoint`; this module only declares the command (it imports nothing heavy, so
`--help` and argument errors answer at once).
"""

from __future__ import annotations

import json
from pathlib import Path


def read_rename_map(value: str | None) -> dict[str, str] | None:
    """`--rename-map`: inline JSON or a JSON file, {checkpoint name: model name}."""
    if value is None:
        return None
    text = value if value.lstrip().startswith("{") else None
    if text is None:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"--rename-map: cannot read {value} ({err.strerror or err})") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--rename-map: not valid JSON ({err})") from err
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError('--rename-map must be a JSON object of names, {"checkpoint name": "model name", ...}')
    return data


def check_config_arg(value: str | None) -> None:
    """`--config` is a JSON file or an inline JSON object: say which a value that is neither is not (before it is
    taken for a file name)."""
    if value is None or value.lstrip().startswith("{") or Path(value).is_file():
        return
    if Path(value).is_dir():
        raise ValueError(f"--config: {value} is a folder; give its config.json (or an inline JSON object)")
    try:
        data = json.loads(value)
    except json.JSONDecodeError:
        raise ValueError(f"--config: no such file: {value} (nor is it an inline JSON object)") from None
    kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
    raise ValueError(f"--config: {value} is a JSON {kind}, not a JSON object (nor a file)")


def report(result, log=print) -> None:
    log(f"verified: {result.verification.summary}")
    a, b = result.context
    ctx = f"context {b}" if a == b else f"context {a} -> {b}"
    log(f"wrote {result.out_dir} ({result.dtype}, {ctx}): {', '.join(result.files)}")


def add_common_arguments(p, dtype_default: str | None = "fp32") -> None:
    p.add_argument("--config", metavar="JSON", default=None,
                   help="config.json path (or inline JSON) to use instead of the config found in the source")
    p.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="released custom-format tokenizer.json (or spike_vocab.json); default: found next to SRC")
    if dtype_default is not None:
        p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=dtype_default,
                       help="weight dtype of model.safetensors (default: %(default)s, the released precision)")
    p.add_argument("--stage", default=None,
                   help="stage for the model card, e.g. sft_7100 (default: read from the source name)")
    p.add_argument("--license", default=None,
                   help="license id for the model card (default: 'other' = the source checkpoint's license)")
    p.add_argument("--license-name", default=None, help="license_name for the card when --license other")
    p.add_argument("--rename-map", metavar="JSON", default=None,
                   help='{"checkpoint name": "model name", ...} (inline or a file) applied before placing the '
                        "tensors; a name mismatch prints the candidates and the map that would fix it")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export at OUT_DIR (only after verification; never a source, never a "
                        "folder holding other files)")


def run(args) -> int:
    from .conversion import convert_checkpoint

    check_config_arg(args.config)
    result = convert_checkpoint(
        args.src, args.out_dir, config=args.config, tokenizer=args.tokenizer, dtype=args.dtype,
        max_position_embeddings=args.max_position_embeddings, stage=args.stage, license=args.license,
        license_name=args.license_name, overwrite=args.overwrite, rename_map=read_rename_map(args.rename_map),
    )
    report(result)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="released checkpoint (.pt, safetensors folder, GGUF) -> verified Hub folder",
        description=(
            "Convert a released spike_whale checkpoint into a folder that transformers loads with "
            "AutoModelForCausalLM/AutoTokenizer.from_pretrained(folder, trust_remote_code=True). SRC is a "
            "released .pt (read with torch.load(weights_only=True); state dict and config blob under the usual "
            "keys), a released safetensors folder (config.json, model.safetensors without lm_head.weight, the "
            "custom-format tokenizer.json), an exported Hub folder, or a GGUF file. The folder gets the code files, "
            "config.json with auto_map, model.safetensors, the tokenizer files, generation_config.json (serving "
            "defaults), a README model card and provenance.json (sha256 of source and outputs). It is verified "
            "in a fresh process before it appears at OUT_DIR: every tensor bit-identical to the source and the "
            "logits on a fixed prompt equal; on any failure nothing is left behind."
        ),
    )
    p.add_argument("src", metavar="SRC", help="released .pt, safetensors folder, Hub folder or .gguf")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (must not exist or be empty)")
    p.add_argument("--max-position-embeddings", type=int, default=None, metavar="N",
                   help="widen the context to N positions: RoPE caches rebuilt from the checkpoint's own inverse "
                        "frequencies (fractal stays fractal), the first positions unchanged")
    add_common_arguments(p)
    p.set_defaults(func=run)
