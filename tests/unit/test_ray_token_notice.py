"""Ray's notice that token authentication is on by default is not printed on every run; its warning
that authentication is off still is."""

from __future__ import annotations

import logging

from miles_disagg.net.netbind import RAY_TOKEN_LOGGER, keep_ray_token_auth, quiet_ray_token_notice


def test_only_the_on_by_default_notice_is_dropped(caplog, monkeypatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # keep_ray_token_auth changes nothing else then
    keep_ray_token_auth(ray_imported=True)
    quiet_ray_token_notice()  # idempotent
    logger = logging.getLogger(RAY_TOKEN_LOGGER)
    assert sum(type(f).__name__ == "_DropRayTokenNotice" for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=RAY_TOKEN_LOGGER):
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    assert [r.getMessage()[:40] for r in caplog.records] == ["Token authentication is disabled for thi"]
