"""``--dry-run``: the launch plan (placement, processes, delta filter) without starting anything.

Driven through the entry point (``launcher.main``, what train_async.py calls) with stdout
captured: exit 0 and one JSON object. Attached engines are real HTTP servers on 127.0.0.1:
the built-in engine announces the byte-plane format; a stock-SGLang-like server does not.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deadlines import scaled
from engine_fixtures import start_engine, stop_engine
from miles_disagg.launcher import main
from miles_disagg.types import ConfigError

pytestmark = pytest.mark.timeout(scaled(180))


def dry_run(capsys, *argv: str) -> dict:
    code = main("train_async", [*argv, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def disk_delta(tmp_path: Path, base: Path) -> list[str]:
    return ["--hf-checkpoint", str(base), "--update-weight-transfer-mode", "disk-delta",
            "--update-weight-disk-dir", str(tmp_path / "store"), "--num-rollout", "2", "--rollout-batch-size", "4",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--train-backend", "fsdp",
            "--run-dir", str(tmp_path / "run")]


def test_managed_built_in_engines_get_byte_planes(capsys, tmp_path, tiny_qwen3_dir) -> None:
    plan = dry_run(capsys, *disk_delta(tmp_path, tiny_qwen3_dir), "--rollout-backend", "builtin")
    assert plan["delta_filter"]["filter"] == "byteplane"
    engines = [p for p in plan["processes"] if p["role"] == "engine"]
    assert [p["bundles"] for p in engines] == [[1], [2]]
    assert engines[0]["argv"][1:4] == ["-m", "miles_disagg.engines.builtin", "--model-path"]
    assert plan["placement"]["trainer"] == [{"rank": 0, "bundle": 0}]
    assert not (tmp_path / "run").exists()


def test_an_sglang_launch_plan_gets_the_plain_format(capsys, tmp_path, tiny_qwen3_dir) -> None:
    plan = dry_run(capsys, *disk_delta(tmp_path, tiny_qwen3_dir), "--rollout-backend", "sglang",
                   "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7")
    assert plan["delta_filter"]["filter"] == "none" and "SGLang engine 0" in plan["delta_filter"]["reason"]
    sglang = [p for p in plan["processes"] if p["role"] == "sglang"]
    agents = [p for p in plan["processes"] if p["role"] == "agent"]
    assert len(sglang) == 1 and len(agents) == 1
    argv = sglang[0]["argv"]
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--base-gpu-id") + 1] == "{base_gpu_id}"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.7"
    assert agents[0]["argv"][agents[0]["argv"].index("--engine-url") + 1] == "http://{host}:{port}"


class _StockSglangHandler(BaseHTTPRequestHandler):
    """Answers like a stock SGLang server: no ``miles_disagg`` announcement, no ``/agent_info``."""

    def do_GET(self):  # noqa: N802
        if self.path in ("/get_server_info", "/health"):
            body = json.dumps({"model_path": "/models/x", "tp_size": 1, "weight_version": "0"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture
def stock_sglang():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StockSglangHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def builtin_engine(tiny_qwen3_dir, tmp_path_factory):
    handle = start_engine(tiny_qwen3_dir, tmp_path_factory.mktemp("dry-run-engine"))
    yield handle
    stop_engine(handle)


def attached(*addrs: str) -> list[str]:
    return ["--rollout-external", "--rollout-external-engine-addrs", *addrs]


def test_attached_engines_that_do_not_announce_the_format_get_the_plain_format(capsys, tmp_path, tiny_qwen3_dir,
                                                                               stock_sglang, builtin_engine) -> None:
    ours = builtin_engine.url.removeprefix("http://")
    plan = dry_run(capsys, *disk_delta(tmp_path, tiny_qwen3_dir), *attached(ours, stock_sglang))
    assert plan["topology"] == "attached" and plan["placement"]["engines"] == []
    assert [p["role"] for p in plan["processes"]] == ["router"]
    assert plan["delta_filter"]["filter"] == "none"
    assert f"attached engine {stock_sglang} (announces no format)" in plan["delta_filter"]["reason"]


def test_attached_built_in_engines_announce_byte_planes(capsys, tmp_path, tiny_qwen3_dir, builtin_engine) -> None:
    plan = dry_run(capsys, *disk_delta(tmp_path, tiny_qwen3_dir), *attached(builtin_engine.url.removeprefix("http://")))
    assert plan["delta_filter"]["filter"] == "byteplane"


def test_unreachable_attached_engines_fail_at_once_each_named(capsys, tmp_path, tiny_qwen3_dir, stock_sglang) -> None:
    """All addresses are asked at once; a refused connection fails without waiting, and every engine that did
    not answer is named (an answering one is not)."""
    import time

    from miles_disagg.net.process import free_port

    closed = [f"127.0.0.1:{free_port('127.0.0.1')}" for _ in range(2)]
    for mode in (["--dry-run"], []):  # a real run asks them before Ray starts, as the dry run does
        start = time.monotonic()
        code = main("train_async", [*disk_delta(tmp_path, tiny_qwen3_dir), *attached(closed[0], stock_sglang, closed[1]),
                                    *mode])
        out, err = capsys.readouterr()
        assert code == 2 and out == "", err
        assert time.monotonic() - start < scaled(10)  # a refused connection is not waited for
        assert "--rollout-external-engine-addrs: 2 of 3 did not answer" in err and all(f"{addr}: cannot connect" in err for addr in closed)
        assert f"{stock_sglang}:" not in err and "Traceback" not in err
        assert not (tmp_path / "run").exists()


class _SlowToStartHandler(_StockSglangHandler):
    ready_at = 0.0

    def do_GET(self):  # noqa: N802
        import time

        if self.path == "/health" and time.monotonic() < self.ready_at:
            self.send_error(503)
            return
        super().do_GET()


def test_a_slow_attached_engine_is_waited_for_with_progress_lines(capsys, tmp_path, tiny_qwen3_dir, monkeypatch) -> None:
    import time

    from miles_disagg.loop import engine_probe

    monkeypatch.setattr(engine_probe, "PROGRESS_EVERY_S", 0.3)
    _SlowToStartHandler.ready_at = time.monotonic() + 2.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowToStartHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    addr = f"127.0.0.1:{server.server_address[1]}"
    try:
        code = main("train_async", [*disk_delta(tmp_path, tiny_qwen3_dir), *attached(addr), "--dry-run"])
    finally:
        server.shutdown()
        server.server_close()
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["topology"] == "attached"
    assert "waiting for --rollout-external-engine-addrs to answer /health" in err and f"{addr} (/health answered 503)" in err


def test_the_probe_prints_what_it_waits_for(capsys, monkeypatch) -> None:
    import time

    from miles_disagg.loop import engine_probe

    monkeypatch.setattr(engine_probe, "PROGRESS_EVERY_S", 0.3)
    _SlowToStartHandler.ready_at = time.monotonic() + 1.5
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowToStartHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    addr = f"127.0.0.1:{server.server_address[1]}"
    try:
        engine_probe.probe_engines([addr], timeout_s=30)
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert "waiting for --rollout-external-engine-addrs to answer /health" in err and f"{addr} (/health answered 503)" in err


def test_an_engine_that_never_answers_fails_when_the_wait_ends(capsys, monkeypatch) -> None:
    import time

    from miles_disagg.loop import engine_probe

    _SlowToStartHandler.ready_at = time.monotonic() + 3600
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowToStartHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    addr = f"127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ConfigError, match=f"{addr}: no answer within the wait \\(/health answered 503\\)"):
            engine_probe.probe_engines([addr], timeout_s=1.5)
    finally:
        server.shutdown()
        server.server_close()


def test_dry_run_refuses_what_the_run_would_refuse(capsys, tmp_path, tiny_qwen3_dir) -> None:
    code = main("train_async", [*disk_delta(tmp_path, tiny_qwen3_dir), "--custom-update-weight-post-write-path",
                                "no_such_module_xyz.hook", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "--custom-update-weight-post-write-path" in err
    code = main("train_async", [*disk_delta(tmp_path, tiny_qwen3_dir), "--train-backend", "megatron",
                                "--tensor-model-parallel-size", "3", "--actor-num-gpus-per-node", "3",
                                "--rollout-batch-size", "6", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2 and "--tensor-model-parallel-size" in err


def test_router_settings_reach_the_router_argv(capsys, tmp_path, tiny_qwen3_dir) -> None:
    plan = dry_run(capsys, *disk_delta(tmp_path, tiny_qwen3_dir), "--sglang-router-port", "31001",
                   "--rollout-health-check-interval", "3", "--rollout-health-check-timeout", "4",
                   "--rollout-health-check-failure-threshold", "5", "--router-workers", "2")
    router = plan["processes"][0]["argv"]
    for flag, value in (("--port", "31001"), ("--health-check-interval", "3.0"), ("--health-check-timeout", "4.0"),
                        ("--health-failure-threshold", "5"), ("--router-workers", "2")):
        assert router[router.index(flag) + 1] == value, flag
    plan = dry_run(capsys, *disk_delta(tmp_path, tiny_qwen3_dir), "--router", "sglang", "--sglang-router-policy",
                   "cache_aware")
    router = plan["processes"][0]
    assert router["role"] == "sglang-router" and router["argv"][1:3] == ["-m", "sglang_router.launch_router"]
    assert router["argv"][router["argv"].index("--policy") + 1] == "cache_aware"


def test_ctrl_c_while_waiting_for_an_engine_ends_with_one_line(tmp_path, tiny_qwen3_dir) -> None:
    """Nothing has started while the checks wait: exit 130, one line, no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    _SlowToStartHandler.ready_at = time.monotonic() + 3600
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowToStartHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    addr = f"127.0.0.1:{server.server_address[1]}"
    try:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parents[2] / "train_async.py"),
                                 *disk_delta(tmp_path, tiny_qwen3_dir), *attached(addr)],
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        lines = []
        while not any("waiting for --rollout-external-engine-addrs" in line for line in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=scaled(30)) == 130, rest
        assert rest.strip().splitlines() == ["train_async.py: interrupted before the run started"], rest
    finally:
        server.shutdown()
        server.server_close()
    assert not (tmp_path / "run").exists()


