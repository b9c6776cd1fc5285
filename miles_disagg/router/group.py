"""The leader's side of a router of several processes on one port (``miles-disagg router --router-workers N``).

:class:`RouterGroup` owns what the processes share: a private directory (mode 0700, on ``/dev/shm`` where
there is one) with the table (:mod:`~miles_disagg.router.shared_table`), the leader's Unix socket for the
requests followers pass on (everything but generation: registry calls, ``/list_workers``, ``/health``,
``/metrics``), and the control socket on which each follower sends its news (one JSON object per line,
applied by :meth:`~miles_disagg.router.peers.LeaderPeers.apply_hint`).

Processes: the leader (this one, rank 0) binds the port with ``SO_REUSEPORT`` before it serves; once its
first health pass is done, :meth:`RouterGroup.start` starts ranks 1..N-1 (``python -m
miles_disagg.router.follower``), each binding the same port with ``SO_REUSEPORT``, so the kernel spreads
connections over the processes. A follower that exits is started again (after :data:`RESTART_DELAY_S`;
its load columns are cleared first: its requests ended with it); one that exited
:data:`MAX_RESTARTS` times stays down (the others serve on). A follower exits when its control connection
to the leader closes (the leader is gone). :meth:`RouterGroup.stop` ends the followers (SIGTERM, then
SIGKILL after :data:`STOP_TIMEOUT_S`) and removes the directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from miles_disagg.net.auth import ApiKeys
from miles_disagg.router.config import RouterConfig
from miles_disagg.router.peers import LeaderPeers
from miles_disagg.router.shared_table import PID, SharedTable

log = logging.getLogger(__name__)
TABLE_FILE, LEADER_SOCKET, CONTROL_SOCKET = "table", "leader.sock", "control.sock"
RESTART_DELAY_S = 1.0
MAX_RESTARTS = 5
STOP_TIMEOUT_S = 10.0
WATCH_PERIOD_S = 0.5


def _private_dir() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="miles-disagg-router-", dir=shm if shm.is_dir() else None))


class RouterGroup:
    """The table, the sockets and the followers of one router of ``processes`` processes."""

    def __init__(self, *, processes: int, host: str, port: int, config: RouterConfig, server_id: str,
                 keys: ApiKeys, max_request_bytes: int, log_level: str = "info"):
        if processes < 2:
            raise ValueError(f"a router group has at least 2 processes, got {processes}")
        self.processes, self.host, self.port = processes, host, port
        self.config, self.server_id, self.keys = config, server_id, keys
        self.max_request_bytes, self.log_level = max_request_bytes, log_level
        self.directory = _private_dir()
        self.table = SharedTable.create(self.directory / TABLE_FILE, processes)
        self.leader_socket = _unix_listener(self.directory / LEADER_SOCKET)
        self.followers: dict[int, subprocess.Popen] = {}
        self.restarts: dict[int, int] = {}
        self.peers: LeaderPeers | None = None
        self._control: asyncio.base_events.Server | None = None
        self._watch: asyncio.Task | None = None
        self._stopping = False

    async def start(self, router: Any) -> None:
        """Listen for the followers' news, start them, and watch them (the router's first pass is done)."""
        self.peers = router.peers
        self._control = await asyncio.start_unix_server(self._serve_follower, path=str(self.directory / CONTROL_SOCKET))
        for rank in range(1, self.processes):
            self._spawn(rank)
        self._watch = asyncio.create_task(self._watch_followers())

    def _spawn(self, rank: int) -> None:
        settings = {k: v for k, v in asdict(self.config).items() if k != "workers"}
        argv = [sys.executable, "-m", "miles_disagg.router.follower", "--dir", str(self.directory),
                "--rank", str(rank), "--host", self.host, "--port", str(self.port), "--server-id", self.server_id,
                "--config", json.dumps(settings), "--max-request-bytes", str(self.max_request_bytes),
                "--log-level", self.log_level]
        env = {**os.environ, **self.keys.env()}  # the keys reach the child without a command line `ps` shows
        self.followers[rank] = subprocess.Popen(argv, env=env)
        self.table.set_proc(rank, PID, float(self.followers[rank].pid))
        log.info("router process %d started (pid %d)", rank, self.followers[rank].pid)

    async def _watch_followers(self) -> None:
        while not self._stopping:
            await asyncio.sleep(WATCH_PERIOD_S)
            for rank, proc in list(self.followers.items()):
                if proc.poll() is None or self._stopping:
                    continue
                self.table.clear_process(rank)  # its requests ended with it
                del self.followers[rank]
                self.restarts[rank] = self.restarts.get(rank, 0) + 1
                if self.restarts[rank] > MAX_RESTARTS:
                    log.error("router process %d exited (code %s) %d times; it stays down, the others serve on",
                              rank, proc.returncode, self.restarts[rank])
                    continue
                log.error("router process %d exited (code %s); starting it again", rank, proc.returncode)
                await asyncio.sleep(RESTART_DELAY_S)
                if not self._stopping:
                    self._spawn(rank)

    async def _serve_follower(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One follower's control connection: its hello (``{"rank"}``), then its news, until it closes."""
        rank = None
        try:
            while line := await reader.readline():
                message = json.loads(line)
                if rank is None:
                    rank = int(message["rank"])
                elif self.peers is not None:
                    self.peers.apply_hint(rank, message)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("router process %s sent a malformed control message: %s", rank, exc)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        """End the followers, close the sockets, remove the directory."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for proc in self.followers.values():
            proc.terminate()
        for rank, proc in self.followers.items():
            try:
                await asyncio.to_thread(proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("router process %d did not stop in %.0f s; killing it", rank, STOP_TIMEOUT_S)
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._control is not None:
            self._control.close()
        self.close()

    def close(self) -> None:
        """Release the table and the sockets and remove the directory (idempotent)."""
        if self.directory.exists():
            self.leader_socket.close()
            self.table.close()
            shutil.rmtree(self.directory, ignore_errors=True)


def _unix_listener(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1024)
    return sock
