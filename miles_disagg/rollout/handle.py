"""The rollout manager as a run sees it: one asyncio Ray actor behind typed methods.

Nothing outside this module calls ``.remote`` on the
:class:`~miles_disagg.rollout.manager.RolloutManager` actor.
"""

from __future__ import annotations

from miles_disagg.config.actors import RolloutManagerConfig
from miles_disagg.remote import Pending
from miles_disagg.samples import RolloutBatch


class RolloutManagerHandle:
    def __init__(self, config: RolloutManagerConfig, *, data_position: int = 0, scheduling_strategy=None):
        """``data_position``: prompts a resumed run has already consumed; ``scheduling_strategy``:
        where the actor goes (a run puts it on the driver's node, beside the router). Returns once
        the actor has read its prompts; ``ConfigError`` naming the file and line where they are bad."""
        import ray

        from miles_disagg.rollout.manager import RolloutManager

        from miles_disagg.net.netbind import keys_runtime_env

        self._actor = (ray.remote(RolloutManager)
                       .options(num_cpus=0, scheduling_strategy=scheduling_strategy, runtime_env=keys_runtime_env())
                       .remote(config, data_position=data_position))
        try:  # bad prompt data ends the run here with its ConfigError (exit 2), not as a dead actor later
            Pending([self._actor.ready.remote()]).result()
        except BaseException:
            ray.kill(self._actor)
            raise

    def session_url(self) -> str | None:
        """``--use-session-server``: the session endpoint's address (started now if it was not); else None."""
        return Pending([self._actor.session_url.remote()]).result()

    def start(self) -> None:
        """Begin continuous generation (train_async.py)."""
        Pending([self._actor.start.remote()]).result()

    def set_version(self, version: int) -> None:
        """The trainer's newest version: new requests ask for at least ``version - K``."""
        Pending([self._actor.set_version.remote(version)]).result()

    def discard_versions(self, first: int, last: int) -> int:
        """Drop groups that ran on versions ``first..last`` (a restarted trainer's lost lineage)."""
        return Pending([self._actor.discard_versions.remote(first, last)]).result()

    def take(self, n_groups: int, current_version: int) -> RolloutBatch:
        """The next ``n_groups`` admissible groups (async mode)."""
        return Pending([self._actor.take.remote(n_groups, current_version)]).result()

    def generate(self, n_groups: int, current_version: int) -> RolloutBatch:
        """Exactly ``n_groups`` groups generated now (sync mode)."""
        return Pending([self._actor.generate.remote(n_groups, current_version)]).result()

    def evaluate(self, prompts: list, exact_version: int, sampling, n_samples: int) -> dict[str, float]:
        """Mean reward of ``n_samples`` per prompt, each served by exactly ``exact_version``."""
        return Pending([self._actor.evaluate.remote(prompts, exact_version, sampling, n_samples)]).result()

    def evaluate_with_function(self, rollout_id: int, exact_version: int, datasets: dict[str, list], sampling,
                               n_samples: int) -> dict[str, float]:
        """``--eval-function-path``: ``eval/<name>`` metrics of the user's eval rollout at exactly ``exact_version``."""
        return Pending([self._actor.evaluate_with_function.remote(rollout_id, exact_version, datasets, sampling,
                                                                  n_samples)]).result()

    def data_position(self) -> int:
        return Pending([self._actor.data_position.remote()]).result()

    def stop(self, timeout_s: float = 30.0) -> None:
        Pending([self._actor.stop.remote()]).result(timeout_s)
