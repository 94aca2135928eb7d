"""A benchmarked server as a subprocess on 127.0.0.1: free port, start, wait for /health, stop.
Used by `dspark bench sweep`; not run directly.

    with ServerProcess(["dspark", "serve", MODEL, "--port", "{port}"], log_path="s.log") as srv:
        run_bench(BenchConfig(base_url=srv.base_url, ...))

The command's `{port}` placeholders are filled with a port the OS reports free (bound and released
just before the start; another process could take it in between, which shows up as a start
failure with the log tail). Stop: SIGTERM, wait `stop_timeout_s`, then SIGKILL. The server's
stdout and stderr go to `log_path`.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def log_tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


class ServerError(RuntimeError):
    """The server exited or did not become healthy in time."""


class ServerProcess:
    """One server subprocess; a context manager that starts it healthy and always stops it."""

    def __init__(self, argv: list[str], *, log_path: str | Path, start_timeout_s: float = 600.0,
                 stop_timeout_s: float = 30.0, health_path: str = "/health"):
        self.port = free_port()
        self.argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.health_path = health_path
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = t0 + self.start_timeout_s
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(f"server exited with code {self.proc.returncode} before it "
                                      f"was healthy: {' '.join(self.argv)}\n"
                                      f"{log_tail(self.log_path)}")
                try:
                    if client.get(self.base_url + self.health_path).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() > deadline:
                    self.stop()
                    raise ServerError(f"server not healthy after {self.start_timeout_s:.0f} s: "
                                      f"{' '.join(self.argv)}\n{log_tail(self.log_path)}")
                time.sleep(0.25)
        self.startup_s = time.perf_counter() - t0

    def stop(self) -> int | None:
        """Terminate, wait, kill on timeout; returns the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
