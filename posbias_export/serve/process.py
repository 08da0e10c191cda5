"""`serve DIR` as a child process (peers/servers.py's ServerProcess: up once /health answers 200,
stopped by SIGTERM, its process tree's memory), as bench-serve and the tests drive it."""
from __future__ import annotations

import sys
from pathlib import Path

from ..peers.servers import ServerProcess, free_port


class ServeProcess(ServerProcess):
    name = "serve"

    def __init__(self, folder: Path, *options: str, log: Path | None = None, cwd: Path | None = None):
        port = free_port()
        log = log or Path(folder).parent / f"{Path(folder).name}-serve.log"
        super().__init__([sys.executable, "-m", "posbias_export", "serve", str(folder), "--port", str(port), *options],
                         port, log, cwd=cwd, env={"RAY_USAGE_STATS_ENABLED": "0"})
