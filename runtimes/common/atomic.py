"""The one way every file of the project is written (models, reports, tensors, generated text),
by the package and by the runner scripts alike: a temporary file beside the target, flushed to
disk, renamed over it. On any failure, Ctrl-C or SIGTERM the temporary file is removed and the
target is as it was; a run killed outright (kill -9) leaves a temporary, which the next write
into that folder sweeps. The writer holds an exclusive lock (flock) on its temporary for as long
as it lives: the lock is what says a run is alive, not its process id, which another PID
namespace (a second container on a shared volume) does not see. Outputs are checked against
every input first. Standard library only (the runners import no torch and not this package)."""
from __future__ import annotations

import os
import re
import signal
import tempfile
import time
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


def stop_behind(err: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM an exception stands for, if any: one that arrives while an extension
    module initialises (the first `import onnxruntime`) reaches us as pybind11's
    ImportError("initialization failed") raised from it."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def default_file_mode() -> int:
    """What open() would give a new file: 0666 minus the umask (mkstemp makes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


# An unlocked temporary this young may be one a live writer has just made and not yet locked.
YOUNG_S = 60.0
# A writer locks what it made within microseconds of making it, in whatever PID namespace it
# runs: an unlocked temporary of a process we do not see is left alone this long all the same.
LOCK_WINDOW_S = 5.0


def _lock(fd: int) -> bool:
    """Take the exclusive lock of the open file (or folder) `fd` without waiting; False if a
    live writer holds it. Where flock does not exist (Windows), True: the process id decides."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a file system without locks: the process id decides
        return True
    return True


def hold_lock(path: Path) -> int:
    """Open `path` (a temporary of ours, file or folder) and lock it for the writer's life: the
    returned descriptor is closed (the lock released) when the temporary is done."""
    fd = os.open(path, os.O_RDONLY)
    _lock(fd)
    return fd


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _abandoned(entry: Path, pid: int) -> bool:
    """A temporary no live writer holds: its lock is free, and it is older than a writer takes
    to lock what it made: LOCK_WINDOW_S when its process is not one we see alive (dead, or in
    another PID namespace, not seen at all), YOUNG_S when an unrelated process has its id. A
    temporary we cannot open is left alone."""
    if pid == os.getpid():
        return False
    try:
        fd = os.open(entry, os.O_RDONLY)
    except OSError:
        return False
    try:
        if not _lock(fd):
            return False  # a live writer, whatever its process id says
        age = time.time() - os.fstat(fd).st_mtime
        return age >= (YOUNG_S if _pid_alive(pid) else LOCK_WINDOW_S)
    finally:
        os.close(fd)


def sweep(folder: Path) -> list[Path]:
    """Remove the temporaries of runs that died (nothing holds their lock) in `folder`."""
    import shutil

    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _OURS.match(entry.name)
        if match and _abandoned(entry, int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


NAME_ROOM = 120  # bytes of the target's name a temporary keeps: with the pid, mkstemp's part and MARK it fits
# a file system's 255-byte names whatever the target's (a legal 250-byte output must not fail for its temporary)


def short_name(name: str) -> str:
    """`name`, cut to NAME_ROOM bytes of UTF-8 (on a character boundary)."""
    return name.encode()[:NAME_ROOM].decode("utf-8", "ignore")


def temp_name(target: Path) -> str:
    """The prefix of a temporary for `target`: .<name>.<pid>. (mkstemp adds a random part)."""
    return f".{short_name(target.name)}.{os.getpid()}."


class LockedTemporaryDirectory(tempfile.TemporaryDirectory):
    """A TemporaryDirectory whose writer holds its lock until it is cleaned up."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._fd = hold_lock(Path(self.name))

    def cleanup(self) -> None:
        try:
            super().cleanup()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def temporary_folder(target: Path) -> tempfile.TemporaryDirectory:
    """A temporary folder beside `target` for outputs of several files (a model and its data)."""
    parent = target.parent if str(target.parent) else Path(".")
    sweep(parent)
    return LockedTemporaryDirectory(dir=parent, prefix=temp_name(target), suffix=MARK)


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
    _lock(fd)  # held until the file is renamed or removed: a live run's temporary is never swept
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
    finally:
        os.close(fd)
    return target


def write_all(files: dict[Path, bytes]) -> None:
    """Several files, all or none: each written to its own temporary and flushed, then all
    renamed into place; on any failure every temporary is removed and no target changed (a full
    disk at the third tensor leaves no first two)."""
    temporaries: list[tuple[Path, Path, int]] = []
    try:
        for target, data in files.items():
            parent = target.parent if str(target.parent) else Path(".")
            try:
                fd, tmp = tempfile.mkstemp(dir=parent, prefix=temp_name(target), suffix=MARK)
            except OSError as err:
                raise OSError(f"cannot write {target}: {err.strerror}") from None
            _lock(fd)
            temporaries.append((Path(tmp), target, fd))
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, default_file_mode())
            except OSError as err:
                raise OSError(f"cannot write {target}: {err.strerror or err}") from None
        for tmp, target, _ in temporaries:
            os.replace(tmp, target)
    finally:
        for tmp, _, fd in temporaries:
            tmp.unlink(missing_ok=True)  # gone already once renamed
            os.close(fd)


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
    folder for a folder of tensors), else None. An input model is all its files: the .onnx and
    the external-data files its graph names (model_files.py)."""
    from .model_files import model_files

    ins = [f for p in inputs if p for f in model_files(Path(p))]
    for out in (Path(p) for p in outputs if p):
        for source in ins:
            if same_file(out, source):
                return out, source
    return None
