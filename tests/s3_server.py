"""A real S3-API HTTP server for the tests: moto in server mode, in a child process of its own (so a
test can kill its S3 clients at will and the server lives on). No pytest import."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.1
# The server dies with the thread that started it (PR_SET_DEATHSIG), so a killed test process leaves no
# server behind; a parent already gone before the call is seen by the parent id check.
BOOTSTRAP = ("import ctypes, os, runpy, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
             "os.getppid() == int(sys.argv[1]) or sys.exit(1); sys.argv = ['moto.server'] + sys.argv[2:]; "
             "runpy.run_module('moto.server', run_name='__main__')")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class S3Server:
    """``S3Server().start()``: ``.url``, ``.env()`` (what a client process needs), ``.client()``,
    ``.create_bucket``, ``.stop()``. With ``check_credentials`` the server checks every request's
    access key against its own IAM (moto's ``INITIAL_NO_AUTH_ACTION_COUNT=0``): any key it has not
    issued, the tests' own included, is refused (403 InvalidAccessKeyId)."""

    def __init__(self, check_credentials: bool = False) -> None:
        self.url = ""
        self.check_credentials = check_credentials
        self._proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    def start(self, attempts: int = 3) -> "S3Server":
        """Start on a free port of 127.0.0.1 and wait until it answers; another port on a failed start
        (the free port taken meanwhile). Raises RuntimeError with the server's last output after
        ``attempts`` failures."""
        env = {**os.environ, **CREDENTIALS, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if self.check_credentials else {})}
        for _ in range(attempts):
            port = _free_port()
            self._log.seek(0)
            self._log.truncate()
            self._proc = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP, str(os.getpid()), "-H", "127.0.0.1", "-p", str(port)],
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env)
            self.url = f"http://127.0.0.1:{port}"
            if self._wait_up():
                return self
            self.stop()
        self._log.seek(0)
        tail = self._log.read().decode(errors="replace")[-2000:]
        raise RuntimeError(f"moto's S3 server did not start in {attempts} tries; its last output:\n{tail}")

    def _wait_up(self) -> bool:
        from deadlines import scaled

        deadline_s = time.monotonic() + scaled(START_TIMEOUT_S)
        while time.monotonic() < deadline_s and self.running():
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2).close()
                return self.running()  # and not some other server that took the port
            except OSError:
                time.sleep(POLL_INTERVAL_S)
        return False

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.url}

    def client(self, endpoint_url: str | None = None, **config: Any):
        """A boto3 S3 client of this server (or of ``endpoint_url``, a proxy in front of it);
        ``config``: botocore ``Config`` options, e.g. ``retries={"mode": "standard", "max_attempts": 5}``."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=endpoint_url or self.url, region_name=CREDENTIALS["AWS_REGION"],
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], config=Config(**config))

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(STOP_TIMEOUT_S)
            self._proc = None
