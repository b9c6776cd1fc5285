"""The pure parts of ``miles-disagg engines``: the control endpoint's request bodies, the CLI's
address list and table, and finding the running job from its run directory."""

from __future__ import annotations

import json

import pytest

from miles_disagg.fleet.control_server import AddRequest, RemoveRequest
from miles_disagg.fleet.members import normalize
from miles_disagg.fleet.members_cli import ControlClient, _addresses, engines_table
from miles_disagg.net.httpjson import parse_body
from miles_disagg.types import InvalidInput


@pytest.mark.parametrize("body, expected", [
    ({}, "either urls"),
    ({"urls": ["127.0.0.1:1"], "managed": 1}, "either urls"),
    ({"urls": "127.0.0.1:1"}, "urls"),
    ({"urls": ["127.0.0.1:1\x00"]}, "not an engine address"),
    ({"urls": [" "]}, "not an engine address"),
    ({"managed": "2"}, "managed"),
    ({"managed": -1}, "managed"),
    ({"urls": ["h:1"] * 1025}, "at most 1024"),
])
def test_bad_add_bodies_are_refused_naming_the_field(body: dict, expected: str) -> None:
    with pytest.raises(InvalidInput, match=expected):
        parse_body(AddRequest, json.dumps(body).encode())


@pytest.mark.parametrize("body, expected", [
    ({}, "name at least one engine"),
    ({"urls": ["h:1"], "force": "yes"}, "force"),
    ({"urls": ["h:1"], "drain_timeout_s": -1}, "drain_timeout_s"),
    ({"urls": ["h:1"], "drain_timeout_s": 1e9}, "drain_timeout_s"),
])
def test_bad_remove_bodies_are_refused_naming_the_field(body: dict, expected: str) -> None:
    with pytest.raises(InvalidInput, match=expected):
        parse_body(RemoveRequest, json.dumps(body).encode())


def test_good_bodies_parse() -> None:
    assert parse_body(AddRequest, b'{"managed": 2}').managed == 2
    remove = parse_body(RemoveRequest, b'{"urls": ["h:1"], "drain_timeout_s": 5}')
    assert (remove.urls, remove.force, remove.drain_timeout_s) == (["h:1"], False, 5)


def test_addresses_are_normalized_and_flags_after_them_refused() -> None:
    assert normalize("127.0.0.1:30001") == normalize("http://127.0.0.1:30001/") == "http://127.0.0.1:30001"
    assert _addresses(["h:1", "h:2"]) == ["h:1", "h:2"]
    with pytest.raises(InvalidInput, match="--force: flags go before the engine addresses"):
        _addresses(["h:1", "--force"])


def test_the_table_has_one_line_per_engine() -> None:
    table = engines_table({"version": 3, "engines": [
        {"engine": 0, "url": "http://a:1", "kind": "managed", "version": "3", "state": "ready", "node": "10.0.0.1"},
        {"engine": 2, "url": "http://b:2", "kind": "attached", "version": None, "state": "down", "node": "b"}]})
    lines = table.splitlines()
    assert lines[0].split() == ["ENGINE", "URL", "KIND", "VERSION", "STATE", "NODE"]
    assert lines[1].split() == ["0", "http://a:1", "managed", "3", "ready", "10.0.0.1"]
    assert lines[2].split() == ["2", "http://b:2", "attached", "None", "down", "b"]
    assert lines[-1] == "run version 3"


def test_a_directory_without_a_running_job_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MILES_DISAGG_ADMIN_API_KEY", raising=False)
    with pytest.raises(InvalidInput, match="no running job in .*not a run directory"):
        ControlClient.of_run(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidInput, match="no running job in .*no control.json"):
        ControlClient.of_run(tmp_path)
    (tmp_path / "control.json").write_text("{not json")
    with pytest.raises(InvalidInput, match="no running job in .*cannot read"):
        ControlClient.of_run(tmp_path)
    (tmp_path / "control.json").write_text(json.dumps({"url": "http://127.0.0.1:5"}))
    (tmp_path / "control.key").write_text("the-runs-key\n")
    client = ControlClient.of_run(tmp_path)
    assert (client.url, client.key) == ("http://127.0.0.1:5", "the-runs-key")
    assert ControlClient.of_run(tmp_path, "given").key == "given"


@pytest.mark.parametrize("url, expected", [
    ("http://user:secret@127.0.0.1:5", "carries no user or password"),
    ("user@127.0.0.1:5", "carries no user or password"),
    ("ftp://127.0.0.1:5", "http://host:port"),
    ("127.0.0.1", "give host:port"),
    ("127.0.0.1:99999", "not an engine address"),
    ("127.0.0.1:5/generate", "no path or query"),
    ("127.0.0.1:5?x=1", "no path or query"),
    ("a" * 5000 + ":8000", "engine address too long: 5012 characters, at most 300"),
    ("a" * 254 + ":8000", "engine address too long: its host name has 254 characters, at most 253"),
    ("127.0.0.1:5/" + "x" * 400, "engine address too long"),
])
def test_an_address_that_is_not_host_port_is_refused_before_anything_is_sent(url: str, expected: str) -> None:
    with pytest.raises(InvalidInput, match=expected) as refused:
        normalize(url)
    assert "secret" not in str(refused.value)  # a password is never echoed back
