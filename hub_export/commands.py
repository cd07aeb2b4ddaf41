"""The `spike-whale` subcommands: name -> (module in hub_export, one-line help). One line per command.

A module is imported only when its command is run or its `--help` is asked for, so `spike-whale --help` and
`--version` never import torch or transformers. Each module exposes `register(subparsers)`, which adds the parser
under the same name and help, and keeps its heavy imports inside its functions so that its own `--help` and
argument errors answer at once too.
"""

COMMANDS = {
    "init-tiny": ("init_tiny", "write a small random spike_whale + tokenizer as a Hub-style folder"),
    "generate": ("generate_text", "generate text from a model folder (Auto classes, trust_remote_code)"),
    "convert": ("convert", "released checkpoint (.pt, safetensors folder, GGUF) -> verified Hub folder"),
    "to-gguf": ("to_gguf", "write a checkpoint as a spike_whale GGUF (f16 or q8_0), round-trip checked"),
    "from-gguf": ("from_gguf", "spike_whale GGUF (f16/q8_0) -> verified Hub folder"),
    "widen": ("widen", "widen the context of a model folder (RoPE caches rebuilt from its inv_freq)"),
    "push": ("push", "upload an exported folder to the Hugging Face Hub"),
    "verify": ("verify", "check that cached generation == full recompute on a checkpoint folder"),
    "eval": ("perplexity", "perplexity and bits per byte of text files (sliding window)"),
    "chat": ("chat", "multi-turn chat in the terminal, or JSON lines on stdin (scripts)"),
    "diagnose": ("diagnose", "engine diagnostics: MC knock-out, RoPE swap, loop passes, compare, context"),
    "lm-eval": ("lm_eval_harness", "lm-evaluation-harness with the exact-continuation spike_whale model class"),
    "train-tokenizer": ("train_tokenizer", "train a Length-MAX vocabulary on text files -> tokenizer folder"),
    "finetune": ("finetune", "fine-tune a model folder on a text file (one process, or DDP/FSDP2 under accelerate)"),
}
