"""lm-evaluation-harness for spike_whale: the `spike_whale` model class and `spike-whale lm-eval`.

lm-eval's `hf` model scores a continuation by encoding context + continuation as one string and keeping the tokens
after the context's own encoding. With a Length-MAX vocabulary a token can span that boundary (`'was quiet '`
holds the context's last word and the continuation's space), so those tokens are the wrong span, or none at all
(`assert len(continuation_enc) > 0`). `SpikeWhaleLM` (registered as `--model spike_whale`) encodes the two
separately: `<bos>` + context, then the continuation on its own, so every request type scores exactly the
continuation's bytes; rolling loglikelihood scores the text's tokens after one `<bos>` (the model was trained with
`<bos>` before every sequence; `hf` would also score the tokenizer's own `<bos>`); `generate_until` is `hf`'s.

    spike-whale lm-eval --model spike_whale --model_args pretrained=DIR --tasks TASKS --include_path TASK_DIR

passes everything after `lm-eval` to lm-eval's own command line, with the class registered. From Python, import
this module and call `lm_eval.simple_evaluate(model="spike_whale", ...)`. lm-eval is an optional extra:
`pip install -e ".[lm-eval]"`.
"""

from __future__ import annotations

import sys

MODEL_NAME = "spike_whale"


def _define():
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM

    class SpikeWhaleLM(HFLM):
        """HFLM with exact continuation scoring for byte-level Length-MAX vocabularies (see the module docstring)."""

        def __init__(self, pretrained, trust_remote_code: bool = True, **kwargs):
            super().__init__(pretrained=pretrained, trust_remote_code=trust_remote_code, **kwargs)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                       **kwargs) -> list[int]:
            """The text's own tokens; `<bos>` in front only when asked for explicitly."""
            ids = self.tokenizer(string, add_special_tokens=False)["input_ids"]
            if add_special_tokens:
                ids = [self.prefix_token_id] + ids
            return ids[-left_truncate_len:] if left_truncate_len else ids

        def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            """(`<bos>` + context tokens, continuation tokens), each encoded on its own: no token crosses."""
            return [self.prefix_token_id] + self.tok_encode(context), self.tok_encode(continuation)

    register_model(MODEL_NAME)(SpikeWhaleLM)
    return SpikeWhaleLM


def register_lm_eval_model():
    """Register (once) and return the `spike_whale` lm-eval model class; a clear error when lm-eval is missing."""
    global _REGISTERED
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ImportError('lm-evaluation-harness is not installed: pip install -e ".[lm-eval]"') from None
    if _REGISTERED is None:
        _REGISTERED = _define()
    return _REGISTERED


_REGISTERED = None


def run(args) -> int:
    try:
        register_lm_eval_model()
    except ImportError as exc:
        raise RuntimeError(str(exc)) from None
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    argv = list(args.lm_eval_args)
    if not argv or argv[0] in ("-h", "--help"):
        print("spike-whale lm-eval: lm-eval's command line with `--model spike_whale` registered (exact continuation "
              "scoring for Length-MAX vocabularies); lm-eval's own help follows.\n", flush=True)
    saved = sys.argv
    sys.argv = ["lm-eval"] + argv
    try:
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    finally:
        sys.argv = saved
    return 0


def register(sub) -> None:
    import argparse

    # Every argument, options included, belongs to lm-eval (its --help too): no option of our own to parse.
    p = sub.add_parser("lm-eval", help="lm-evaluation-harness with the exact-continuation spike_whale model class",
                       description=__doc__.split("\n\n", 1)[1].strip(), prefix_chars="+", add_help=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER,
                   help="lm-eval's own arguments, e.g. --model spike_whale --model_args pretrained=DIR --tasks ...")
    p.set_defaults(func=run)
