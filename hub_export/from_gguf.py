"""`spike-whale from-gguf SRC.gguf OUT_DIR`: a spike_whale GGUF -> verified Hub folder.

The tensors are dequantized to float32 (the folder holds exactly the GGUF's values), the config comes from
`spike_whale.config_json`, the tokenizer from the GGUF tokens, and the RoPE caches (not stored in GGUF) are rebuilt
with the checkpoint's schedule: the stored inv_freq if present, else the config's (fractal stays fractal).
"""

from __future__ import annotations

from .convert import add_common_arguments, check_config_arg, read_rename_map, report


def run(args) -> int:
    from .conversion import convert_checkpoint

    check_config_arg(args.config)

    result = convert_checkpoint(
        args.src, args.out_dir, config=args.config, tokenizer=args.tokenizer, dtype=args.dtype,
        max_position_embeddings=args.max_position_embeddings, stage=args.stage, license=args.license,
        license_name=args.license_name, overwrite=args.overwrite, expect_kind="gguf", command="from-gguf",
        rename_map=read_rename_map(args.rename_map),
    )
    report(result)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "from-gguf",
        help="spike_whale GGUF (f16/q8_0) -> verified Hub folder",
        description=(
            "Import a spike_whale GGUF (architecture spike_whale, config in spike_whale.config_json) as a folder "
            "that AutoModelForCausalLM/AutoTokenizer load with trust_remote_code=True. Tensors are dequantized "
            "(float32 by default), RoPE caches rebuilt with the checkpoint's own schedule (fractal stays fractal), "
            "and the folder is verified in a fresh process (bit-identical to the dequantized GGUF, logits equal) "
            "before it appears at OUT_DIR."
        ),
    )
    p.add_argument("src", metavar="SRC.gguf")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--max-position-embeddings", type=int, default=None, metavar="N",
                   help="also widen the context to N positions")
    add_common_arguments(p)
    p.set_defaults(func=run)
