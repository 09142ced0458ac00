"""Start a server for a test on a free port and wait until it answers: an ASGI app (uvicorn in a daemon
thread: `thinkcraft serve`'s `make_app`, or a scripted fake) or `thinkcraft serve` itself as a process.
Used through the `servers` / `module_servers` fixtures (tests/conftest.py); everything started is
stopped at the fixture's teardown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_sigint() -> None:
    # a test run started in the background ignores SIGINT, and an ignored SIGINT is inherited through exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Servers:
    """`app(asgi_app) -> base URL` and `serve(*cli_args) -> base URL`; `close()` stops them all."""

    def __init__(self) -> None:
        self._threads: list[tuple[Any, threading.Thread]] = []
        self._procs: dict[str, subprocess.Popen] = {}

    def app(self, asgi_app: Any, timeout_s: float = 30.0) -> str:
        import uvicorn

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(asgi_app, host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self._threads.append((server, thread))
        t0 = time.monotonic()
        while not server.started:
            if not thread.is_alive() or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the test server on port {port} did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    def serve(self, *args: str, env: dict[str, str] | None = None, timeout_s: float = 300.0) -> str:
        """`python -m thinkcraft serve --port <free> *args` (with `env` added to the environment), waited
        for until /health answers 200."""
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               **(env or {})}
        proc = subprocess.Popen(
            [sys.executable, "-m", "thinkcraft", "serve", "--port", str(port), *args],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint,
        )
        url = f"http://127.0.0.1:{port}"
        self._procs[url] = proc
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"thinkcraft serve exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"thinkcraft serve did not come up on {url} in {timeout_s:.0f} s")

    def stop_process(self, url: str) -> None:
        """Stop the `serve` process behind `url` now (Ctrl-C, then kill after 20 s)."""
        self._stop(self._procs.pop(url))

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for server, _ in self._threads:
            server.should_exit = True
        for _, thread in self._threads:
            thread.join(timeout=10)
        for proc in self._procs.values():
            self._stop(proc)
        self._threads.clear()
        self._procs.clear()
