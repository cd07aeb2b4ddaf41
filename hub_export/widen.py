"""`spike-whale widen SRC_DIR OUT_DIR --max-position-embeddings N`: a longer context for an exported folder.

The RoPE caches are rebuilt for N positions from the checkpoint's own inverse frequencies (fractal stays fractal; a
geometric rebuild "loads, generates fluent text and encodes every position wrong"); the first positions are kept
bit-for-bit and must be reproduced by the recomputation. Nothing else depends on the context length. The result is
verified like `convert` (every other tensor bit-identical, logits on a prompt inside the old context equal).
"""

from __future__ import annotations

from pathlib import Path

from .convert import report


def widen_folder(src_dir, out_dir, max_position_embeddings: int, *, overwrite: bool = False, progress: bool = True,
                 log=print):
    """Widen the exported (or released safetensors) folder `src_dir` to `max_position_embeddings`, keeping its dtype."""
    from .conversion import convert_checkpoint

    if not Path(src_dir).exists():
        raise FileNotFoundError(f"{src_dir}: no such folder")
    if not Path(src_dir).is_dir():
        raise ValueError(f"{src_dir}: widen takes a model folder (use `convert --max-position-embeddings` for files)")
    return convert_checkpoint(src_dir, out_dir, dtype=None, max_position_embeddings=max_position_embeddings,
                              overwrite=overwrite, progress=progress, command="widen", log=log)


def run(args) -> int:
    report(widen_folder(args.src_dir, args.out_dir, args.max_position_embeddings, overwrite=args.overwrite))
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "widen",
        help="widen the context of a model folder (RoPE caches rebuilt from its inv_freq)",
        description=(
            "Write a copy of SRC_DIR (an exported Hub folder or a released safetensors folder) whose context is N "
            "positions: max_position_embeddings becomes N and every RoPE cos/sin cache is rebuilt from that "
            "layer's stored inverse frequencies (fractal RoPE stays fractal); positions below the old context "
            "keep their exact values. Weights and dtype are unchanged. Verified in a fresh process like convert."
        ),
    )
    p.add_argument("src_dir", metavar="SRC_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--max-position-embeddings", type=int, required=True, metavar="N", help="new context length")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export at OUT_DIR (only after verification; never SRC_DIR)")
    p.set_defaults(func=run)
