"""A local Ray started by a run keeps Ray's token authentication on and starts, on a fresh machine
(no ``~/.ray/auth_token``, no ``RAY_AUTH_*`` in the environment) and on one where Ray wrote its
token earlier: the demo's own paths. The rest of the suite runs with ``RAY_AUTH_MODE=disabled``,
so these are the tests of it. The same local Ray runs its workers at the run's niceness (0), not
Ray's default 15 (``LOCAL_RAY_SYSTEM_CONFIG``; the suite's environment sets it for the Rays the
tests start themselves, so it is left out here)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from deadlines import scaled

PROBE = """
import os, ray
from miles_disagg.loop.ray_start import init_ray
assert init_ray(1)
print(ray.get(ray.remote(lambda: 7).remote()))
print(os.environ.get("RAY_AUTH_MODE"))  # Ray sets it to token when it turns token authentication on
print(ray.get(ray.remote(lambda: os.nice(0)).remote()))  # the workers' niceness: the run's, not Ray's 15
ray.shutdown()
"""


def test_a_run_on_a_machine_without_a_ray_token_starts_ray_with_token_auth(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_worker_niceness"}
    env.update(HOME=str(tmp_path), MILES_DISAGG_RAY_TMPDIR=tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["7", "token", "0"]  # Ray's default stands: auth on, its own token
    assert "Token authentication is enabled" not in done.stderr  # Ray's notice is not printed on every run
    assert (tmp_path / ".ray" / "auth_token").stat().st_size > 0


def test_a_run_on_a_machine_with_a_ray_token_starts_ray_with_token_auth(tmp_path):
    """~/.ray/auth_token exists (Ray wrote it on an earlier run) and ``ray`` is imported before the
    run starts its Ray: the driver must still send the token (it once sent none, and the run died
    on an authentication error)."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("5f" * 32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_worker_niceness"}
    env.update(HOME=str(tmp_path), MILES_DISAGG_RAY_TMPDIR=tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["7", "token", "0"]
    assert "Token authentication is enabled" not in done.stderr
    assert (tmp_path / ".ray" / "auth_token").read_text() == "5f" * 32  # its own token, not a new one
