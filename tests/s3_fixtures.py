"""pytest fixtures around :class:`s3_server.S3Server`: one server per test process, a fresh bucket per test."""

from __future__ import annotations

import uuid

import pytest

from s3_server import S3Server


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """``(server, bucket)``: a bucket no other test uses."""
    yield s3_server, s3_server.create_bucket(f"test-{uuid.uuid4().hex[:16]}")


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """This process (and the children it starts) speak to the server with its credentials."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server.env()
