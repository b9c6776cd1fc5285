"""keep_ray_token_auth: the caller's mode wins; token mode is set only where a token exists (Ray
refuses to start in token mode without one, and makes one itself when the mode is unset) and Ray
is not imported yet (it reads the mode at import: set later, the process would send no token)."""

from __future__ import annotations

from miles_disagg.net.netbind import keep_ray_token_auth


def _clean(monkeypatch, home) -> None:
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))


def test_a_chosen_mode_is_left_alone(monkeypatch, tmp_path):
    import os

    _clean(monkeypatch, tmp_path)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    keep_ray_token_auth(ray_imported=False)
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in os.environ


def test_no_token_anywhere_leaves_the_mode_to_ray(monkeypatch, tmp_path):
    import os

    _clean(monkeypatch, tmp_path)
    keep_ray_token_auth(ray_imported=False)
    assert "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ


def test_an_existing_token_file_is_used(monkeypatch, tmp_path):
    import os

    _clean(monkeypatch, tmp_path)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 40)
    keep_ray_token_auth(ray_imported=False)
    assert os.environ["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in os.environ


def test_a_token_in_the_environment_turns_the_mode_on(monkeypatch, tmp_path):
    import os

    _clean(monkeypatch, tmp_path)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 40)
    keep_ray_token_auth(ray_imported=False)
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_after_ray_is_imported_the_mode_is_left_to_ray(monkeypatch, tmp_path):
    import os

    _clean(monkeypatch, tmp_path)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 40)
    keep_ray_token_auth(ray_imported=True)
    assert "RAY_AUTH_MODE" not in os.environ  # Ray >= 2.60 turns token auth on by itself, refreshing its config
