"""miles' post-write hooks get the engines that are members when a version is published (issue 38
item 7): the update step reads the engine manager's members first and tells the trainer when they
changed (joins, removals, re-placements), never otherwise."""

from __future__ import annotations

from types import SimpleNamespace

from miles_disagg.loop.updates import publish


class Engines:
    def __init__(self, urls: list[str]):
        self.engine_urls, self.members = list(urls), list(urls)

    def refresh_engine_urls(self) -> bool:  # EngineManagerHandle's contract
        changed, self.engine_urls = self.members != self.engine_urls, list(self.members)
        return changed


class Trainer:
    def __init__(self):
        self.calls: list[tuple] = []
        self.version = 0

    def set_rollout_engines(self, urls):
        self.calls.append(("set_rollout_engines", list(urls)))

    def publish(self):
        self.version += 1
        self.calls.append(("publish", self.version))
        return SimpleNamespace(ref=SimpleNamespace(version=self.version), metrics=lambda: {})


def test_the_hooks_engine_list_follows_the_members_at_each_publish() -> None:
    engines, trainer = Engines(["http://a:1"]), Trainer()
    job = SimpleNamespace(engines=engines, trainer=trainer)
    publish(job, 0)
    engines.members = ["http://a:1", "http://b:1"]  # engines add
    publish(job, 1)
    engines.members = ["http://c:2", "http://b:1"]  # a re-placed engine's new address, then a removal
    engines.members = ["http://c:2"]
    publish(job, 2)
    assert trainer.calls == [("publish", 1), ("set_rollout_engines", ["http://a:1", "http://b:1"]), ("publish", 2),
                             ("set_rollout_engines", ["http://c:2"]), ("publish", 3)]
