"""A memory cgroup of its own for a server's process tree, where the machine lets us make one.

Its peak counts each page once, the page cache the server's reads brought in included: what a
container's memory limit (Docker's --memory, a Kubernetes pod's limit) counts. Summed per-process
RSS counts every shared library, Ray's included, once in each of a server's nine processes (for
ours, 2.28 GB at 8192 tokens where the cgroup peaked at 1.84). Needs a writable cgroup hierarchy
(cgroup v1's memory controller, or v2 with memory enabled for children): root in a container that
mounts it so, not an unprivileged user; elsewhere `make` gives None and the column says "-".
"""
from __future__ import annotations

import time
from pathlib import Path

# v1's memory hierarchy, then v2's unified one; each with the file its peak is read from
HIERARCHIES = ((Path("/sys/fs/cgroup/memory"), "memory.max_usage_in_bytes"), (Path("/sys/fs/cgroup"), "memory.peak"))


class MemoryCgroup:
    def __init__(self, path: Path, peak_file: str):
        self.path, self.peak_file = path, path / peak_file

    @classmethod
    def make(cls, name: str) -> "MemoryCgroup | None":
        for root, peak in HIERARCHIES:
            path = root / name
            try:
                path.mkdir()
            except OSError:
                continue
            group = cls(path, peak)
            if group.peak_file.is_file() and group.reset():
                return group
            group.remove()
        return None

    def wrap(self, command: list[str]) -> list[str]:
        """`command` started inside the group (and all it starts): a shell moves itself in, then
        becomes the command (exec keeps its pid). Not a preexec_fn: forking a threaded Python
        and running Python code in the child before exec can deadlock. A move refused still runs
        the command: the group then stays empty, its peak 0, and the column says "-"."""
        return ["sh", "-c", 'echo $$ > "$0" 2>/dev/null; exec "$@"', str(self.path / "cgroup.procs"), *command]

    def reset(self) -> bool:
        """Restart the peak from the usage now (v1: write 0; v2: any write, on kernels >= 6.12)."""
        try:
            self.peak_file.write_text("0")
            return True
        except OSError:
            return False

    def peak(self) -> int:
        return int(self.peak_file.read_text().split()[0])

    def remove(self, timeout: float = 10) -> None:
        """rmdir once its processes are gone (a server's last ones may take a moment to exit)."""
        deadline = time.time() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.time() > deadline:
                    return  # left for the machine's owner: an empty group holds no memory
                time.sleep(0.2)
