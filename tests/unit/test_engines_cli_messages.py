"""``miles-disagg engines list|add|remove`` when there is no running job to talk to, or the job refuses
the key (issue 34): through the command line, each case is its own line (exit 2, no traceback): no such
directory, a directory that is not a run directory, a run that has finished, a run whose control
endpoint is gone; a refused key names where it came from (``--admin-api-key``,
``$MILES_DISAGG_ADMIN_API_KEY`` or the run directory's ``control.key``)."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from miles_disagg.cli import main
from miles_disagg.net.process import free_port

pytestmark = pytest.mark.timeout(60)
ENV = "MILES_DISAGG_ADMIN_API_KEY"


def engines(capsys, *argv: str) -> str:
    code = main(["engines", *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def a_run_dir(path: Path, *, finished: bool = False, control_url: str | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if finished:
        (path / "summary.json").write_text("{}")
    if control_url:
        (path / "control.json").write_text(json.dumps({"url": control_url, "pid": 1}))
    return path


def test_each_case_without_a_running_job_says_which(capsys, tmp_path) -> None:
    missing = tmp_path / "runs" / "typo"
    assert engines(capsys, "list", "--run-dir", str(missing)).endswith(f"no running job in {missing}: no such directory")
    (tmp_path / "plain").mkdir()
    err = engines(capsys, "list", "--run-dir", str(tmp_path / "plain"))
    assert "not a run directory (no config.json): give the --run-dir the run was started with" in err
    (tmp_path / "a-file").write_text("x")
    assert engines(capsys, "list", "--run-dir", str(tmp_path / "a-file")).endswith(": not a directory")
    finished = a_run_dir(tmp_path / "finished", finished=True)
    assert "the run there has finished (it wrote summary.json)" in engines(capsys, "list", "--run-dir", str(finished))
    starting = a_run_dir(tmp_path / "starting")
    assert "the run there has no control endpoint (no control.json)" in engines(capsys, "list", "--run-dir",
                                                                                str(starting))
    assert "no such directory" in engines(capsys, "add", "--run-dir", str(missing), "127.0.0.1:1")
    assert "not a run directory" in engines(capsys, "remove", "--run-dir", str(tmp_path / "plain"), "127.0.0.1:1")


def test_a_run_whose_control_endpoint_is_gone(capsys, tmp_path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    killed = a_run_dir(tmp_path / "killed", control_url=url)
    err = engines(capsys, "list", "--run-dir", str(killed))
    assert err.endswith(f"no running job in {killed}: its control endpoint {url} (from control.json) does not "
                        "answer: the run has ended without removing it"), err
    (killed / "summary.json").write_text("{}")
    assert err.split(": the run")[0] in engines(capsys, "list", "--run-dir", str(killed))
    assert "does not answer: the run has finished" in engines(capsys, "list", "--run-dir", str(killed))


class RefusingControl(http.server.BaseHTTPRequestHandler):
    """A control endpoint that accepts only the key ``right`` (as the run's answers a wrong one: 401 JSON)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.headers.get("Authorization") == "Bearer right":
            body, status = {"version": 0, "engines": []}, 200
        else:
            body, status = {"error": {"message": "/engines needs the run's admin key"}}, 401
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def control(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RefusingControl)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield a_run_dir(tmp_path / "run", control_url=f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


def test_a_refused_key_names_where_it_came_from(capsys, control, monkeypatch) -> None:
    run_dir = str(control)
    monkeypatch.delenv(ENV, raising=False)
    refusal = "/engines needs the run's admin key"
    assert engines(capsys, "list", "--run-dir", run_dir) == (
        f"miles-disagg engines: error: the run needs its admin key and none was found (no --admin-api-key, ${ENV} "
        f"unset, no readable {control / 'control.key'}): {refusal}")
    (control / "control.key").write_text("stale\n")
    assert engines(capsys, "list", "--run-dir", run_dir).endswith(
        f"the run refused the key from {control / 'control.key'}: {refusal}")
    (control / "control.key").write_text("right\n")
    assert main(["engines", "list", "--run-dir", run_dir]) == 0 and "run version 0" in capsys.readouterr().out
    monkeypatch.setenv(ENV, "from-another-shell")
    assert engines(capsys, "list", "--run-dir", run_dir).endswith(
        f"the run refused the key from ${ENV}; unset it to use {control / 'control.key'}: {refusal}")
    assert engines(capsys, "list", "--run-dir", run_dir, "--admin-api-key", "typo").endswith(
        f"the run refused the key from --admin-api-key; {control / 'control.key'} holds the run's own: {refusal}")
    monkeypatch.delenv(ENV)
    assert main(["engines", "list", "--run-dir", run_dir]) == 0
