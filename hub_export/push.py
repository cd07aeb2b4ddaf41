"""`spike-whale push DIR REPO_ID [--private] [--revision BRANCH]`: upload an exported folder to the Hub.

Uses huggingface_hub (`HfApi().create_repo` + `upload_folder`; the token comes from the usual places: `HF_TOKEN`
or `hf auth login`). Only the files a user needs to load the repo are committed (`folder.EXPORT_FILES`), and the
folder is checked first: every one of them present, `auto_map` in config.json and tokenizer_config.json.
`--revision step-62000` pushes to a branch (created if needed), one per checkpoint step. Before anything is sent,
every file is checked against the sha256 and size `provenance.json` recorded when the folder was written: a folder
changed since (e.g. new weights written over an old export) is refused.

Every network call is bounded: the server's whole answer to a request must arrive within `--timeout` seconds of the
request being sent (huggingface_hub's client has no bound by default, and httpx's timeout bounds each read, which a
server sending a byte now and then never trips). A transient failure (timeout, connection error, HTTP 429/5xx) is
retried `--retries` times with a growing pause, and each step prints a progress line.
"""

from __future__ import annotations

import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from .folder import CODE_FILES, EXPORT_FILES, PROVENANCE_FILE, sha256_file

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_RETRIES = 3


@dataclass
class PushResult:
    repo_id: str
    revision: str | None
    files: list[str]
    skipped: list[str]
    commit_url: str | None


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({' '.join(str(err).split())[:120]})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found a {type(data).__name__}")
    return data


def check_export_folder(folder: str | Path) -> tuple[list[str], list[str]]:
    """(files to upload, other files) of an exported folder; a `ValueError` if it cannot be loaded from the Hub."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    present = sorted(p.name for p in folder.iterdir() if p.is_file())
    missing = [f for f in EXPORT_FILES if f not in present]
    if missing:
        raise ValueError(f"{folder} is not a complete export (missing {missing}); write it with `spike-whale convert`")
    config, tok = (_json_object(folder / name) for name in ("config.json", "tokenizer_config.json"))
    auto = config.get("auto_map") or {}
    if not {"AutoConfig", "AutoModelForCausalLM"} <= set(auto):
        raise ValueError(f"{folder}/config.json has no auto_map for AutoConfig/AutoModelForCausalLM")
    if "AutoTokenizer" not in (tok.get("auto_map") or {}):
        raise ValueError(f"{folder}/tokenizer_config.json has no auto_map for AutoTokenizer")
    for entry in [*auto.values(), *(tok["auto_map"]["AutoTokenizer"] if isinstance(tok["auto_map"]["AutoTokenizer"], list)
                                    else [tok["auto_map"]["AutoTokenizer"]])]:
        if entry and f"{entry.split('.')[0]}.py" not in CODE_FILES:
            raise ValueError(f"auto_map entry {entry!r} points to a file that is not one of the code files")
    files = [f for f in present if f in EXPORT_FILES]
    check_provenance(folder, files)
    return files, [f for f in present if f not in EXPORT_FILES]


def check_provenance(folder: Path, files: list[str]) -> None:
    """Every file to upload must have the size and sha256 `provenance.json` recorded for it."""
    try:
        outputs = json.loads((folder / PROVENANCE_FILE).read_text(encoding="utf-8"))["outputs"]
        if not isinstance(outputs, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{folder}/{PROVENANCE_FILE} is not a valid provenance record (no 'outputs' object); "
                         "re-export the folder with `spike-whale convert`") from err
    unrecorded = [f for f in files if f != PROVENANCE_FILE and f not in outputs]
    if unrecorded:
        raise ValueError(f"{folder}: {PROVENANCE_FILE} has no checksum for {unrecorded}; the folder changed after it "
                         "was written (re-export it with `spike-whale convert`)")
    changed = []
    for name in files:
        if name == PROVENANCE_FILE:
            continue
        record, path = outputs[name], folder / name
        if not isinstance(record, dict) or record.get("bytes") != path.stat().st_size or \
                record.get("sha256") != sha256_file(path, progress=True):
            changed.append(name)
    if changed:
        raise ValueError(f"{folder}: {changed} differ from the checksums in {PROVENANCE_FILE}: the folder changed after "
                         "it was written; refusing to upload it (re-export it with `spike-whale convert`)")


def http_library():
    """The HTTP library huggingface_hub's client is built on (httpx2 from huggingface_hub 2, httpx before)."""
    from huggingface_hub.utils import _http

    return getattr(_http, "httpx2", None) or _http.httpx


