"""Where a writing command may put its output, and how it gets there without losing anything the user owns.

- `check_destination` refuses, before any work, an output that is, contains or lies inside one of the command's
  sources (symlinks resolved), an existing destination without `--overwrite`, and, even with `--overwrite`, a
  folder holding files no export writes or a file that is not what the command writes.
- Outputs are written under temporary names that carry the writer's pid (`.NAME.tmp-<pid>-<random>` folders,
  `.NAME.<pid>-<random>.tmp` files, `spike-whale-verify-<pid>-<random>` in the temp dir) and renamed into place
  only when complete; `remove_stale_temps` deletes the ones whose writer is gone (a SIGKILL leaves them behind)
  and says so. A `.NAME.old-<pid>` backup left between the two renames of `replace_folder` is put back.
- `die_with_parent` makes a child process get SIGKILL when its parent dies (no orphaned verification child).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

STAGING_DIR_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[a-z0-9_]{8}$")
STAGING_FILE_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-[a-z0-9_]{8}\.tmp$")
BACKUP_RE = re.compile(r"^\.(?P<name>.+)\.old-(?P<pid>\d+)$")
VERIFY_DIR_RE = re.compile(r"^spike-whale-verify-(?P<pid>\d+)-[a-z0-9_]{8}$")
# Names an earlier version used (no pid): stale once older than this, if the content is ours.
LEGACY_RES = (re.compile(r"^\..+\.tmp-[a-z0-9_]{8}$"), re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$"),
              re.compile(r"^spike-whale-verify-[a-z0-9_]{8}$"))
LEGACY_AGE_S = 3600
STALE_AGE_S = 24 * 3600
PR_SET_PDEATHSIG = 1


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
                      magic: bytes | None = None, also_ours: frozenset = frozenset()) -> None:
    """Refuse, before any work, an output the command must not write (see the module docstring).

    `kind` is "folder" (an export folder) or "file"; `magic` is the first bytes a replaceable file must have;
    `also_ours`: names (files or folders) the command writes into a folder besides an export's files.
    """
    path = Path(out)
    check_not_source(path, sources, "OUT_DIR" if kind == "folder" else "OUT")
    if kind == "file":
        if path.is_dir():
            raise ValueError(f"{path} is a folder; give the path of the file to write")
        if path.exists():
            if not overwrite:
                raise ValueError(f"{path} exists (pass --overwrite to replace it)")
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


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _age(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except FileNotFoundError:
        return 0.0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temps(folder: str | os.PathLike, log=None) -> list[str]:
    """Delete temporary outputs of ours in `folder` whose writer process is gone (or older than a day), restore
    a backup an interrupted swap left without its replacement; returns what was done, one line each."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    folder = Path(folder)
    done = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return done
    for entry in entries:
        name = entry.name
        is_dir = entry.is_dir() and not entry.is_symlink()
        m = (STAGING_DIR_RE.match(name) or VERIFY_DIR_RE.match(name)) if is_dir else STAGING_FILE_RE.match(name)
        backup = BACKUP_RE.match(name)
        if backup:
            if _pid_alive(int(backup["pid"])) and _age(entry) < STALE_AGE_S:
                continue
            original = folder / backup["name"]
            if original.exists():
                _remove(entry)
                done.append(f"removed {entry} (backup of {original} left by an interrupted run)")
            else:
                os.replace(entry, original)
                done.append(f"restored {original} from {entry} (an interrupted run had moved it aside)")
        elif m:
            if _pid_alive(int(m["pid"])) and _age(entry) < STALE_AGE_S:
                continue
            size = _size(entry)
            _remove(entry)
            done.append(f"removed {entry} ({size}), a temporary output left by an interrupted run (pid {m['pid']})")
        elif any(r.match(name) for r in LEGACY_RES) and _age(entry) > LEGACY_AGE_S and _looks_like_ours(entry):
            size = _size(entry)
            _remove(entry)
            done.append(f"removed {entry} ({size}), a temporary output left by an interrupted run")
    for line in done:
        log(f"note: {line}")
    return done


def _looks_like_ours(path: Path) -> bool:
    """A temp name without a pid is removed only if its content is what we write: a GGUF file, or a folder of
    export files (or our verification child's files)."""
    if path.is_symlink():
        return False
    if path.is_file():
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    names = {p.name for p in path.iterdir()}
    return names <= export_file_names() | {"report.json", "logits.pt", "modules"}


def _size(path: Path) -> str:
    try:
        n = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    except OSError:
        n = 0
    return f"{n / 1e6:.1f} MB"


def staging_folder(out: Path) -> Path:
    """A new empty folder next to `out`, named so that `remove_stale_temps` recognises it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))


def staging_file(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.{os.getpid()}-", suffix=".tmp", dir=out.parent)
    os.close(fd)
    return Path(tmp)


def verify_temp_dir() -> str:
    """A new temp folder for the verification child (stale ones of dead runs are removed first)."""
    remove_stale_temps(tempfile.gettempdir())
    return tempfile.mkdtemp(prefix=f"spike-whale-verify-{os.getpid()}-")


def default_permissions(path: Path) -> None:
    """Give a file / folder made with `tempfile` (0600 / 0700) the permissions the umask asks for."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def replace_folder(staging: Path, out: Path) -> None:
    """Move the complete `staging` folder to `out`; an existing `out` is moved aside first and removed only after."""
    default_permissions(staging)
    for p in staging.rglob("*"):
        default_permissions(p)
    backup = None
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        else:
            backup = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, backup)
    os.replace(staging, out)
    if backup is not None:
        _remove(backup)


def replace_file(staging: Path, out: Path) -> None:
    default_permissions(staging)
    os.replace(staging, out)


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
