"""The one way every file of the project is written (models, reports, tensors, generated text),
by the package and by the runner scripts alike: a temporary file beside the target, flushed to
disk, renamed over it. On any failure, Ctrl-C or SIGTERM the temporary file is removed and the
target is as it was; a run killed outright (kill -9) leaves a temporary named after its process,
which the next write into that folder sweeps. Outputs are checked against every input first.
Standard library only (the runners import no torch and not this package)."""
from __future__ import annotations

import os
import re
import signal
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

MARK = ".posbias-tmp"  # every temporary of ours ends its name with this and starts with .<target>.<pid>.
_OURS = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.[^.]*" + re.escape(MARK) + r"$")


class Terminated(KeyboardInterrupt):
    """SIGTERM (what timeout, systemd and container stops send), raised where Python runs, so
    cleanups run as for Ctrl-C."""


def on_sigterm_raise() -> None:
    """Make SIGTERM raise Terminated in the main thread (called by every command's main)."""
    def handler(signum, frame):
        raise Terminated()

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (an embedding host): leave its handler alone
        pass


def default_file_mode() -> int:
    """What open() would give a new file: 0666 minus the umask (mkstemp makes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep(folder: Path) -> list[Path]:
    """Remove the temporaries of runs that died (their process is gone) in `folder`."""
    import shutil

    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _OURS.match(entry.name)
        if match and not _alive(int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def temp_name(target: Path) -> str:
    """The prefix of a temporary for `target`: .<name>.<pid>. (mkstemp adds a random part)."""
    return f".{target.name}.{os.getpid()}."


def temporary_folder(target: Path) -> tempfile.TemporaryDirectory:
    """A temporary folder beside `target` for outputs of several files (a model and its data)."""
    parent = target.parent if str(target.parent) else Path(".")
    sweep(parent)
    return tempfile.TemporaryDirectory(dir=parent, prefix=temp_name(target), suffix=MARK)


def write_with(target: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(temporary path), flush it to disk, rename it to `target`; on any failure the
    temporary is gone and `target` untouched. OSError names the target."""
    target = Path(target)
    parent = target.parent if str(target.parent) else Path(".")
    sweep(parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=temp_name(target), suffix=MARK)
    except OSError as err:
        raise OSError(f"cannot write {target}: {err.strerror}") from None
    os.close(fd)
    tmp = Path(tmp)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(f"cannot write {target}: {err.strerror or err}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def write_bytes(target: str | os.PathLike, data: bytes | str) -> Path:
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return write_with(target, lambda tmp: tmp.write_bytes(raw))


def same_file(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def clashing_input(outputs: Iterable, inputs: Iterable) -> tuple[Path, Path] | None:
    """(output, input) where an output would overwrite an input (the same file, or the same
    folder for a folder of tensors), else None."""
    ins = [Path(p) for p in inputs if p]
    for out in (Path(p) for p in outputs if p):
        for source in ins:
            if same_file(out, source):
                return out, source
    return None