def test_the_session_endpoint_is_in_the_plan_and_its_miles_flags_are_checked(capsys, tmp_path, tiny_qwen3_dir,
                                                                           monkeypatch) -> None:
    (tmp_path / "my_agents.py").write_text("async def run_agent(base_url, prompt, request_kwargs, metadata):\n"
                                          "    return None\n\ndef not_async(base_url, prompt, request_kwargs, metadata):\n"
                                          "    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sessions = ["--use-session-server", "--custom-agent-function-path", "my_agents.run_agent", "--tito-model", "qwen3",
                "--tito-allowed-append-roles", "tool", "user"]
    plan = dry_run(capsys, *disk_delta(tmp_path, tiny_qwen3_dir), "--rollout-backend", "builtin", *sessions,
                   "--session-server-port", "31234")
    assert plan["sessions"]["address"] == "http://127.0.0.1:31234"
    assert plan["sessions"]["allowed_append_roles"] == ["tool", "user"]
    assert "POST /sessions/{id}/v1/chat/completions" in plan["sessions"]["routes"]
    for matcher in ("loose_tool_call", "role_content_only"):  # miles' matchers, with miles' meanings
        dry_run(capsys, *disk_delta(tmp_path, tiny_qwen3_dir), *sessions, "--session-message-matcher", matcher)
    for extra, message in ((["--tito-model", "glm47"], "--tito-model glm47 is a miles flag that does not apply here"),
                           (["--session-message-matcher", "loose"], "--session-message-matcher 'loose': unknown"),
                           (["--session-message-matcher", "nowhere.same"], "--session-message-matcher"),
                           (["--session-server-port", "1", "2"], "one port"),
                           (["--custom-generate-function-path", "x.y"], "would replace it")):
        assert main("train_async", [*disk_delta(tmp_path, tiny_qwen3_dir), *sessions, *extra, "--dry-run"]) == 2
        assert message in capsys.readouterr().err
    agent = sessions.index("--custom-agent-function-path") + 1
    for bad, message in (("my_agents.not_async", "must be an async def function"), ("nowhere.run_agent", "cannot import")):
        wrong = sessions[:agent] + [bad] + sessions[agent + 1:]
        assert main("train_async", [*disk_delta(tmp_path, tiny_qwen3_dir), *wrong, "--dry-run"]) == 2
        assert message in capsys.readouterr().err
    assert main("train_async", [*disk_delta(tmp_path, tiny_qwen3_dir), "--custom-agent-function-path", "a.b",
                                "--dry-run"]) == 2
    assert "add --use-session-server" in capsys.readouterr().err
    miles_generate = ["--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate"]
    assert main("train_async", [*disk_delta(tmp_path, tiny_qwen3_dir), *miles_generate, "--dry-run"]) == 2
    assert "add --use-session-server" in capsys.readouterr().err
    plan = dry_run(capsys, *disk_delta(tmp_path, tiny_qwen3_dir), *sessions, *miles_generate)  # miles' own line
    assert plan["sessions"]["agent"] == "my_agents.run_agent"
