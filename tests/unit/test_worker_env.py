"""Which Ray actors need a ``runtime_env``: none on a local Ray this project started, whose workers
inherit the starting process's environment (keys, one OpenMP thread); the given variables otherwise."""

from __future__ import annotations

import pytest

from miles_disagg.net.auth import ADMIN_API_KEY_ENV
from miles_disagg.net.netbind import (LOCAL_RAY_ENV, WORKER_ENV, inherit_into_local_ray, keys_runtime_env, on_local_ray,
                                  worker_runtime_env)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (LOCAL_RAY_ENV, *WORKER_ENV, ADMIN_API_KEY_ENV):
        monkeypatch.setenv(name, "")  # recorded, so the test's changes are undone
        monkeypatch.delenv(name)
    return monkeypatch


def test_on_a_cluster_the_actor_gets_the_variables(clean_env):
    clean_env.setenv("OMP_NUM_THREADS", "1")
    assert not on_local_ray()
    assert worker_runtime_env({"OMP_NUM_THREADS": "1"}) == {"env_vars": {"OMP_NUM_THREADS": "1"}}
    clean_env.setenv(ADMIN_API_KEY_ENV, "k")
    assert keys_runtime_env()["env_vars"][ADMIN_API_KEY_ENV] == "k"


def test_on_a_local_ray_the_actor_inherits_them(clean_env):
    clean_env.setenv(ADMIN_API_KEY_ENV, "k")
    inherit_into_local_ray()
    assert on_local_ray()
    assert worker_runtime_env({"OMP_NUM_THREADS": "1"}) is None
    assert keys_runtime_env() is None


def test_a_value_the_workers_did_not_inherit_still_travels(clean_env):
    inherit_into_local_ray()
    assert worker_runtime_env({"OMP_NUM_THREADS": "4"}) == {"env_vars": {"OMP_NUM_THREADS": "4"}}
    assert worker_runtime_env({}) is None and keys_runtime_env() is None  # no keys: nothing to hand over
