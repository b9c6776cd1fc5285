"""The rollout manager: keeps the engines busy and hands scored groups to the trainer.

Run as a Ray actor (asyncio). ``start()`` launches a producer that keeps up to
``--rollout-concurrency`` requests in flight through the router, groups
``--n-samples-per-prompt`` samples per prompt, scores them and puts each finished group
into the staleness-aware buffer. Each request asks for ``min_version = current - K``
(``--max-weight-staleness``); ``take`` applies the same bound when the trainer consumes.
The producer stops admitting new groups while ``capacity_groups`` are buffered or in
flight, so a slow trainer does not make the engines generate work that will be dropped.
Sync mode (``train.py``) uses ``generate(n)`` instead: exactly n groups, then idle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from miles_disagg.config.actors import RolloutManagerConfig
from miles_disagg.rollout.buffer import BufferClosed, BufferTimeout, GroupBuffer
from miles_disagg.rollout.generate import (
    GenerationFailed, RequestLost, SamplingSettings, generate_one, request_body, sample_from_response,
)
from miles_disagg.types import Group, RolloutBatch

log = logging.getLogger(__name__)


class RolloutManager:
    def __init__(self, config: RolloutManagerConfig, capacity_groups: int | None = None, data_position: int = 0):
        """``data_position``: prompts already consumed by the run (a resumed run skips them)."""
        from transformers import AutoTokenizer

        from miles_disagg.rollout.prompts import make_prompt_source, make_reward

        hf_dir, seed = config.hf_dir, config.seed
        self.config, self.router_url = config.rollout, config.router_url.rstrip("/")
        self.run_id = config.run_id
        config = config.rollout
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.prompts = make_prompt_source(config, self.tokenizer, seed)
        self.drawn = data_position
        if data_position:
            n = len(self.prompts)
            self.prompts.load_state_dict({**self.prompts.state_dict(), "epoch": data_position // n,
                                          "offset": data_position % n})
        self.reward = make_reward(config)
        self.sampling = SamplingSettings(config.rollout_max_response_len, config.rollout_temperature,
                                         config.rollout_top_p, config.rollout_top_k)
        self.buffer = GroupBuffer(config.max_weight_staleness)
        self.capacity = capacity_groups or 2 * (config.rollout_batch_size or 1)
        self.current_version = 0
        self.counters: dict[str, int] = {"requests": 0, "retried": 0, "version_not_ready": 0, "groups": 0}
        self._client = None
        self._producer: asyncio.Task | None = None
        self._pending = 0
        self._slots: asyncio.Semaphore | None = None
        self._room: asyncio.Condition | None = None
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    async def _ensure_client(self) -> None:
        import httpx

        if self._client is None:
            limits = httpx.Limits(max_connections=self.config.rollout_concurrency + 8)
            from miles_disagg.auth import ApiKeys

            self._client = httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), limits=limits,
                                             headers=ApiKeys.from_env().headers_for("/generate"))  # the run's keys
            # one request carries a whole group: the concurrency bound counts samples
            self._slots = asyncio.Semaphore(max(1, self.config.rollout_concurrency // self.config.n_samples_per_prompt))
            self._room = asyncio.Condition()

    async def start(self) -> None:
        """Begin continuous generation (train_async.py)."""
        await self._ensure_client()
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce_forever())

    async def set_version(self, version: int) -> None:
        """The trainer's newest version: new requests ask for at least ``version - K``."""
        self.current_version = version

    async def take(self, n_groups: int, current_version: int, timeout_s: float = 900.0) -> RolloutBatch:
        """The next ``n_groups`` admissible groups (oldest first) and their staleness metrics."""
        self._raise_failure()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = await asyncio.to_thread(self.buffer.take, n_groups, current_version, 1.0)
                break
            except BufferTimeout:  # nothing yet: check the producer, then keep waiting
                self._raise_failure()
                if time.monotonic() > deadline:
                    raise
        async with self._room:
            self._pending -= len(result.groups) + result.num_dropped  # dropped groups left the buffer too
            self._room.notify_all()
        return self._batch(result)

    async def generate(self, n_groups: int, current_version: int) -> RolloutBatch:
        """Sync mode: generate exactly ``n_groups`` groups now and return them."""
        await self._ensure_client()
        self.current_version = current_version
        prompts = self._draw(n_groups)
        groups = await asyncio.gather(*(self._group(p) for p in prompts))
        for g in groups:
            self.buffer.put(g)
        result = await asyncio.to_thread(self.buffer.take, n_groups, current_version, 60.0)
        return self._batch(result)

    def _batch(self, result) -> RolloutBatch:
        return RolloutBatch(result.groups, {**result.metrics(), **self._group_metrics(result.groups),
                                            **self._counter_metrics()})

    async def stop(self) -> None:
        if self._producer is not None:
            self._producer.cancel()
        self.buffer.close()
        if self._client is not None:
            await self._client.aclose()

    def _draw(self, n: int):
        self.drawn += n
        return self.prompts.next_batch(n)

    def data_position(self) -> int:
        """Prompts whose groups the trainer has or will have consumed: drawn minus those still
        buffered or in flight (a resumed run generates those again)."""
        return self.drawn - self._pending

    async def evaluate(self, prompts: list, exact_version: int, sampling: SamplingSettings,
                       n_samples: int) -> dict[str, float]:
        """Mean reward of ``n_samples`` per prompt, each served by exactly ``exact_version``."""
        await self._ensure_client()

        async def one(prompt) -> list[float]:
            prompt_ids = self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
            body = request_body(prompt_ids, sampling, None, exact_version=exact_version, num_samples=n_samples,
                                run_id=self.run_id)
            async with self._slots:
                payload = await generate_one(self._client, self.router_url, body, self.counters)
            items = payload if isinstance(payload, list) else [payload]
            samples = [self._score(prompt, prompt_ids, item, None) for item in items]
            if any(s.weight_version_start != exact_version or s.weight_version_end != exact_version for s in samples):
                raise GenerationFailed(f"an eval sample was not served by exactly version {exact_version}")
            return [s.reward for s in samples]

        rewards = [r for rs in await asyncio.gather(*(one(p) for p in prompts)) for r in rs]
        return {"reward": sum(rewards) / len(rewards), "samples": float(len(rewards)), "version": float(exact_version)}

    def _counter_metrics(self) -> dict[str, float]:
        """Cumulative request counters (retries of refused requests, groups given up)."""
        return {"rollout/requests_retried": float(self.counters.get("retried", 0)),
                "rollout/version_not_ready": float(self.counters.get("version_not_ready", 0)),
                "rollout/lost_groups": float(self.counters.get("lost_groups", 0))}

    # ------------------------------------------------------------------ producer

    async def _produce_forever(self) -> None:
        try:
            while True:
                async with self._room:
                    await self._room.wait_for(lambda: self._pending < self.capacity)
                    self._pending += 1
                prompt = self._draw(1)[0]
                asyncio.create_task(self._group_into_buffer(prompt))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to the trainer by take()
            self._failure = exc
            raise

    async def _group_into_buffer(self, prompt) -> None:
        try:
            self.buffer.put(await self._group(prompt))
        except asyncio.CancelledError:
            raise
        except RequestLost:
            self.counters["lost_groups"] = self.counters.get("lost_groups", 0) + 1
            async with self._room:  # the group will never arrive: free its slot
                self._pending -= 1
                self._room.notify_all()
        except BaseException as exc:
            if not isinstance(exc, BufferClosed):
                log.exception("rollout group failed")
                self._failure = exc

    async def _group(self, prompt) -> Group:
        """All samples of one prompt in one batched request (one engine serves the group)."""
        n = self.config.n_samples_per_prompt
        prompt_ids = self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        # sglang-router cannot route by version: no admission constraint there (the buffer still drops stale groups)
        min_version = None if self.config.router == "sglang" else self.buffer.admission_min_version(self.current_version)
        exact = self.current_version if self.config.rollout_exact_version else None
        body = request_body(prompt_ids, self.sampling, min_version, exact_version=exact, num_samples=n,
                            run_id=self.run_id)
        async with self._slots:
            self.counters["requests"] += 1
            # a service request that failed after dispatch is not replayed (it carries no idempotency key)
            payload = await generate_one(self._client, self.router_url, body, self.counters,
                                         replay_after_dispatch=not self.config.rollout_service_url)
        items = payload if isinstance(payload, list) else [payload]
        if len(items) != n:
            raise GenerationFailed(f"asked for {n} samples of one prompt, got {len(items)}")
        samples = [self._score(prompt, prompt_ids, item, min_version) for item in items]
        self.counters["groups"] += 1
        return Group(prompt_index=prompt.index, samples=samples)

    def _score(self, prompt, prompt_ids: list[int], item: dict, min_version: int | None):
        sample = sample_from_response(prompt_ids, item)
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        sample.reward = float(self.reward(prompt.text, text, prompt.label, dict(prompt.metadata)))
        sample.metadata.update({"prompt_index": prompt.index, "response_text": text,
                                "requested_min_version": min_version,
                                "routed_worker": item["meta_info"].get("routed_worker")})
        return sample

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    @staticmethod
    def _group_metrics(groups: list[Group]) -> dict[str, float]:
        samples = [s for g in groups for s in g.samples]
        if not samples:
            return {}
        lengths = [len(s.response_ids) for s in samples]
        return {"rollout/raw_reward": sum(s.reward for s in samples) / len(samples),
                "rollout/response_len_mean": sum(lengths) / len(lengths),
                "rollout/truncated_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
                "rollout/served_version_mean": _mean(s.weight_version_end for s in samples)}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def save_groups(path: str | Path, groups: list[Group], consumed_at_version: int) -> None:
    """``--save-debug-rollout-data``: one JSON line per group, with the trainer version that consumed it."""
    from miles_disagg.types import asdict

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for g in groups:
            f.write(json.dumps({**asdict(g), "consumed_at_version": consumed_at_version}) + "\n")


def load_groups(path: str | Path) -> list[Group]:
    """``--load-debug-rollout-data``: what ``save_groups`` wrote."""
    from miles_disagg.types import Sample

    groups = []
    for line in Path(path).read_text().splitlines():
        raw = json.loads(line)
        groups.append(Group(prompt_index=raw["prompt_index"], samples=[Sample(**s) for s in raw["samples"]]))
    return groups
