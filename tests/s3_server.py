"""A real S3-API HTTP server for the tests: moto in server mode, in a child process of its own (so a
test can kill its S3 clients at will and the server lives on). No pytest import."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class S3Server:
    """``S3Server().start()``: ``.url``, ``.env()`` (what a client process needs), ``.create_bucket``, ``.stop()``."""

    def __init__(self, *, check_credentials: bool = False) -> None:
        """``check_credentials``: moto checks every request's key against its IAM (which knows none): any
        credentials are refused, as a real store refuses wrong ones."""
        self.url = ""
        self.check_credentials = check_credentials
        self._proc: subprocess.Popen | None = None

    def start(self, attempts: int = 3) -> "S3Server":
        for attempt in range(attempts):
            port = _free_port()
            self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          env={**os.environ, **CREDENTIALS,
                                               **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if self.check_credentials else {})})
            self.url = f"http://127.0.0.1:{port}"
            if self._wait_up():
                return self
            self.stop()
        raise RuntimeError(f"moto's S3 server did not start in {attempts} tries")

    def _wait_up(self) -> bool:
        from deadlines import scaled

        deadline = time.monotonic() + scaled(START_TIMEOUT_S)
        while time.monotonic() < deadline and self._proc is not None and self._proc.poll() is None:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2).close()
                return True
            except OSError:
                time.sleep(0.1)
        return False

    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.url}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name=CREDENTIALS["AWS_REGION"],
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(30)
            self._proc = None
