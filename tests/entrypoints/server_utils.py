"""Run ``tokenloom serve`` in a subprocess for end-to-end tests, and read its metrics."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RemoteServer:
    """``python -m tokenloom.entrypoints.cli serve`` on a free port, ready when /health is 200.

    With ``ca_file`` the server speaks TLS (its ``--ssl-*`` flags are in ``args``)
    and clients trust that CA (``verify``). ``env``: variables to set for the
    server beside the test's own.
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        ca_file: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"{'https' if ca_file else 'http'}://127.0.0.1:{self.port}"
        self.verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
        )
        self.log_path = log_path
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="2", **(env or {}))
        command = [sys.executable, "-m", "tokenloom.entrypoints.cli", "--log-level", "WARNING"]
        command += ["serve", "--port", str(self.port), *args]
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                response = httpx.get(self.url + "/health", timeout=2, verify=self.verify)
                if response.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def openai_client(
        self, timeout: float, api_key: str = "none", max_retries: int = 2
    ) -> openai.OpenAI:
        """The official client, pointed at this server's /v1."""
        http_client = None if self.verify is True else httpx.Client(verify=self.verify)
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            http_client=http_client,
        )

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def engine_core_processes(self) -> list[psutil.Process]:
        """The server's child processes other than multiprocessing's resource tracker."""
        children = psutil.Process(self.proc.pid).children(recursive=True)
        return [p for p in children if "resource_tracker" not in " ".join(p.cmdline())]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def metric_values(url: str, verify: ssl.SSLContext | bool = True) -> dict[str, float]:
    """Every sample of /metrics keyed ``name{label=value,...}`` (labels sorted, model_name left out)."""
    text = httpx.get(url + "/metrics", timeout=10, verify=verify).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
            )
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``condition`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)
