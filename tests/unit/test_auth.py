"""Keys and their levels (SGLang's semantics), what proxies forward, run keys, redaction, binding."""

from __future__ import annotations

import pytest

from miles_disagg.net.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ApiKeys, AuthLevel, forward_headers, level_of
from miles_disagg.net.netbind import LOOPBACK, NODE_IP, bind_host, run_keys
from miles_disagg.types import VersionConstraint

BOTH = ApiKeys("user", "admin")


def bearer(key: str | None) -> str | None:
    return None if key is None else f"Bearer {key}"


@pytest.mark.parametrize("keys, path, token, expected", [
    # no keys: an open server, as SGLang without keys
    (ApiKeys(), "/update_weights_from_disk", None, AuthLevel.ADMIN),
    (ApiKeys(), "/generate", None, AuthLevel.NORMAL),
    # both keys: admin endpoints take only the admin key, others the API key (or the admin key)
    (BOTH, "/update_weights_from_disk", "admin", AuthLevel.ADMIN),
    (BOTH, "/update_weights_from_disk", "user", None),
    (BOTH, "/update_weights_from_disk", None, None),
    (BOTH, "/generate", "user", AuthLevel.NORMAL),
    (BOTH, "/generate", "admin", AuthLevel.ADMIN),
    (BOTH, "/generate", "wrong", None),
    (BOTH, "/health", None, AuthLevel.OPEN),
    (BOTH, "/health_generate", "wrong", AuthLevel.OPEN),
    # only an admin key: ordinary endpoints stay open (SGLang), admin ones need it
    (ApiKeys(None, "admin"), "/generate", None, AuthLevel.NORMAL),
    (ApiKeys(None, "admin"), "/heartbeat", None, None),
    (ApiKeys(None, "admin"), "/heartbeat", "admin", AuthLevel.ADMIN),
    # only an API key: it opens the admin endpoints too
    (ApiKeys("user", None), "/add_worker", "user", AuthLevel.ADMIN),
    (ApiKeys("user", None), "/add_worker", None, None),
])
def test_caller_levels(keys, path, token, expected):
    assert keys.caller_level(level_of(path), bearer(token)) == expected


def test_bearer_scheme_is_case_insensitive_and_other_schemes_are_refused():
    assert BOTH.caller_level(AuthLevel.ADMIN, "bearer admin") is AuthLevel.ADMIN
    assert BOTH.caller_level(AuthLevel.ADMIN, "Basic admin") is None
    assert BOTH.caller_level(AuthLevel.ADMIN, "Bearer") is None


def test_clients_send_the_key_each_path_needs():
    assert BOTH.headers_for("/pull_weights") == {"Authorization": "Bearer admin"}
    assert BOTH.headers_for("/generate") == {"Authorization": "Bearer user"}
    assert ApiKeys(None, "admin").headers_for("/get_weight_version") == {"Authorization": "Bearer admin"}
    assert ApiKeys("user", None).headers_for("/pull_weights") == {"Authorization": "Bearer user"}
    assert BOTH.headers_for("/health") == {}


def test_a_proxy_forwards_no_more_than_its_caller_proved():
    assert forward_headers(BOTH, AuthLevel.NORMAL, "/update_weights_from_tensor") == {"Authorization": "Bearer user"}
    assert forward_headers(ApiKeys(None, "admin"), AuthLevel.NORMAL, "/update_weights_from_tensor") == {}
    assert forward_headers(BOTH, AuthLevel.ADMIN, "/pause_generation") == {"Authorization": "Bearer admin"}
    assert forward_headers(BOTH, AuthLevel.ADMIN, "/generate") == {"Authorization": "Bearer user"}
    assert forward_headers(BOTH, None, "/pause_generation") == {}


def test_keys_come_from_flags_then_environment():
    env = {API_KEY_ENV: "env-user", ADMIN_API_KEY_ENV: ""}
    assert ApiKeys.resolve(None, None, env) == ApiKeys("env-user", None)
    assert ApiKeys.resolve("flag", "flag-admin", env) == ApiKeys("flag", "flag-admin")
    with pytest.raises(ValueError, match="--admin-api-key"):
        ApiKeys(None, "has space")


def test_a_run_generates_its_admin_key_unless_given(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_API_KEY_ENV, raising=False)
    first, second = run_keys(None, None), run_keys(None, None)
    assert first.api_key is None and len(first.admin_api_key) >= 32 and first.admin_api_key != second.admin_api_key
    assert run_keys("u", "a") == ApiKeys("u", "a")
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "from-env")
    assert run_keys(None, None).admin_api_key == "from-env"


def test_keys_never_reach_config_json_or_print_config():
    from miles_disagg.config import config_to_dict, config_to_yaml, load_config

    config, _ = load_config(["--rollout-api-key", "secret-user", "--rollout-admin-api-key", "secret-admin"],
                            "train_async")
    assert config.rollout.rollout_api_key == "secret-user"
    assert config_to_dict(config)["rollout"]["rollout_admin_api_key"] == "<redacted>"
    assert "secret" not in config_to_yaml(config)


def test_binding_is_one_decision():
    assert bind_host(spans_nodes=False) == LOOPBACK
    assert bind_host(spans_nodes=True) == NODE_IP


def test_a_run_bound_constraint_admits_only_that_runs_versions():
    wanted = VersionConstraint(min_version=3, run_id="new")
    assert wanted.allows(3, "new") and wanted.allows(4, "new")
    assert not wanted.allows(3, "old") and not wanted.allows(3, None)
    assert VersionConstraint(run_id="new").allows(0, None)  # the base is every run's start
    assert VersionConstraint.from_json({"exact_version": 2, "run_id": "r"}).describe() == "exact_version=2 of run 'r'"
