"""``miles-disagg bench scale --sections service``: the rollout service's gateway and replicas (real code, one
simulated engine each) converge on every published version, and the bench prints the figures as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import scaled

pytestmark = pytest.mark.timeout(180)
PULL_MS, LOAD_MS = 60, 30
REPLICAS = 2  # "every replica", and 50% of them before all of them


def _bench(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_disagg.cli", "bench", "scale", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_every_replica_converges_on_every_version_and_the_figures_are_printed(tmp_path: Path) -> None:
    result = _bench("--sections", "service", "--service-replicas", str(REPLICAS), "--service-versions", "2",
                    "--service-poll-interval", "0.2", "--idle-measure", "0.5", "--pull-ms", str(PULL_MS),
                    "--load-ms", str(LOAD_MS), "--work-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert "pools" not in out  # only the section asked for ran
    service = out["service"]
    assert service["num_replicas"] == REPLICAS and service["replicas_registered"] == REPLICAS
    assert service["replicas_converged"] == REPLICAS and service["versions"] == [2, 3]
    for version in ("2", "3"):
        converged = service["convergence_s"][version]
        # staging and activating take the simulated pull and load at least, after the commit
        assert converged["1"] >= (PULL_MS + LOAD_MS) / 1e3 and converged["0.5"] <= converged["1"]
        assert service["client_convergence_s"][version] > 0
    assert service["convergence_s_max"] >= service["convergence_s_p50"] > 0
    assert service["pause_s_max"] >= LOAD_MS / 1e3 and service["prepare_s_mean"] >= PULL_MS / 1e3
    for phase in ("idle", "rolling_out"):
        assert set(service["cpu_cores"][phase]) == {"gateway", "replicas", "sim_engines", "wall_s"}
    assert all(service["rss_mb"][name]["rss"] > 0 for name in ("gateway", "replicas", "sim_engines"))
    replicas_log = (tmp_path / "service" / "replicas.log").read_text()
    assert "deregister failed" not in replicas_log and "Traceback" not in replicas_log


def test_a_service_section_without_replicas_is_refused_naming_the_flag() -> None:
    result = _bench("--sections", "service", "--service-replicas", "0", timeout=scaled(60))
    assert result.returncode == 2 and "--service-replicas" in result.stderr
    assert result.stdout == ""
