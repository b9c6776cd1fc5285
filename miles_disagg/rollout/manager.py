"""The rollout manager: keeps the engines busy and hands scored groups to the trainer.

Run as a Ray actor (asyncio). ``start()`` launches a producer that keeps generating groups
through the router (one group = ``--n-samples-per-prompt`` samples of a prompt), scores them,
passes each through the dynamic sampling filter and puts the kept ones into the
staleness-aware buffer. Each request asks for ``min_version = current - K``
(``--max-weight-staleness``); ``take`` applies the same bound when the trainer consumes.
Sync mode (``train.py``) uses ``generate(n)`` instead: exactly n kept groups, then idle.

The producer's window (``rollout/producer.py``): at most ``capacity`` groups are in flight or
buffered (``--rollout-batch-size + --over-sampling-batch-size`` by default); a group frees its slot
the moment it leaves for good, so the window refills even when every group in it turned stale at once.

Extension points (``rollout/hooks.py``): a custom generate function replaces how each sample
is generated, a rollout function replaces how a batch of groups is generated, an eval function
replaces evaluation, a buffer filter chooses which buffered groups a take returns, and a reward
post-process sets the samples' advantages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from miles_disagg.net.auth import ApiKeys
from miles_disagg.config.actors import RolloutManagerConfig
from miles_disagg.net.keyed_client import pooled_limits
from miles_disagg.net.pooled_http import PooledSession
from miles_disagg.rollout.attribution import AttributionProxy
from miles_disagg.rollout.batch_metrics import counter_metrics, filter_metrics, group_metrics
from miles_disagg.rollout.buffer import BufferTimeout, GroupBuffer
from miles_disagg.rollout.filters import apply_dynamic_filter, buffer_selector
from miles_disagg.rollout.generate import GenerationFailed, SamplingSettings
from miles_disagg.rollout.groups import GroupGenerator
from miles_disagg.rollout.hook_args import EngineCaller, EvalSamples, PromptSamples, RolloutArgs
from miles_disagg.rollout.sessions.agent import rollout_hooks_of
from miles_disagg.rollout.outputs import eval_metrics, groups_from_rollout_output, post_process_rewards
from miles_disagg.rollout.producer import ProducerWindow
from miles_disagg.rollout.routed_experts import RoutingShape
from miles_disagg.rollout.opd_topk import student_top_k
from miles_disagg.rollout.teacher import StudentScorer, Teacher, teacher_routes, topk_settings
from miles_disagg.samples import Group, RolloutBatch
from miles_disagg.types import ConfigError

log = logging.getLogger(__name__)


class RolloutManager:
    def __init__(self, config: RolloutManagerConfig, capacity_groups: int | None = None, data_position: int = 0,
                 *, http_transport=None):
        """``data_position``: prompts already consumed by the run (a resumed run skips them);
        ``http_transport``: an ``httpx`` transport to reach the router through (tests: a fake router)."""
        from miles_disagg.models.tokenizer import load_tokenizer
        from miles_disagg.rollout.prompts import make_prompt_source
        from miles_disagg.rollout.sample_rewards import load_sample_reward

        self.hf_dir, seed = config.hf_dir, config.seed
        self.config, self.router_url = config.rollout, config.router_url.rstrip("/")
        self.run_id = config.run_id
        self.teacher_url, self.teacher_run_keys = config.opd_teacher_url, config.opd_teacher_run_keys
        self.use_opd = config.use_opd or config.opd_teacher_url is not None
        self.opd_topk = topk_settings(config.rollout) if self.use_opd else None
        self._teacher: Teacher | None = None
        self.routing = RoutingShape(*config.routed_experts) if config.routed_experts else None  # MoE routed experts
        config = config.rollout
        self.tokenizer = load_tokenizer(self.hf_dir)
        self.setup_error: ConfigError | None = None
        try:
            self.prompts = make_prompt_source(config, self.tokenizer, seed)
        except ConfigError as exc:  # for ready(): Ray keeps the type of a method's error, not of __init__'s
            self.setup_error = exc
            return
        self.drawn = data_position
        if data_position:
            n = len(self.prompts)
            self.prompts.load_state_dict({**self.prompts.state_dict(), "epoch": data_position // n,
                                          "offset": data_position % n})
        self.reward = load_sample_reward(config)
        self.hooks = rollout_hooks_of(config)  # a session run's generate function is the endpoint's own
        self._agents = None  # --use-session-server: the session endpoint and its agent (rollout/sessions/agent.py)
        self.sampling = SamplingSettings(config.rollout_max_response_len, config.rollout_temperature,
                                         config.rollout_top_p, config.rollout_top_k, tuple(config.rollout_stop),
                                         tuple(config.rollout_stop_token_ids))
        self.batch_size = config.rollout_batch_size or 1
        self.over_sampling = config.over_sampling_batch_size or self.batch_size
        self.capacity = capacity_groups or self.batch_size + self.over_sampling
        self.current_version = 0
        self.counters: dict[str, int] = {"requests": 0, "retried": 0, "version_not_ready": 0, "groups": 0}
        self.window = ProducerWindow(self.capacity, self.counters)  # async mode's producer
        select = buffer_selector(self.hooks.buffer_filter, lambda: self.args) if self.hooks.buffer_filter else None
        self.buffer = GroupBuffer(config.max_weight_staleness, on_dropped=self.window.dropped, select=select)
        self.filtered: Counter[str] = Counter()  # dynamic filter drops since the last batch, by reason
        self.rollout_metrics: dict[str, float] = {}  # what a rollout function reported since the last batch
        self._rollout_calls = 0
        self._client = None
        self._transport = http_transport
        self._slots: asyncio.Semaphore | None = None
        self._proxy = None  # the generate hook's per-sample router addresses (rollout/attribution.py)

    # ------------------------------------------------------------------ lifecycle

    async def _ensure_client(self) -> None:
        if self._client is not None:
            return
        self.window.attach()
        self._client = self._router_client(ApiKeys.from_env().headers_for("/generate"))  # the run's keys
        # one slot per group in flight: the concurrency bound counts samples
        self._slots = asyncio.Semaphore(max(1, self.config.rollout_concurrency // self.config.n_samples_per_prompt))
        replay = not self.config.rollout_service_url  # a service request failed after dispatch is not replayed
        if self.hooks.custom_generate is not None:
            hook = f"--custom-generate-function-path {self.config.custom_generate_function_path}"
            self._proxy = AttributionProxy(self._client, self.router_url, self.counters, self._training_bound, hook,
                                           replay_after_dispatch=replay, run_id=self.run_id, routing=self.routing)
        self._teacher = self._make_teacher()
        custom_generate = await self._start_sessions() if self.config.use_session_server else self.hooks.custom_generate
        self.generator = GroupGenerator(client=self._client, router_url=self.router_url, counters=self.counters,
                                     tokenizer=self.tokenizer, reward=self.reward,
                                     custom_generate=custom_generate, replay_after_dispatch=replay,
                                     run_id=self.run_id, routing=self.routing, proxy=self._proxy,
                                     teacher=self._teacher, student_top_k=student_top_k(self.opd_topk))
        engine = EngineCaller(self._client, self.router_url, self.counters, self._training_bound, self.tokenizer,
                              self.sampling.max_new_tokens, replay_after_dispatch=replay, run_id=self.run_id,
                              routing=self.routing, student_top_k=student_top_k(self.opd_topk))
        self.args = RolloutArgs(
            rollout_batch_size=self.batch_size, n_samples_per_prompt=self.config.n_samples_per_prompt,
            over_sampling_batch_size=self.over_sampling, sampling=self.sampling,
            max_weight_staleness=self.config.max_weight_staleness, hf_checkpoint=self.hf_dir,
            router_url=self.router_url, tokenizer=self.tokenizer, engine=engine,
            run_group=lambda samples: self.generator.run_samples(samples, self.args),
            rollout_concurrency=self.config.rollout_concurrency, rm_type=self.config.rm_type,
            custom_rm_path=self.config.custom_rm_path, reward_key=self.config.reward_key,
            eval_reward_key=self.config.eval_reward_key, group_rm=self.config.group_rm)

    def _make_teacher(self) -> Teacher | None:
        """The ``--use-opd`` teacher's client: the run's keys only to a teacher the job started; with
        top-k OPD the student's side is scored through the run's router (its keys)."""
        if not self.use_opd:
            return None
        headers = ApiKeys.from_env().headers_for("/generate") if self.teacher_run_keys else {}
        student = None
        if self.opd_topk is not None and self.opd_topk.student_on_teacher:
            student = StudentScorer(self._client, self.router_url, self.counters, self._training_bound, self.run_id)
        return Teacher(self._router_client(headers), teacher_routes(self.config, self.teacher_url),
                       topk=self.opd_topk, student=student)

    async def _start_sessions(self):
        """The session endpoint on this actor's loop; its generate function (one agent session per sample)."""
        from miles_disagg.rollout.sessions.agent import AgentRollout

        self._agents = AgentRollout(self.config, self.hf_dir, self.tokenizer, self._client, self.router_url,
                                    self._training_bound, run_id=self.run_id)
        await self._agents.start()
        return self._agents.generate

    async def session_url(self) -> str | None:
        """The session endpoint's address (``--use-session-server``; None without), started if it was not."""
        await self._ensure_client()
        return self._agents.server.url if self._agents is not None else None

    def _router_client(self, headers: dict[str, str]):
        max_connections = self.config.rollout_concurrency + 8
        if self._transport is None:
            return PooledSession(max_connections=max_connections, connect_timeout_s=10.0, read_timeout_s=900.0,
                                 headers=headers)
        import httpx

        return httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), transport=self._transport,
                                 headers=headers, limits=pooled_limits(max_connections=max_connections))

    def _training_bound(self) -> tuple[int | None, int | None]:
        """The version constraint of a training request sent now."""
        if self.config.rollout_exact_version:
            return None, self.current_version
        # sglang-router cannot route by version: no admission constraint there (the buffer still drops stale groups)
        if self.config.router == "sglang":
            return None, None
        return self.buffer.admission_min_version(self.current_version), None

    async def start(self) -> None:
        """Begin continuous generation (train_async.py)."""
        await self._ensure_client()
        round_size = min(self.batch_size if self.hooks.rollout_function else 1, self.capacity)
        self.window.start(round_size, self._next_groups, self.buffer.put)

    async def set_version(self, version: int) -> None:
        """The trainer's newest version: new requests ask for at least ``version - K``, and groups
        already stale against it leave the buffer now (their slots go back to the producer)."""
        self.current_version = version
        self.buffer.drop_stale(version)

    async def discard_versions(self, first: int, last: int) -> int:
        """Versions ``first..last`` left the trainer's lineage (``GroupBuffer.discard_versions``);
        how many buffered groups were dropped (their slots go back to the producer)."""
        return self.buffer.discard_versions(first, last)

    async def take(self, n_groups: int, current_version: int, timeout_s: float = 900.0) -> RolloutBatch:
        """The next ``n_groups`` admissible groups (oldest first) and their staleness metrics."""
        self.window.raise_failure()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = await asyncio.to_thread(self.buffer.take, n_groups, current_version, 1.0)
                break
            except BufferTimeout:  # nothing yet: check the producer, then keep waiting
                self.window.raise_failure()
                if time.monotonic() > deadline:
                    raise
        self.window.release(len(result.groups))
        return self._batch(result)

    async def generate(self, n_groups: int, current_version: int) -> RolloutBatch:
        """Sync mode: generate exactly ``n_groups`` kept groups now and return them."""
        await self._ensure_client()
        self.current_version = current_version
        if self.hooks.rollout_function is not None:
            groups = await self._rollout_function_groups()
            if len(groups) != n_groups:
                raise GenerationFailed(f"--rollout-function-path returned {len(groups)} groups; "
                                       f"--rollout-batch-size is {n_groups}")
        else:
            groups = await self._generate_kept(n_groups)
        for group in groups:
            self.buffer.put(group)
        result = await asyncio.to_thread(self.buffer.take, n_groups, current_version, 60.0)
        return self._batch(result)

    async def stop(self) -> None:
        self.window.stop()
        self.buffer.close()
        if self._proxy is not None:
            await self._proxy.close()
        if self._agents is not None:
            await self._agents.close()
        if self._teacher is not None:
            await self._teacher.aclose()
        if self._client is not None:
            await self._client.aclose()

    def ready(self) -> None:
        """Return once set up; else raise what the prompt data failed with (``ConfigError``, naming
        the file and line: what preflight cannot see, such as a chat template failing on a record)."""
        if self.setup_error is not None:
            raise self.setup_error

    def data_position(self) -> int:
        """Prompts whose groups the trainer has or will have consumed: drawn minus those still
        buffered or in flight (a resumed run generates those again)."""
        return self.drawn - self.window.in_window

    # ------------------------------------------------------------------ evaluation

    async def evaluate(self, prompts: list, exact_version: int, sampling: SamplingSettings,
                       n_samples: int) -> dict[str, float]:
        """Mean reward of ``n_samples`` per prompt, each served by exactly ``exact_version``."""
        await self._ensure_client()
        args = self._eval_args(exact_version, sampling)
        groups = await asyncio.gather(*(self._make_group(p, n_samples, args, lambda: (None, exact_version))
                                        for p in prompts))
        samples = [s for g in groups for s in g.samples]
        _check_exact(samples, exact_version)
        rewards = [s.reward for s in samples]
        return {"reward": sum(rewards) / len(rewards), "samples": float(len(rewards)), "version": float(exact_version)}

    async def evaluate_with_function(self, rollout_id: int, exact_version: int, datasets: dict[str, list],
                                     sampling: SamplingSettings, n_samples: int) -> dict[str, float]:
        """``--eval-function-path``: the user's eval rollout over ``datasets`` (name -> prompts); every
        engine call asks for exactly ``exact_version``. Returns ``eval/<name>`` metrics."""
        await self._ensure_client()
        args = self._eval_args(exact_version, sampling)
        source = EvalSamples({name: [self.generator.pending_group(p, n_samples) for p in prompts]
                              for name, prompts in datasets.items()})
        output = await self.hooks.eval_function(args, rollout_id, source, evaluation=True)
        for info in (getattr(output, "data", output) or {}).values():
            _check_exact(list(info.get("samples") or []) if isinstance(info, dict) else [], exact_version)
        return eval_metrics(output, exact_version)

    def _eval_args(self, exact_version: int, sampling: SamplingSettings) -> RolloutArgs:
        eval_args = self.args.for_evaluation(exact_version, sampling,
                                             run_group=lambda samples: self.generator.run_samples(samples, eval_args))
        return eval_args

    # ------------------------------------------------------------------ groups

    async def _next_groups(self) -> list[Group]:
        """One round of the async producer: a rollout function's groups, or one group if it is kept."""
        if self.hooks.rollout_function is not None:
            return await self._rollout_function_groups()
        group = await self._make_group(self._draw(1)[0], self.config.n_samples_per_prompt, self.args,
                                       self._training_bound)
        return [group] if self._keep(group) else []

    async def _make_group(self, prompt, n: int, args: RolloutArgs, bound) -> Group:
        async with self._slots:
            return await self.generator.group(prompt, n, args, bound)

    def _keep(self, group: Group) -> bool:
        """The dynamic sampling filter's decision; a drop is counted by its reason."""
        decision = apply_dynamic_filter(self.hooks.dynamic_filter, self.args, group)
        if not decision.keep:
            self.filtered[decision.reason or "filtered"] += 1
        return decision.keep

    async def _generate_kept(self, n_groups: int) -> list[Group]:
        """Sync mode: draw ``--over-sampling-batch-size`` prompts at a time until ``n_groups`` groups
        passed the dynamic filter; groups still in flight then are cancelled, extra kept ones discarded."""
        kept: list[Group] = []
        pending: set[asyncio.Task] = set()
        try:
            while len(kept) < n_groups:
                while len(kept) + len(pending) < n_groups:
                    for prompt in self._draw(self.over_sampling if self.hooks.dynamic_filter else n_groups):
                        pending.add(asyncio.create_task(self._make_group(
                            prompt, self.config.n_samples_per_prompt, self.args, self._training_bound)))
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                kept.extend(g for g in (t.result() for t in done) if self._keep(g))
        finally:
            for task in pending:
                task.cancel()
        return kept[:n_groups]

    async def _rollout_function_groups(self) -> list[Group]:
        """One call of ``--rollout-function-path``: its groups, each sample checked and scored."""
        draw = _no_global_dataset if self.config.disable_rollout_global_dataset else self._draw
        source = PromptSamples(draw, self.generator.pending_group, self.config.n_samples_per_prompt)
        rollout_id, self._rollout_calls = self._rollout_calls, self._rollout_calls + 1
        output = await self.hooks.rollout_function(self.args, rollout_id, source, evaluation=False)
        groups, metrics = groups_from_rollout_output(output, lambda s: self.generator.finish(s, self.args))
        for group in groups:
            await self.generator.score(group.samples, self.args)
        self.rollout_metrics.update(metrics)
        return groups

    def _draw(self, n: int):
        self.drawn += n
        return self.prompts.next_batch(n)

    # ------------------------------------------------------------------ batches and metrics

    def _batch(self, result) -> RolloutBatch:
        advantages_given = False
        if self.hooks.reward_post_process is not None:
            post_process_rewards(self.hooks.reward_post_process, self.args, result.groups)
            advantages_given = True
        filtered = filter_metrics(self.filtered) if self.hooks.dynamic_filter is not None else {}
        self.filtered.clear()
        sessions = self._agents.counters if self._agents is not None else None
        metrics = {**result.metrics(), **group_metrics(result.groups), **counter_metrics(self.counters, sessions),
                   **filtered, **self.rollout_metrics}
        self.rollout_metrics = {}
        return RolloutBatch(result.groups, metrics, advantages_given=advantages_given)


def _no_global_dataset(n: int):
    """``data_source.get_samples`` under ``--disable-rollout-global-dataset``: there is no global dataset."""
    from miles_disagg.types import ConfigError

    raise ConfigError(f"the rollout function asked data_source.get_samples({n}) for prompts, but "
                      "--disable-rollout-global-dataset says it manages its own data: drop the flag, or load the "
                      "prompts in the rollout function", ("--disable-rollout-global-dataset",))


def _check_exact(samples: list, exact_version: int) -> None:
    for s in samples:
        if any(call != [exact_version, exact_version] for call in s.call_versions or [[s.weight_version_start,
                                                                                       s.weight_version_end]]):
            raise GenerationFailed(f"an eval sample was not served by exactly version {exact_version}")
