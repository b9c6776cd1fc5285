"""What ``bench store`` runs beside it: an S3-API server, a region's relay, and simulated engine hosts.

A simulated engine host is a process that does exactly what an engine's ``/pull_weights`` does on
its host (a :class:`~miles_disagg.weights.materializer.Materializer` pulling, applying and verifying
a version into its own local checkpoint) and nothing else: no model runs. Each is started before the
clock starts (its imports are not timed), waits for a version number on stdin, and answers one JSON
line per version (seconds, of which fetching the version's objects, bytes by source, its peak RSS).
``pull-only`` mode fetches a version's
objects without applying them, for the memory measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.net.process import free_port


@dataclass
class LocalS3:
    """``python -m moto.server`` on loopback (moto's S3 API: a real HTTP server speaking S3's REST protocol)."""

    proc: subprocess.Popen
    url: str

    @classmethod
    def start(cls, timeout_s: float = 60.0) -> "LocalS3":
        port = free_port("127.0.0.1")
        try:
            import moto  # noqa: F401 - only to say clearly what is missing
        except ImportError:
            raise SystemExit("bench store: no S3-API server: pip install 'moto[server]' (the test extra), "
                             "or give --endpoint URL of one") from None
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = cls(proc, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{server.url}/moto-api/", timeout=2).close()
                return server
            except OSError:
                time.sleep(0.1)
        server.stop()
        raise RuntimeError("moto's S3 server did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


class Relay:
    """A ``miles-disagg relay`` child process serving ``store`` on a free loopback port."""

    def __init__(self, store: str, cache_dir: Path, env: dict[str, str], region: str):
        port = free_port("127.0.0.1")
        self.proc = subprocess.Popen([sys.executable, "-m", "miles_disagg.cli", "relay", "--store", store,
                                      "--cache-dir", str(cache_dir), "--port", str(port), "--region", region,
                                      "--log-level", "warning"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if "listening" not in (self.proc.stdout.readline() if self.proc.stdout else ""):
            raise RuntimeError("the relay did not start")
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


class EngineHost:
    """One simulated engine host (a child process of :func:`host_main`)."""

    def __init__(self, store: str, local_dir: Path, base_dir: Path, env: dict[str, str], pull_only: bool = False):
        self.proc = subprocess.Popen([sys.executable, "-m", "miles_disagg.bench.store_fleet", store, str(local_dir),
                                      str(base_dir), "pull" if pull_only else "prepare"],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, what: str) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        answer = json.loads(line) if line.startswith("{") else {"error": f"no answer (exit {self.proc.poll()})"}
        if "error" in answer or answer.get("state") not in (what, None):
            raise RuntimeError(f"an engine host failed: {answer}")
        return answer

    def ask(self, version: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{version}\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        return self._expect("done")

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def all_ready(hosts: list[EngineHost], version: int) -> tuple[float, list[dict]]:
    """Ask every host for ``version`` at once; the seconds until the last is ready, and their answers."""
    start = time.perf_counter()
    for host in hosts:
        host.ask(version)
    answers = [host.answer() for host in hosts]
    return time.perf_counter() - start, answers


class PeakRss:
    """This process's largest resident set while it runs, sampled every ``interval_s`` from /proc (the
    kernel's high-water mark, ``ru_maxrss``, starts at the parent's size at fork: useless for a child)."""

    def __init__(self, interval_s: float = 0.01):
        import threading

        self.peak = _rss_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True)
        self._thread.start()

    def _sample(self, interval_s: float) -> None:
        while not self._done.wait(interval_s):
            self.peak = max(self.peak, _rss_bytes())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, _rss_bytes())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host_main(store: str, local_dir: str, base_dir: str, mode: str) -> None:
    from miles_disagg.weights.materializer import Materializer
    from miles_disagg.weights.stores import open_store

    materializer = Materializer(local_dir, base_dir=base_dir)
    if "://" in store:  # a long-running engine has paid its S3 client's import before a version comes
        from miles_disagg.weights.location import parse_object_url
        from miles_disagg.weights.s3_client import ObjectClient

        ObjectClient(parse_object_url(store))
    print(json.dumps({"state": "ready"}), flush=True)
    for line in sys.stdin:
        version = int(line)
        start = time.perf_counter()
        sampler = PeakRss()
        try:
            if mode == "pull":
                reader = open_store(store, cache_dir=Path(local_dir) / "mirror")
                reader.version_files(version)
                transfer, fetch_s = reader.transfer_counts(), time.perf_counter() - start
            else:
                prepared = materializer.prepare(store, version)
                transfer, fetch_s = prepared.transfer, prepared.fetch_s
        except Exception as exc:  # noqa: BLE001 - reported to the bench, which fails
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
            continue
        finally:
            peak = sampler.stop()
        seconds = time.perf_counter() - start
        print(json.dumps({"state": "done", "seconds": seconds, "fetch_s": fetch_s,
                          "transfer": transfer, "peak_rss_bytes": peak}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    host_main(*sys.argv[1:5])
