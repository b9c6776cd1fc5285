"""``miles-disagg engines add|remove|list --run-dir DIR``: change the engine set of a running job.

The running job's engine manager serves a control endpoint and writes its address to
``DIR/control.json`` (:mod:`miles_disagg.fleet.control_server`); these commands call it with
the run's admin key (``--admin-api-key``, else ``$MILES_DISAGG_ADMIN_API_KEY``, else
``DIR/control.key``, which the run writes for its user). ``add`` returns once each engine serves
the run's current version and the router routes to it; ``remove`` once each drained and left.

Errors are one line and exit 2, nothing changed: no running job in DIR (saying which case: no such
directory, not a run directory, a run that has finished or whose control endpoint is gone), a
key the run refuses (saying where it came from: the flag, the variable or ``control.key``), an
engine that does not answer or does not match the job, an address that is not an engine of the
run, removing the last engine (``--force`` removes it anyway).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_disagg.config.commands import action_config, add_actions
from miles_disagg.config.fields import REQUIRED, flag
from miles_disagg.types import InvalidInput, MilesDisaggError

RUN_DIR_HELP = "The run directory of the running job (its --run-dir)."
KEY_HELP = "The run's admin key (default: $MILES_DISAGG_ADMIN_API_KEY, else RUN_DIR/control.key)."
JSON_HELP = "Print one JSON object instead of a table."


@dataclass(kw_only=True)
class AddCommand:
    """attach running engines (or start managed ones) and route to them once caught up"""

    run_dir: str = flag(REQUIRED, RUN_DIR_HELP)
    managed: int = flag(0, "Start this many more managed engines on GPUs the cluster has free (instead of URLs).")
    admin_api_key: str | None = flag(None, KEY_HELP, metavar="KEY")
    timeout: float = flag(1800.0, "Seconds to wait for the engines to join (catch-up included).")
    json: bool = flag(False, JSON_HELP)
    urls: list[str] = flag([], "Engines to attach (host:port or http://host:port), after the flags.",
                           positional=True, metavar="URL")


@dataclass(kw_only=True)
class RemoveCommand:
    """drain engines (no new requests, in-flight ones finish) and take them out of the run"""

    run_dir: str = flag(REQUIRED, RUN_DIR_HELP)
    force: bool = flag(False, "Remove even the last live engine (rollout then waits until one joins).")
    drain_timeout: float = flag(120.0, "Seconds to wait for in-flight requests before removing anyway.")
    admin_api_key: str | None = flag(None, KEY_HELP, metavar="KEY")
    json: bool = flag(False, JSON_HELP)
    urls: list[str] = flag([], "Engines to remove (as `engines list` shows them), after the flags.",
                           positional=True, metavar="URL")


@dataclass(kw_only=True)
class ListCommand:
    """every engine of the running job: its version, state and node"""

    run_dir: str = flag(REQUIRED, RUN_DIR_HELP)
    admin_api_key: str | None = flag(None, KEY_HELP, metavar="KEY")
    json: bool = flag(False, JSON_HELP)


ACTIONS = {"add": AddCommand, "remove": RemoveCommand, "list": ListCommand}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_actions(parser, "engines_command", "ACTION", ACTIONS)


def run(args: argparse.Namespace) -> int:
    command = action_config(args, "engines_command", ACTIONS)
    client = ControlClient.of_run(Path(command.run_dir), command.admin_api_key)
    if isinstance(command, ListCommand):
        answer = client.call("GET", "/engines", timeout_s=60)
        print(json.dumps(answer) if command.json else engines_table(answer))
        return 0
    urls = _addresses(command.urls)
    if isinstance(command, AddCommand):
        if bool(urls) == bool(command.managed):
            raise InvalidInput("engines add: name the engines to attach (URL...) or give --managed N, not both")
        body = {"managed": command.managed} if command.managed else {"urls": urls}
        answer = client.call("POST", "/engines/add", body, timeout_s=command.timeout)
        print(json.dumps(answer) if command.json else "\n".join(
            f"joined {j['url']} ({j['kind']}) at version {j['version']} after {j['catch_up_s']:.1f}s catching up"
            for j in answer["joined"]))
        return 0
    if not urls:
        raise InvalidInput("engines remove: name the engines to remove (URL...)")
    body = {"urls": urls, "force": command.force, "drain_timeout_s": command.drain_timeout}
    answer = client.call("POST", "/engines/remove", body, timeout_s=command.drain_timeout + 120)
    print(json.dumps(answer) if command.json else "\n".join(
        f"removed {r['url']} ({r['kind']}, {'stopped' if r['kind'] == 'managed' else 'left running'}): "
        f"{'drained' if r['drained'] else 'requests still in flight at the drain timeout'} in {r['drain_s']:.1f}s"
        for r in answer["removed"]))
    return 0


def _addresses(urls: list[str]) -> list[str]:
    flags = [u for u in urls if u.startswith("-")]
    if flags:
        raise InvalidInput(f"{' '.join(flags)}: flags go before the engine addresses")
    return urls


class ControlClient:
    """Calls the running job's control endpoint with the run's admin key."""

    def __init__(self, url: str, key: str | None, run_dir: Path, key_source: str = "no key"):
        """``key_source``: where ``key`` came from, for the message when the run refuses it."""
        self.url, self.key, self.run_dir, self.key_source = url.rstrip("/"), key, run_dir, key_source

    @classmethod
    def of_run(cls, run_dir: Path, admin_api_key: str | None = None) -> "ControlClient":
        """``InvalidInput`` (exit 2) when no job is running in ``run_dir``, saying which case it is:
        no such directory, a directory that is not a run directory, a run that has ended (or has no
        control endpoint yet)."""
        from miles_disagg.fleet.control_server import CONTROL_FILENAME

        control = run_dir / CONTROL_FILENAME
        try:
            url = json.loads(control.read_text())["url"]
        except FileNotFoundError:
            raise InvalidInput(f"no running job in {run_dir}: {_why_no_control_file(run_dir)}") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not run_dir.is_dir():
                raise InvalidInput(f"no running job in {run_dir}: {_why_no_control_file(run_dir)}") from None
            raise InvalidInput(f"no running job in {run_dir}: cannot read {control} ({exc})") from None
        key, source = admin_key(run_dir, admin_api_key)
        return cls(url, key, run_dir, source)

    def call(self, method: str, path: str, body: dict | None = None, *, timeout_s: float) -> Any:
        import httpx

        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        try:
            response = httpx.request(method, f"{self.url}{path}", json=body, headers=headers, timeout=timeout_s,
                                     trust_env=False)
        except httpx.ConnectError:
            ended = "the run has finished (it wrote summary.json)" if (self.run_dir / SUMMARY_FILENAME).exists() \
                else "the run has ended without removing it"
            raise InvalidInput(f"no running job in {self.run_dir}: its control endpoint {self.url} (from "
                               f"control.json) does not answer: {ended}") from None
        except httpx.HTTPError as exc:
            raise MilesDisaggError(f"{method} {self.url}{path}: {type(exc).__name__}: {exc}") from None
        if response.is_success:
            return response.json()
        message = _message(response)
        if response.status_code == 401:
            if self.key is None:
                raise InvalidInput(f"the run needs its admin key and none was found ({self.key_source}): {message}")
            raise InvalidInput(f"the run refused the key from {self.key_source}: {message}")
        raise InvalidInput(message)


RUN_CONFIG_FILENAME = "config.json"  # what every run writes into its run directory first (loop/preflight.py)
SUMMARY_FILENAME = "summary.json"  # what a run writes when it ends (loop/report.py)


def _why_no_control_file(run_dir: Path) -> str:
    """Why a directory has no control endpoint to call: one of the cases ``of_run`` names."""
    if not run_dir.exists():
        return "no such directory"
    if not run_dir.is_dir():
        return "not a directory"
    if not (run_dir / RUN_CONFIG_FILENAME).is_file():
        return (f"not a run directory (no {RUN_CONFIG_FILENAME}): give the --run-dir the run was started with")
    if (run_dir / SUMMARY_FILENAME).is_file():
        return f"the run there has finished (it wrote {SUMMARY_FILENAME}); engines join and leave a running job only"
    return ("the run there has no control endpoint (no control.json): it has ended, has not started its engines "
            "yet, or has none of its own (a rollout service's run, --debug-train-only)")


def admin_key(run_dir: Path, given: str | None) -> tuple[str | None, str]:
    """``(key, where it came from)``: ``--admin-api-key``, else ``$MILES_DISAGG_ADMIN_API_KEY``, else
    ``RUN_DIR/control.key``; ``(None, what was looked at)`` when none holds one."""
    import os

    from miles_disagg.fleet.control_server import KEY_FILENAME
    from miles_disagg.net.auth import ADMIN_API_KEY_ENV

    key_file = run_dir / KEY_FILENAME
    if given:
        hint = f"; {key_file} holds the run's own" if _read_key(key_file) not in (None, given) else ""
        return given, f"--admin-api-key{hint}"
    if os.environ.get(ADMIN_API_KEY_ENV):
        hint = f"; unset it to use {key_file}" if _read_key(key_file) not in (None, os.environ[ADMIN_API_KEY_ENV]) else ""
        return os.environ[ADMIN_API_KEY_ENV], f"${ADMIN_API_KEY_ENV}{hint}"
    key = _read_key(key_file)
    if key is not None:
        return key, str(key_file)
    return None, f"no --admin-api-key, ${ADMIN_API_KEY_ENV} unset, no readable {key_file}"


def _read_key(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _message(response) -> str:
    from miles_disagg.net.keyed_client import payload_message, response_payload

    return payload_message(response_payload(response))


def engines_table(answer: dict) -> str:
    """One line per engine: url, kind, version, state, node."""
    rows = [("ENGINE", "URL", "KIND", "VERSION", "STATE", "NODE")]
    for e in answer["engines"]:
        rows.append((str(e["engine"]), e["url"], e["kind"], str(e["version"]), e["state"], str(e["node"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines + [f"run version {answer['version']}"])