class _AnswerDeadline:
    """A connection's network stream on which the reads of each answer end `timeout` seconds after the request was
    sent. Writing a request restarts the clock: the time taken to send an upload is not the server's."""

    def __init__(self, stream, timeout: float, expired: type[Exception]):
        self._stream, self._timeout, self._expired = stream, timeout, expired
        self._deadline = None

    def write(self, buffer, timeout=None):
        self._deadline = None
        self._stream.write(buffer, timeout)

    def read(self, max_bytes, timeout=None):
        if self._deadline is None:
            self._deadline = time.monotonic() + self._timeout
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise self._expired("timed out")
            return self._stream.read(max_bytes, left if timeout is None else min(timeout, left))
        except self._expired:
            if time.monotonic() < self._deadline:
                raise
            raise self._expired(f"no complete answer within {self._timeout:g}s of the request (--timeout)") from None

    def start_tls(self, *args, **kwargs):
        return _AnswerDeadline(self._stream.start_tls(*args, **kwargs), self._timeout, self._expired)

    def close(self):
        self._stream.close()

    def get_extra_info(self, info):
        return self._stream.get_extra_info(info)


class _AnswerDeadlineBackend:
    """The connection pool's network backend, with every connection it opens wrapped in `_AnswerDeadline`."""

    def __init__(self, backend, timeout: float, expired: type[Exception]):
        self._backend, self._timeout, self._expired = backend, timeout, expired

    def connect_tcp(self, *args, **kwargs):
        return _AnswerDeadline(self._backend.connect_tcp(*args, **kwargs), self._timeout, self._expired)

    def connect_unix_socket(self, *args, **kwargs):
        return _AnswerDeadline(self._backend.connect_unix_socket(*args, **kwargs), self._timeout, self._expired)

    def sleep(self, seconds):
        self._backend.sleep(seconds)


def bounded_client(timeout: float):
    """huggingface_hub's HTTP client, whose every answer must arrive in full within `timeout` seconds.

    httpx has no total bound on a request, and a transport passed to the client would drop the proxies it reads from
    the environment, so the network backend of each of the client's own connection pools is wrapped instead (the
    connection-pool attributes are those of httpcore 1 and httpcore2 alike)."""
    from huggingface_hub.utils._http import hf_request_event_hook

    http = http_library()
    expired = importlib.import_module(http.__name__.replace("httpx", "httpcore")).ReadTimeout
    client = http.Client(event_hooks={"request": [hf_request_event_hook]}, follow_redirects=True,
                         timeout=http.Timeout(timeout))
    pools = [t._pool for t in (client._transport, *client._mounts.values()) if hasattr(t, "_pool")]
    if not pools or not all(hasattr(pool, "_network_backend") for pool in pools):
        raise RuntimeError(f"{http.__name__} {http.__version__} has no connection pool whose answers push can bound; "
                           f"install the {http.__name__} release huggingface_hub was released with")
    for pool in pools:
        pool._network_backend = _AnswerDeadlineBackend(pool._network_backend, timeout, expired)
    return client


def make_api(timeout: float):
    """An `HfApi` whose HTTP client gives up on a request whose answer has not arrived in full after `timeout` s."""
    from huggingface_hub import HfApi, set_client_factory

    set_client_factory(lambda: bounded_client(timeout))
    return HfApi()


