"""`spike-whale push DIR REPO_ID [--private] [--revision BRANCH]`: upload an exported folder to the Hub.

Uses huggingface_hub (`HfApi().create_repo` + `upload_folder`; the token comes from the usual places: `HF_TOKEN`
or `hf auth login`). Only the files a user needs to load the repo are committed (`folder.EXPORT_FILES`), and the
folder is checked first: every one of them present, `auto_map` in config.json and tokenizer_config.json.
`--revision step-62000` pushes to a branch (created if needed), one per checkpoint step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi

from .folder import CODE_FILES, EXPORT_FILES


@dataclass
class PushResult:
    repo_id: str
    revision: str | None
    files: list[str]
    skipped: list[str]
    commit_url: str | None


def check_export_folder(folder: str | Path) -> tuple[list[str], list[str]]:
    """(files to upload, other files) of an exported folder; a `ValueError` if it cannot be loaded from the Hub."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    present = sorted(p.name for p in folder.iterdir() if p.is_file())
    missing = [f for f in EXPORT_FILES if f not in present]
    if missing:
        raise ValueError(f"{folder} is not a complete export (missing {missing}); write it with `spike-whale convert`")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    auto = config.get("auto_map") or {}
    if not {"AutoConfig", "AutoModelForCausalLM"} <= set(auto):
        raise ValueError(f"{folder}/config.json has no auto_map for AutoConfig/AutoModelForCausalLM")
    tok = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    if "AutoTokenizer" not in (tok.get("auto_map") or {}):
        raise ValueError(f"{folder}/tokenizer_config.json has no auto_map for AutoTokenizer")
    for entry in [*auto.values(), *(tok["auto_map"]["AutoTokenizer"] if isinstance(tok["auto_map"]["AutoTokenizer"], list)
                                    else [tok["auto_map"]["AutoTokenizer"]])]:
        if entry and f"{entry.split('.')[0]}.py" not in CODE_FILES:
            raise ValueError(f"auto_map entry {entry!r} points to a file that is not one of the code files")
    files = [f for f in present if f in EXPORT_FILES]
    return files, [f for f in present if f not in EXPORT_FILES]


def push_folder(folder, repo_id: str, *, private: bool = False, revision: str | None = None,
                commit_message: str | None = None, api: HfApi | None = None) -> PushResult:
    files, skipped = check_export_folder(folder)
    api = api or HfApi()
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id=repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
            allow_patterns=files, commit_message=commit_message or f"Upload spike_whale export ({len(files)} files)",
        )
    except Exception as err:  # HTTP / auth / offline errors of huggingface_hub, as one line for the CLI
        first = " ".join(str(err).split())[:300]
        raise RuntimeError(f"push to {repo_id} failed: {type(err).__name__}: {first}") from err
    return PushResult(repo_id, revision, files, skipped, getattr(info, "commit_url", None))


def run(args) -> int:
    res = push_folder(args.dir, args.repo_id, private=args.private, revision=args.revision,
                      commit_message=args.commit_message)
    where = f"{res.repo_id}@{res.revision}" if res.revision else res.repo_id
    print(f"pushed {len(res.files)} files to {where}: {', '.join(res.files)}")
    if res.skipped:
        print(f"not uploaded (not part of the export): {', '.join(res.skipped)}")
    if res.commit_url:
        print(res.commit_url)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "push",
        help="upload an exported folder to the Hugging Face Hub",
        description=(
            "Create REPO_ID if needed (HfApi.create_repo) and upload the exported folder DIR (HfApi.upload_folder): "
            "exactly the files a user needs - config.json, generation_config.json, model.safetensors, the four code "
            "files, spike_vocab.json, tokenizer_config.json, chat_template.jinja, README.md and provenance.json. "
            "The token comes from HF_TOKEN or `hf auth login`."
        ),
    )
    p.add_argument("dir", metavar="DIR", help="folder written by convert / from-gguf / widen")
    p.add_argument("repo_id", metavar="REPO_ID", help="e.g. me/byrne-100m-ultra-mc-sft")
    p.add_argument("--private", action="store_true", help="create the repo as private (ignored if it exists)")
    p.add_argument("--revision", metavar="BRANCH", default=None,
                   help="branch to push to, created if needed (e.g. step-7100, one per checkpoint step)")
    p.add_argument("--commit-message", default=None)
    p.set_defaults(func=run)
