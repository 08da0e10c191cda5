"""Temporaries and the sweep (runtimes/common/atomic.py): a live run's temporary is known by the
lock its writer holds, never by whether its process id is visible from here (a second container
on a shared volume runs in another PID namespace)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from posbias_export.runners import atomic

RUNTIMES = Path(__file__).resolve().parents[1] / "runtimes"
# A writer in "another PID namespace": a process id nobody here can see, the lock held.
HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from common import atomic
from pathlib import Path
tmp = Path(sys.argv[2])
tmp.mkdir() if sys.argv[3] == "folder" else tmp.write_bytes(b"half")
fd = atomic.hold_lock(tmp)
print("locked", flush=True)
sys.stdin.readline()
"""


def _holder(tmp: Path, kind: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(RUNTIMES), str(tmp), kind], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_locked_temporary_of_an_invisible_process_survives_the_sweep(tmp_path):
    for kind in ("folder", "file"):
        tmp = tmp_path / f".m.onnx.99999999.{kind}{atomic().MARK}"  # no process here has that id
        proc = _holder(tmp, kind)
        try:
            assert atomic().sweep(tmp_path) == [] and tmp.exists()
            atomic().write_bytes(tmp_path / "other.txt", "x")  # every write sweeps first
            assert tmp.exists()
        finally:
            proc.communicate("\n", timeout=30)
        assert atomic().sweep(tmp_path) == [] and tmp.exists()  # unlocked, but as young as a writer's unlocked start
        _age(tmp, atomic().LOCK_WINDOW_S)
        assert atomic().sweep(tmp_path) == [tmp] and not tmp.exists()  # its writer is gone: swept


def test_our_own_temporaries_hold_their_lock_while_they_live(tmp_path):
    """A sweep from another process while this one writes: the folder and the file survive."""
    sweeper = ("import sys; sys.path.insert(0, sys.argv[1]); from common import atomic; from pathlib import Path; "
               "print(len(atomic.sweep(Path(sys.argv[2]))))")
    target = tmp_path / "out.bin"
    with atomic().temporary_folder(target) as folder:
        got = subprocess.run([sys.executable, "-c", sweeper, str(RUNTIMES), str(tmp_path)], capture_output=True,
                             text=True, check=True).stdout.strip()
        assert got == "0" and Path(folder).is_dir()

    def write(tmp: Path) -> None:
        tmp.write_bytes(b"data")
        out = subprocess.run([sys.executable, "-c", sweeper, str(RUNTIMES), str(tmp_path)], capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == "0" and tmp.exists()

    atomic().write_with(target, write)
    assert target.read_bytes() == b"data"


def _age(path: Path, seconds: float) -> None:
    import os

    then = time.time() - seconds - 1
    os.utime(path, (then, then))


def test_a_young_unlocked_temporary_of_an_invisible_process_survives_the_sweep(tmp_path):
    """Between making a temporary and locking it, a writer in another PID namespace (which we
    cannot see) looks dead: the sweep leaves such a temporary alone for LOCK_WINDOW_S."""
    fresh = tmp_path / f".m.onnx.99999999.abc{atomic().MARK}"
    fresh.write_bytes(b"just made")
    assert atomic().sweep(tmp_path) == [] and fresh.exists()
    atomic().write_bytes(tmp_path / "other.txt", "x")  # every write sweeps first
    assert fresh.exists()
    _age(fresh, atomic().LOCK_WINDOW_S)
    assert atomic().sweep(tmp_path) == [fresh] and not fresh.exists()


def test_an_unlocked_old_temporary_of_a_visible_process_is_swept(tmp_path):
    """A process id reused by an unrelated live process (this test's own parent) does not keep
    an abandoned temporary forever: unlocked and older than a writer takes to lock, it goes."""
    import os

    stale = tmp_path / f".m.onnx.{os.getppid()}.abc{atomic().MARK}"
    stale.write_bytes(b"half")
    assert atomic().sweep(tmp_path) == []  # young: it may be a writer that has not locked yet
    old = time.time() - 2 * atomic().YOUNG_S
    os.utime(stale, (old, old))
    assert atomic().sweep(tmp_path) == [stale]


def test_a_long_legal_output_name_is_written(tmp_path):
    """A 244-byte file name is legal (255 is the limit); its temporaries keep a shortened copy of
    it, so the export is not refused as an unwritable directory."""
    import posbias_export as pbe

    out = tmp_path / ("a" * 239 + ".onnx")
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", dim=32, num_heads=2, num_layers=1), seed=0)
    pbe.export_onnx(model, out, check_growth=False)
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == [out.name]