def _transient(err: Exception) -> bool:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    http = http_library()
    if isinstance(err, OfflineModeIsEnabled):
        return False
    if isinstance(err, (http.TimeoutException, http.NetworkError, http.RemoteProtocolError, TimeoutError,
                        ConnectionError)):
        return True
    status = getattr(getattr(err, "response", None), "status_code", None)
    return isinstance(err, HfHubHTTPError) and status is not None and (status == 429 or status >= 500)


def _with_retries(what: str, call, retries: int, log, pause: float = 1.0):
    for attempt in range(retries + 1):
        log(f"push: {what}{f' (retry {attempt}/{retries})' if attempt else ''} ...")
        try:
            return call()
        except Exception as err:
            if attempt == retries or not _transient(err):
                raise
            log(f"push: {what} failed ({type(err).__name__}: {' '.join(str(err).split())[:120]}); retrying in "
                f"{pause * 2 ** attempt:.0f}s")
            time.sleep(pause * 2 ** attempt)


def push_folder(folder, repo_id: str, *, private: bool = False, revision: str | None = None,
                commit_message: str | None = None, api=None, timeout: float = DEFAULT_TIMEOUT_S,
                retries: int = DEFAULT_RETRIES, log=None) -> PushResult:
    log = log or (lambda msg: print(msg, flush=True))
    if not timeout > 0 or retries < 0:
        raise ValueError("--timeout must be > 0 and --retries >= 0")
    files, skipped = check_export_folder(folder)
    api = api or make_api(timeout)
    size = sum((Path(folder) / f).stat().st_size for f in files)
    try:
        _with_retries(f"creating {repo_id}", lambda: api.create_repo(
            repo_id=repo_id, repo_type="model", private=private, exist_ok=True), retries, log)
        if revision and revision != "main":
            _with_retries(f"creating branch {revision}", lambda: api.create_branch(
                repo_id=repo_id, branch=revision, repo_type="model", exist_ok=True), retries, log)
        info = _with_retries(f"uploading {len(files)} files ({size / 1e6:.1f} MB)", lambda: api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
            allow_patterns=files, commit_message=commit_message or f"Upload spike_whale export ({len(files)} files)",
        ), retries, log)
    except Exception as err:  # HTTP / auth / offline errors of huggingface_hub, as one line for the CLI
        first = " ".join(str(err).split())[:300]
        raise RuntimeError(f"push to {repo_id} failed: {type(err).__name__}: {first}") from err
    return PushResult(repo_id, revision, files, skipped, getattr(info, "commit_url", None))


def run(args) -> int:
    res = push_folder(args.dir, args.repo_id, private=args.private, revision=args.revision,
                      commit_message=args.commit_message, timeout=args.timeout, retries=args.retries)
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
            "exactly the files a user needs - config.json, generation_config.json, model.safetensors, the code "
            "files, spike_vocab.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, README.md and "
            "provenance.json. "
            "The token comes from HF_TOKEN or `hf auth login`. Every file is first checked against the sha256 in "
            "provenance.json; network calls time out (--timeout) and transient failures are retried (--retries)."
        ),
    )
    p.add_argument("dir", metavar="DIR", help="folder written by convert / from-gguf / widen")
    p.add_argument("repo_id", metavar="REPO_ID", help="e.g. me/byrne-100m-ultra-mc-sft")
    p.add_argument("--private", action="store_true", help="create the repo as private (ignored if it exists)")
    p.add_argument("--revision", metavar="BRANCH", default=None,
                   help="branch to push to, created if needed (e.g. step-7100, one per checkpoint step)")
    p.add_argument("--commit-message", default=None)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="give up on a request whose answer has not arrived in full S seconds after it was sent "
                        "(default: %(default)s)")
    p.add_argument("--retries", type=int, default=DEFAULT_RETRIES, metavar="N",
                   help="retry a timed-out or transiently failed call N times (default: %(default)s)")
    p.set_defaults(func=run)
