"""Where a writing command may put its output, and how it gets there without losing anything the user owns.

- `check_destination` refuses, before any work, an output that is, contains or lies inside one of the command's
  sources (symlinks resolved), an existing destination without `--overwrite`, and, even with `--overwrite`, a
  folder holding files no export writes or a file that is not what the command writes. `replace_folder` checks
  again when the work is done: the destination may have been made or filled meanwhile.
- Outputs are written under temporary names (`.NAME.tmp-<pid>-<token>` folders, `.NAME.<pid>-<token>.tmp` files,
  `spike-whale-verify-<pid>-<token>` / `spike-whale-trainer-<pid>-<token>` in the temp dir) and renamed into place
  only when complete. Each one, and each `.NAME.old-<pid>-<token>` backup `replace_folder` moves an earlier export
  to, has an owner marker next to it (`<entry>.spike-whale-owner`: writer pid and start time, host, the random
  token of the name), written before the entry is made. `remove_stale_temps` acts only on entries with a valid
  marker whose writer is gone (a SIGKILL leaves them behind): it deletes temporaries and puts a backup back, and
  says so. What merely has a matching name is never touched: it may be the user's.
- `die_with_parent` makes a child process get SIGKILL when its parent dies (no orphaned verification child).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

OWNER_SUFFIX = ".spike-whale-owner"
WRITER = "spike-whale"
PR_SET_PDEATHSIG = 1
# The markers this process wrote; at exit, those whose entry is gone (a caller removed a temporary itself) go too.
_CLAIMED: set[Path] = set()


class DestinationChanged(ValueError):
    """The destination was made or filled while the command worked; the finished output was not moved there."""


def resolved(path: str | os.PathLike) -> Path:
    """The absolute path with every symlink resolved (also for a path that does not exist yet)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _overlap(out: Path, src: Path) -> str | None:
    if out == src:
        return "is"
    if out in src.parents:
        return "contains"
    if src in out.parents:
        return "lies inside"
    return None


def check_not_source(out: str | os.PathLike, sources, flag: str = "OUT") -> None:
    """Refuse an output that is, contains or lies inside any source path (after resolving symlinks)."""
    target = resolved(out)
    for src in sources:
        if src is None:
            continue
        s = resolved(src)
        how = _overlap(target, s)
        if how is None and target.exists() and s.exists() and os.path.samefile(target, s):
            how = "is"
        if how:
            raise ValueError(f"{out} {how} the source {src}; refusing to write there (choose an {flag} outside it)")


def config_file(config) -> str | None:
    """The path a `--config` value names (None for inline JSON or a config object), as a source to protect."""
    return config if isinstance(config, (str, os.PathLike)) and not str(config).lstrip().startswith("{") else None


def export_file_names() -> set[str]:
    from .folder import CODE_FILES, EXPORT_FILES

    return {*EXPORT_FILES, *CODE_FILES}


def check_destination(out: str | os.PathLike, sources=(), *, overwrite: bool, kind: str = "folder",
                      magic: bytes | None = None, also_ours: frozenset = frozenset(), flag: str | None = None) -> None:
    """Refuse, before any work, an output the command must not write (see the module docstring).

    `kind` is "folder" (an export folder) or "file"; `magic` is the first bytes a replaceable file must have;
    `also_ours`: names (files or folders) the command writes into a folder besides an export's files; `flag`:
    what the messages call the output (default OUT_DIR / OUT).
    """
    path = Path(out)
    check_not_source(path, sources, flag or ("OUT_DIR" if kind == "folder" else "OUT"))
    if kind == "file":
        named = f"{flag} {path}" if flag else str(path)
        if path.is_dir():
            raise ValueError(f"{named} is a folder; give the path of the file to write")
        if path.exists():
            if not overwrite:
                raise ValueError(f"{named} exists (pass --overwrite to replace it)")
            if magic is not None:
                with open(path, "rb") as handle:
                    if handle.read(len(magic)) != magic:
                        raise ValueError(f"{path} exists and is not a {magic.decode(errors='replace')} file; "
                                         "refusing to replace it even with --overwrite")
        return
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise ValueError(f"{path} exists and is not empty (pass --overwrite to replace it)")
        ours = export_file_names()
        foreign = sorted(p.name for p in path.iterdir()
                         if p.name not in also_ours and (p.name not in ours or not p.is_file()))
        if foreign:
            raise ValueError(f"{path} holds files spike-whale does not write ({', '.join(foreign[:5])}"
                             f"{', ...' if len(foreign) > 5 else ''}); refusing to replace it even with --overwrite: "
                             "move them away or choose another OUT_DIR")


