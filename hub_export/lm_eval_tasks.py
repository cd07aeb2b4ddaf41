"""Write the local lm-evaluation-harness tasks of a model folder from its held-out text.

    python -m spike_whale.hub_export.lm_eval_tasks MODEL_DIR/heldout.txt OUT_DIR

- `spike_whale_heldout` (loglikelihood_rolling): each held-out paragraph a document; word/byte perplexity and
  bits per byte.
- `spike_whale_cloze` (multiple_choice, i.e. loglikelihood): a held-out sentence cut before its last word; the
  word against three others of the held-out text with the same length (±1), same casing.
- `spike_whale_cloze_gen` (generate_until): the same cut sentences, greedy continuation (up to 8 tokens, a full
  stop or a newline), exact match of its first word with the word.

The data files are JSON lines next to the YAML files, named relative to them (`dataset_kwargs.data_files` with
the folder made absolute by `write_tasks`, which is why the YAML is written, not committed by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

WORD = re.compile(r"^[A-Za-z]{4,12}$")


def cloze_items(text: str, n: int, seed: int = 0) -> list[dict]:
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    sentences = []
    for p in paragraphs:
        for s in re.split(r"(?<=[.!?])\s+", p):
            words = s.rstrip(".!?").split()
            if len(words) >= 8 and s.endswith(".") and WORD.match(words[-1]):
                sentences.append((" ".join(words[:-1]), words[-1]))
    vocab = sorted({w.strip(".,;:()\"'") for w in text.split()} - {""})
    vocab = [w for w in vocab if WORD.match(w)]
    rng = random.Random(seed)
    rng.shuffle(sentences)
    items = []
    for context, answer in sentences:
        pool = [w for w in vocab if abs(len(w) - len(answer)) <= 1 and w[0].isupper() == answer[0].isupper()
                and w.lower() != answer.lower()]
        if len(pool) < 3:
            continue
        choices = rng.sample(pool, 3) + [answer]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(answer), "answer": answer})
        if len(items) == n:
            break
    return items


TASKS = {
    "spike_whale_heldout": {
        "output_type": "loglikelihood_rolling", "data": "heldout.jsonl",
        "doc_to_text": "", "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}],
    },
    "spike_whale_cloze": {
        "output_type": "multiple_choice", "data": "cloze.jsonl",
        "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    },
    "spike_whale_cloze_gen": {
        "output_type": "generate_until", "data": "cloze.jsonl",
        "doc_to_text": "{{context}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": [".", "\n"], "max_gen_toks": 8, "do_sample": False},
        "filter_list": [{"name": "first_word", "filter": [
            {"function": "regex", "regex_pattern": "([A-Za-z]+)", "group_select": 0}, {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True}],
    },
}


def write_tasks(heldout_path: str, out_dir: str, n_docs: int = 40, n_cloze: int = 50) -> list[str]:
    with open(heldout_path, encoding="utf-8") as handle:
        text = handle.read()
    os.makedirs(out_dir, exist_ok=True)
    docs = [p for p in text.split("\n\n") if p.strip()][:n_docs]
    with open(os.path.join(out_dir, "heldout.jsonl"), "w", encoding="utf-8") as handle:
        for d in docs:
            handle.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    with open(os.path.join(out_dir, "cloze.jsonl"), "w", encoding="utf-8") as handle:
        for item in cloze_items(text, n_cloze):
            handle.write(json.dumps(item, ensure_ascii=False) + "\n")
    written = []
    for name, spec in TASKS.items():
        spec = dict(spec)
        data = spec.pop("data")
        config = {"task": name, "dataset_path": "json",
                  "dataset_kwargs": {"data_files": {"test": os.path.join(os.path.abspath(out_dir), data)}},
                  "test_split": "test", **spec, "metadata": {"version": 1.0}}
        path = os.path.join(out_dir, f"{name}.yaml")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2)  # JSON is YAML
            handle.write("\n")
        written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m spike_whale.hub_export.lm_eval_tasks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("heldout", help="held-out text (MODEL_DIR/heldout.txt)")
    p.add_argument("out_dir", help="folder for the task YAML and JSON-lines files")
    p.add_argument("--docs", type=int, default=40, help="held-out paragraphs in spike_whale_heldout")
    p.add_argument("--cloze", type=int, default=50, help="cloze items")
    args = p.parse_args(argv)
    if not os.path.isfile(args.heldout):
        p.error(f"{args.heldout} not found")
    for path in write_tasks(args.heldout, args.out_dir, args.docs, args.cloze):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
