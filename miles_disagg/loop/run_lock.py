"""A run directory belongs to one run: the lock a run holds on it for its whole life.

The lock is ``RUN_DIR/run.lock``, held with ``flock`` on an open descriptor: the kernel drops it
when the holding process ends, however it ends (SIGKILL included), so a dead run never blocks
the next one. The file records who holds it (pid, host, start time, argv); a second run on the
same directory reads that record and exits 2 at once naming the holder. A run that finds a
record it could lock (the previous holder died without releasing it) takes it over with a
warning. The file is never deleted: unlinking a lock file while another process is about to
lock it would let two runs each lock their own inode.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.tracking import status
from miles_disagg.types import ConfigError

LOCK_FILENAME = "run.lock"
MAX_RECORD_BYTES = 64 * 1024  # a record is a few hundred bytes; anything larger is not ours


class RunDirLocked(ConfigError):
    """Another live run holds the run directory; nothing was written."""

    def __init__(self, message: str, holder: dict | None = None, flag: str = "--run-dir"):
        super().__init__(message, (flag,))
        self.holder = holder or {}


@dataclass
class RunDirLock:
    """The held lock of one run directory; :meth:`release` (or the process's end) frees it."""

    path: Path
    fd: int | None
    record: dict

    @classmethod
    def acquire(cls, run_dir: str | Path, *, flag: str = "--run-dir") -> "RunDirLock":
        """Create ``run_dir`` if needed and lock it; ``RunDirLocked`` (exit 2) when a live run holds it."""
        import fcntl

        directory = Path(run_dir)
        path = directory / LOCK_FILENAME
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"{flag} {str(directory)!r}: cannot create {LOCK_FILENAME} there "
                              f"({exc.strerror or exc})", (flag,)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            raise RunDirLocked(f"{flag} {str(directory)!r} is in use by another run ({describe(holder)}); "
                               f"give this run its own {flag}, or wait for that one to end", holder, flag) from None
        except BaseException:
            os.close(fd)
            raise
        previous = _read_record(fd)
        if previous and not previous.get("released"):
            status(f"warning: {path}: taking over the lock of a run that ended without releasing it "
                   f"({describe(previous)})")
        record = _own_record()
        _write_record(fd, record)
        return cls(path, fd, record)

    def release(self) -> None:
        """Mark the record released and unlock (the file stays: see the module docstring)."""
        if self.fd is None:
            return
        try:
            _write_record(self.fd, {**self.record, "released": True, "ended": time.time()})
        finally:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def describe(holder: dict) -> str:
    """``pid 123 on host h, started 2026-01-01 12:00:00 UTC`` (what is known of it)."""
    if not holder:
        return "holder unknown: its lock record is empty or unreadable"
    parts = [f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"]
    started = holder.get("started")
    if isinstance(started, (int, float)):
        parts.append(f"started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(started))}")
    return ", ".join(parts)


def _own_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "argv": [str(a) for a in sys.argv[:64]]}


def _read_record(fd: int) -> dict:
    """The record in the lock file; ``{}`` for an empty, oversized or malformed one (hostile input)."""
    try:
        raw = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
    except OSError:
        return {}
    if not raw or len(raw) > MAX_RECORD_BYTES:
        return {}
    try:
        record = json.loads(raw.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(fd: int, record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def outputs_to_lock(config) -> list[tuple[str, Path]]:
    """``(flag, directory)`` a run holds: its run directory and, outside it, a version store it
    publishes into and its ``--save`` directory (a second run would reset the store under it, and
    its saves would mix with the first's), where this machine sees their parent."""
    run_dir = Path(config.tracking.run_dir)
    outputs = [("--run-dir", run_dir)]
    if config.rollout.debug_rollout_only:
        return outputs
    store, save = config.weights.update_weight_disk_dir, config.train.save
    if config.weights.update_weight_transfer_mode == "disk-delta" and store and "://" not in store:  # a URL: no directory to lock
        outputs.append(("--update-weight-disk-dir", Path(store)))
    if save:
        outputs.append(("--save", Path(save)))
    return [(flag, path) for flag, path in outputs
            if flag == "--run-dir" or (not path.is_relative_to(run_dir) and path.parent.is_dir())]


def apparent_holder(directory: Path) -> dict | None:
    """Without locking (``--dry-run`` must not get in a starting run's way): the record of a run that
    has not released ``directory``'s lock and whose pid is alive on this host, or on another host
    (not checkable from here); None when no run appears to hold it."""
    path = directory / LOCK_FILENAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        record = _read_record(fd)
    finally:
        os.close(fd)
    if not record or record.get("released"):
        return None
    if record.get("host") != socket.gethostname():
        return record
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return record