def _start_time(pid: int) -> str | None:
    """When the process started (Linux: clock ticks since boot), which tells a writer from a later process that
    got its pid; None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name before it may hold spaces


def _marker(entry: Path) -> Path:
    return entry.with_name(entry.name + OWNER_SUFFIX)


def _claim(entry: Path, token: str, kind: str, **extra) -> None:
    """Write the owner marker of `entry` before `entry` exists, so that no entry of ours is ever unmarked (a
    marker without its entry is simply dropped later)."""
    record = {"writer": WRITER, "kind": kind, "entry": entry.name, "token": token, "pid": os.getpid(),
              "started": _start_time(os.getpid()), "host": socket.gethostname(), **extra}
    marker = _marker(entry)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)
    _CLAIMED.add(marker)


def _release(entry: Path) -> None:
    marker = _marker(entry)
    marker.unlink(missing_ok=True)
    _CLAIMED.discard(marker)


@atexit.register
def _release_orphans() -> None:
    for marker in list(_CLAIMED):
        if not os.path.lexists(marker.with_name(marker.name[: -len(OWNER_SUFFIX)])):
            marker.unlink(missing_ok=True)


def _owned(marker: Path) -> dict | None:
    """The marker's record if it is one of ours, consistent with the entry it names and this user's; else None."""
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_uid != os.getuid():
            return None
        record = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("writer") != WRITER:
        return None
    entry, pid, token = record.get("entry"), record.get("pid"), record.get("token")
    if entry != marker.name[: -len(OWNER_SUFFIX)] or not isinstance(pid, int) or pid <= 0:
        return None
    if not isinstance(token, str) or len(token) < 16 or f"{pid}-{token}" not in entry:
        return None
    if record.get("kind") == "backup":
        original = record.get("original")
        return record if isinstance(original, str) and entry == f".{original}.old-{pid}-{token}" else None
    return record if record.get("kind") in ("folder", "file") else None


def _writer_alive(record: dict) -> bool:
    if record.get("host") != socket.gethostname():
        return True  # a process of another machine sharing this folder: nothing here can tell
    pid = record["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = record.get("started")
    return started is None or _start_time(pid) in (None, started)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temps(folder: str | os.PathLike, log=None) -> list[str]:
    """Delete the temporary outputs in `folder` that carry our owner marker and whose writer is gone, put back a
    backup an interrupted swap left without its replacement; returns what was done, one line each. An entry
    without a valid marker is left alone, whatever its name."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    folder = Path(folder)
    done = []
    try:
        markers = [p for p in folder.iterdir() if p.name.endswith(OWNER_SUFFIX)]
    except OSError:
        return done
    for marker in markers:
        record = _owned(marker)
        if record is None or _writer_alive(record):
            continue
        try:
            line = _clean_up(folder / record["entry"], record)
        except OSError:
            continue  # the marker stays: the next run tries again
        if line:
            done.append(line)
        marker.unlink(missing_ok=True)
    for line in done:
        log(f"note: {line}")
    return done


def _clean_up(entry: Path, record: dict) -> str | None:
    """Remove (or, a backup whose original is missing, put back) the entry a dead writer's marker names."""
    if entry.is_symlink() or not entry.exists() or entry.is_dir() != (record["kind"] != "file"):
        return None  # gone, or no longer what the writer made
    if record["kind"] == "backup":
        original = entry.parent / record["original"]
        if os.path.lexists(original):
            _remove(entry)
            return f"removed {entry} (backup of {original} left by an interrupted run)"
        os.replace(entry, original)
        return f"restored {original} from {entry} (an interrupted run had moved it aside)"
    size = _size(entry)
    _remove(entry)
    return f"removed {entry} ({size}), a temporary output left by an interrupted run (pid {record['pid']})"


def _size(path: Path) -> str:
    try:
        n = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    except OSError:
        n = 0
    return f"{n / 1e6:.1f} MB"


