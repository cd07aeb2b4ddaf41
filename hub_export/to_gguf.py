"""`spike-whale to-gguf SRC OUT.gguf --type f16|q8_0`: write a released checkpoint as a spike_whale GGUF.

See `gguf_io` for the layout. After writing, the file is read back and every tensor is compared with the source
(f16 max |Δ| <= 0.008, q8_0 <= 0.079 per tensor; F32-stored tensors exact) and the tokenizer vocabulary byte for
byte; the file appears at OUT.gguf only if that check passes.
"""

from __future__ import annotations

from pathlib import Path

from .convert import read_rename_map


def checkpoint_to_gguf(src, out_path, qtype: str = "f16", *, config=None, tokenizer=None, name=None,
                       overwrite: bool = False, rename_map=None, progress: bool = True, log=print):
    """Read `src`, check it places into the model, write it as GGUF at `out_path` (never over a source file, an
    existing file only with `overwrite`) and check the round trip; returns the `gguf_io.GGUFReport`."""
    import torch

    from .checkpoint import CheckpointKeyError, prepare_state_dict
    from .gguf_io import write_gguf
    from .output_paths import check_destination, config_file, remove_stale_temps
    from .sources import load_checkpoint

    out_path = Path(out_path)
    check_destination(out_path, [src, tokenizer, config_file(config)], overwrite=overwrite, kind="file", magic=b"GGUF")
    remove_stale_temps(out_path.absolute().parent)
    ckpt = load_checkpoint(src, config=config, tokenizer=tokenizer, progress=progress, rename_map=rename_map)
    check_destination(out_path, [ckpt.source, *ckpt.source_files], overwrite=overwrite, kind="file", magic=b"GGUF")
    # Same placement checks as convert: nothing unplaceable, nothing missing, shapes right, tied head consistent.
    try:
        ckpt.state_dict = prepare_state_dict(ckpt.state_dict, ckpt.config, torch.float32, str(ckpt.source))
    except CheckpointKeyError as err:
        for line in err.report.lines():
            log(line)
        raise
    return write_gguf(ckpt, out_path, qtype, name=name, progress=progress)


def run(args) -> int:
    rep = checkpoint_to_gguf(args.src, args.out, args.type, config=args.config, tokenizer=args.tokenizer,
                             name=args.name, overwrite=args.overwrite, rename_map=read_rename_map(args.rename_map))
    worst, delta = rep.worst
    types = ", ".join(f"{n} {t}" for t, n in sorted(rep.types.items()))
    print(f"round trip: {rep.tensors} tensors ({types}), max |Δ| {delta:.4g} ({worst}) <= {rep.bound}; "
          "tokenizer byte-faithful")
    print(f"wrote {rep.path}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "to-gguf",
        help="write a checkpoint as a spike_whale GGUF (f16 or q8_0), round-trip checked",
        description=(
            "Write SRC (.pt, safetensors folder, Hub folder or GGUF) as a GGUF file for the spike_whale engine "
            "(architecture spike_whale, tensors under their state-dict names, the full config in "
            "spike_whale.config_json, tokenizer tokens byte-faithful, RoPE caches not stored). Not a llama.cpp "
            "model. --type f16 stores matrices in F16, q8_0 in Q8_0 where rows allow; 1-D tensors, buffers and the "
            "Engram compressor stay F32. The file is re-read and checked against the bounds "
            "(f16 max |Δ| <= 0.008, q8_0 <= 0.079 per tensor) before it is put in place."
        ),
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument("--type", choices=("f16", "q8_0"), required=True, help="storage type of the matrices")
    p.add_argument("--config", metavar="JSON", default=None, help="config.json path or inline JSON (replaces SRC's)")
    p.add_argument("--tokenizer", metavar="PATH", default=None, help="custom-format tokenizer.json / spike_vocab.json")
    p.add_argument("--name", default=None, help="general.name of the GGUF")
    p.add_argument("--rename-map", metavar="JSON", default=None,
                   help='{"checkpoint name": "model name", ...} (inline or a file) applied before placing the tensors')
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing GGUF file at OUT.gguf (never a source file, never a non-GGUF file)")
    p.set_defaults(func=run)
