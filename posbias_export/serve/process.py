"""`serve DIR` (or a peer server bench-serve runs beside it) as a child process: started on a free
loopback port, up once its health path answers 200, stopped by SIGTERM (what bench-serve and the
tests drive), and the memory of its whole process tree (the driver, Ray's processes, the replicas)
sampled while it runs: resident bytes (RSS, each process's pages counted in full) and proportional
bytes (PSS: a page shared by n processes counted 1/n times, so the tree's sum is what it holds)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

STARTUP_S = 300  # a loaded 2-core machine starts Ray, its proxy and a replica in 60-120 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_pids(root: int) -> set[int]:
    """`root` and every process below it (Linux /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return tree


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def tree_memory(root: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of `root` and every process below it now (0 for what is unreadable)."""
    rss = pss = 0
    for pid in tree_pids(root):
        try:
            rss += _status_kb(pid, "VmRSS")
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            pss += next((int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:")), 0)
        except (OSError, ValueError, IndexError):
            continue
    return rss, pss


def reset_peaks(root: int) -> None:
    """Restart each process's resident high-water mark (VmHWM) from its size now."""
    for pid in tree_pids(root):
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            continue


def tree_peak_rss(root: int) -> int:
    """The sum of each process's resident high-water mark since reset_peaks: an upper bound of the
    tree's resident size at any one moment (its processes may peak at different times)."""
    total = 0
    for pid in tree_pids(root):
        try:
            total += _status_kb(pid, "VmHWM")
        except (OSError, ValueError, IndexError):
            continue
    return total


class ServerProcess:
    """A server command as a child process, up once `health` answers 200 on its port."""

    name = "server"

    def __init__(self, command: list[str], port: int, log: Path, health: str = "/health", cwd: Path | None = None,
                 env: dict | None = None, name: str | None = None):
        self.name = name or self.name
        self.port, self.log, self.url = port, log, f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, stdout=self.log.open("w"), stderr=subprocess.STDOUT, cwd=cwd,
                                        env={**os.environ, **(env or {})})
        self.peak = self.peak_pss = 0
        deadline = time.time() + STARTUP_S
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.process.returncode}: {self.tail()}")
            if self.status(health) == 200:
                return
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"{self.name} was not up in {STARTUP_S} s: {self.tail()}")

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

    def sample_peak(self) -> None:
        """From now until stop_sampling(): the tree's peak memory, from the kernel's per-process
        resident high-water marks, reset now and read at the end. Nothing samples in between: on
        2 cores reading the replica's memory map every 0.25 s slowed a 512-token embedding from
        1.4 to 2.0 s, and every 2 s still to 1.6 s (the reads hold the lock its allocations take)."""
        reset_peaks(self.process.pid)

    def stop_sampling(self) -> tuple[int, int]:
        """(peak RSS, peak PSS) since sample_peak(). PSS has no high-water mark: it is estimated as
        the peak RSS less the pages the tree's processes share (RSS - PSS at the end, counted in
        each process that maps them)."""
        self.peak = tree_peak_rss(self.process.pid)
        rss, pss = tree_memory(self.process.pid)
        self.peak_pss = max(0, self.peak - (rss - pss))
        return self.peak, self.peak_pss

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, then the exit code (killed after `timeout`: RuntimeError)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise RuntimeError(f"{self.name} did not stop in {timeout} s after SIGTERM") from None


class ServeProcess(ServerProcess):
    name = "serve"

    def __init__(self, folder: Path, *options: str, log: Path | None = None, cwd: Path | None = None):
        port = free_port()
        log = log or Path(folder).parent / f"{Path(folder).name}-serve.log"
        super().__init__([sys.executable, "-m", "posbias_export", "serve", str(folder), "--port", str(port), *options],
                         port, log, cwd=cwd, env={"RAY_USAGE_STATS_ENABLED": "0"})