def _new_entry(parent: Path, name_for, is_dir: bool) -> Path:
    """Create a new folder / empty file `parent / name_for(token)` (0700 / 0600), its marker first."""
    parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    path = parent / name_for(f"{os.getpid()}-{token}")
    _claim(path, token, "folder" if is_dir else "file")
    try:
        if is_dir:
            os.mkdir(path, 0o700)
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except BaseException:
        _release(path)
        raise
    return path


def staging_folder(out: Path) -> Path:
    """A new empty folder next to `out`, marked as ours so that `remove_stale_temps` may remove it."""
    return _new_entry(out.parent, lambda tag: f".{out.name}.tmp-{tag}", is_dir=True)


def staging_file(out: Path) -> Path:
    """A new empty file next to `out`, marked as ours so that `remove_stale_temps` may remove it."""
    return _new_entry(out.parent, lambda tag: f".{out.name}.{tag}.tmp", is_dir=False)


def temp_folder(prefix: str) -> Path:
    """A new marked folder `PREFIX-<pid>-<token>` in the temp dir (stale ones of dead runs are removed first)."""
    remove_stale_temps(tempfile.gettempdir())
    return _new_entry(Path(tempfile.gettempdir()), lambda tag: f"{prefix}-{tag}", is_dir=True)


def verify_temp_dir() -> str:
    """A new temp folder for the verification child."""
    return str(temp_folder("spike-whale-verify"))


def discard(path: str | os.PathLike) -> None:
    """Remove a temporary output of ours (folder or file) and its marker."""
    path = Path(path)
    _remove(path)
    _release(path)


def default_permissions(path: Path) -> None:
    """Give a file / folder made 0600 / 0700 the permissions the umask asks for."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def replace_folder(staging: Path, out: Path, *, overwrite: bool, also_ours: frozenset = frozenset()) -> None:
    """Move the complete `staging` folder to `out`; an existing `out` is moved aside first and removed only after.

    `out` is checked again first (`check_destination`; `DestinationChanged` if it now fails): it may have been
    made or filled, by the user, since the command checked it before its work."""
    try:
        check_destination(out, overwrite=overwrite, also_ours=also_ours)
    except ValueError as err:
        raise DestinationChanged(f"{err}; it was made or changed while the command ran") from None
    default_permissions(staging)
    for p in staging.rglob("*"):
        default_permissions(p)
    backup = None
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        else:
            token = secrets.token_hex(8)
            backup = out.parent / f".{out.name}.old-{os.getpid()}-{token}"
            _claim(backup, token, "backup", original=out.name)
            try:
                os.replace(out, backup)
            except BaseException:
                _release(backup)
                raise
    os.replace(staging, out)
    _release(staging)
    if backup is not None:
        discard(backup)


def keep_folder(staging: Path, out: Path) -> Path:
    """Move a complete staging folder that may not go to `out` to a new visible folder next to `out`, unmarked
    (no cleanup removes it); returns where it now is."""
    kept = out.parent / f"{out.name}.kept-{os.getpid()}"
    n = 1
    while os.path.lexists(kept):
        n += 1
        kept = out.parent / f"{out.name}.kept-{os.getpid()}-{n}"
    default_permissions(staging)
    for p in staging.rglob("*"):
        default_permissions(p)
    os.rename(staging, kept)
    _release(staging)
    return kept


def replace_file(staging: Path, out: Path) -> None:
    default_permissions(staging)
    os.replace(staging, out)
    _release(staging)


def write_file(out: str | os.PathLike, text: str) -> None:
    """Write `text` to `out` whole or not at all: through a staging file renamed over it."""
    out = Path(out)
    tmp = staging_file(out)
    try:
        tmp.write_text(text, encoding="utf-8")
        replace_file(tmp, out)
    except BaseException:
        discard(tmp)
        raise


def _die_with_parent(prctl, parent: int) -> None:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def die_with_parent():
    """A `preexec_fn` that makes the child get SIGKILL when this process dies (Linux); None elsewhere.
    libc is opened here, in the parent: the child, forked from a threaded process, only calls prctl."""
    if sys.platform.startswith("linux"):
        return functools.partial(_die_with_parent, ctypes.CDLL(None, use_errno=True).prctl, os.getpid())
    return None
