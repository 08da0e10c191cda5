"""`serve DIR` as a child process: started on a free loopback port, up once /health answers 200,
stopped by SIGTERM (what bench-serve and the tests drive), and the resident memory of its whole
process tree (the driver, Ray's processes, the replicas) sampled while it runs."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

STARTUP_S = 300  # a loaded 2-core machine starts Ray, its proxy and a replica in 60-120 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and every process below it (Linux /proc; 0 where unreadable)."""
    parents, rss = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            rss[int(entry.name)] = int((entry / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(rss.get(pid, 0) for pid in tree)


class ServeProcess:
    def __init__(self, folder: Path, *options: str, log: Path | None = None, cwd: Path | None = None):
        self.port = free_port()
        self.log = log or Path(folder).parent / f"{Path(folder).name}-serve.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "posbias_export", "serve", str(folder), "--port", str(self.port), *options],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, cwd=cwd,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        self.url = f"http://127.0.0.1:{self.port}"
        self.peak = 0
        self._sampling = threading.Event()
        deadline = time.time() + STARTUP_S
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited {self.process.returncode}: {self.tail()}")
            if self.status("/health") == 200:
                return
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"serve was not up in {STARTUP_S} s: {self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as answer:
                return answer.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return 0

    def sample_peak(self, every_s: float = 0.25) -> None:
        """From now until stop_sampling(): the largest resident size of the whole tree."""
        self.peak = tree_rss(self.process.pid)

        def sample():
            while not self._sampling.wait(every_s):
                self.peak = max(self.peak, tree_rss(self.process.pid))

        self._sampling.clear()
        threading.Thread(target=sample, daemon=True).start()

    def stop_sampling(self) -> int:
        self._sampling.set()
        return self.peak

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, then the exit code (killed after `timeout`: RuntimeError)."""
        self._sampling.set()
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise RuntimeError(f"serve did not stop in {timeout} s after SIGTERM") from None
