"""One group (the ``n_samples_per_prompt`` samples of a prompt): generate, check and score it.

Two ways to generate, chosen by ``--custom-generate-function-path``:

* default: one batched ``/generate`` through the router carries the whole group (one engine
  serves it), single turn;
* custom: the user's ``async generate(args, sample, sampling_params)`` runs once per sample, all
  samples of the group concurrently; it may call the engines several times through
  ``args.engine`` or by POSTing to its own ``args.sglang_router_ip/port`` (miles' way; each call is
  recorded against the sample by ``rollout/attribution.py``), and insert environment tokens with
  ``loss_mask`` 0.

Either way each sample leaves here with its served versions (start of its first engine call, end
of its last), consistent per-token fields, a status and a reward (the generate function's if it
set one, else ``--custom-rm-path`` / ``--rm-type`` / the task's: ``rollout/sample_rewards.py``), and
with ``--use-opd`` its teacher logprobs (``rollout/teacher.py``; not during evaluation).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from miles_disagg.rollout.attribution import AttributionProxy
from miles_disagg.rollout.generate import GenerationFailed, generate_one, request_body, sample_from_response
from miles_disagg.rollout.hook_args import RolloutArgs, keep_top
from miles_disagg.rollout.routed_experts import RoutingShape, append_call_routing, check_covers_tokens, request_fields
from miles_disagg.rollout.sample_rewards import SampleReward
from miles_disagg.rollout.teacher import Teacher
from miles_disagg.samples import Group, Sample, SampleStatus
from miles_disagg.types import InvalidInput

VersionBound = Callable[[], "tuple[int | None, int | None]"]


class GroupGenerator:
    """Makes scored groups for the rollout manager (training, evaluation, and rollout functions)."""

    def __init__(self, *, client, router_url: str, counters: dict[str, int], tokenizer, reward: SampleReward,
                 custom_generate: Callable | None, replay_after_dispatch: bool, run_id: str | None = None,
                 routing: RoutingShape | None = None, proxy: AttributionProxy | None = None,
                 teacher: Teacher | None = None, student_top_k: int = 0):
        """``routing``: MoE routed experts every call asks for and every sample must carry (None: none);
        ``proxy``: the generate hook's router addresses (one per sample being generated); ``teacher``:
        the ``--use-opd`` teacher every training sample is scored by (None: none); ``student_top_k``: the
        ``top_logprobs_num`` training calls ask for (top-k OPD's student side, kept in the sample's metadata)."""
        self._client, self._url, self._counters = client, router_url, counters
        self.tokenizer, self._reward, self._custom = tokenizer, reward, custom_generate
        self._replay, self._run_id, self._routing, self._proxy = replay_after_dispatch, run_id, routing, proxy
        self._teacher, self._student_top_k = teacher, student_top_k

    # ------------------------------------------------------------------ pending samples

    def pending_group(self, prompt, n: int) -> list[Sample]:
        """``n`` not-yet-generated samples of ``prompt`` (miles' PENDING samples)."""
        prompt_ids = self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        return [Sample(prompt_ids=list(prompt_ids), response_ids=[], response_logprobs=[], reward=None,
                       prompt=prompt.text, label=prompt.label, status=SampleStatus.PENDING.value,
                       metadata={**dict(prompt.metadata), "prompt_index": prompt.index})
                for _ in range(n)]

    # ------------------------------------------------------------------ generation

    async def group(self, prompt, n: int, args: RolloutArgs, bound: VersionBound) -> Group:
        """All ``n`` samples of ``prompt``, generated and scored."""
        if self._custom is None:
            samples = await self._batched(prompt, n, args, bound)
        else:
            samples = await self.run_samples(self.pending_group(prompt, n), args)
        self._counters["groups"] = self._counters.get("groups", 0) + 1
        return Group(prompt_index=prompt.index, samples=samples)

    async def run_samples(self, samples: list[Sample], args: RolloutArgs) -> list[Sample]:
        """Generate (custom function, or one engine call each) and score pending samples concurrently."""
        done = await asyncio.gather(*(self._one(sample, args) for sample in samples))
        samples = [sample for each in done for sample in each]
        await self.score(samples, args)
        return samples

    async def score(self, samples: list[Sample], args: RolloutArgs) -> None:
        """The run's reward on checked samples (one call for them all with ``--group-rm``) and, for
        training, the ``--use-opd`` teacher's logprobs of their tokens (both at once)."""
        if self._teacher is None or args.evaluation:
            await self._reward.score(args, samples)
            return
        await asyncio.gather(self._reward.score(args, samples), self._teacher.score(samples))

    async def _one(self, sample: Sample, args: RolloutArgs) -> list[Sample]:
        """The pending sample generated: one sample, or (a session run's trajectory tree, miles' list
        return) one per branch."""
        if self._custom is None:
            result = await args.engine.generate(sample, args.sampling_params)
        elif self._proxy is None:
            result = await self._custom(args, sample, args.sampling_params)
            if isinstance(result, list) and result:
                return [self.finish(each, args) for each in result]
        else:
            async with self._proxy.slot(args.engine.version_bound) as (router_url, log):
                try:
                    result = await self._custom(args.at_router(router_url), sample, args.sampling_params)
                except Exception:
                    log.raise_lost()  # the hook failed on a request lost after dispatch: the group is given up
                    raise
            log.apply(result)
        return [self.finish(result, args)]

    async def _batched(self, prompt, n: int, args: RolloutArgs, bound: VersionBound) -> list[Sample]:
        prompt_ids = self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        min_version, exact_version = bound()
        top_k = 0 if args.evaluation else self._student_top_k
        body = request_body(prompt_ids, args.sampling, min_version, exact_version=exact_version, num_samples=n,
                            run_id=self._run_id, top_logprobs_num=top_k)
        if self._routing is not None:
            body.update(request_fields(0, len(prompt_ids)))
        self._counters["requests"] = self._counters.get("requests", 0) + 1
        payload = await generate_one(self._client, self._url, body, self._counters,
                                     replay_after_dispatch=self._replay)
        items = payload if isinstance(payload, list) else [payload]
        if len(items) != n:
            raise GenerationFailed(f"asked for {n} samples of one prompt, got {len(items)}")
        samples = []
        for item in items:
            sample = sample_from_response(prompt_ids, item)
            if self._routing is not None:
                append_call_routing(sample, item["meta_info"], start_len=0,
                                    seqlen=len(prompt_ids) + len(sample.response_ids), shape=self._routing)
            if top_k:
                keep_top(sample.metadata, item["meta_info"], len(sample.response_ids))
            sample.prompt, sample.label, sample.reward = prompt.text, prompt.label, None
            sample.metadata.update({**dict(prompt.metadata), "prompt_index": prompt.index,
                                    "requested_min_version": min_version,
                                    "routed_worker": item["meta_info"].get("routed_worker")})
            samples.append(self.finish(sample, args))
        await self.score(samples, args)
        return samples

    # ------------------------------------------------------------------ checks and reward

    def finish(self, sample: Any, args: RolloutArgs) -> Sample:
        """Check a generated sample (``score`` then sets its reward unless its generate function did)."""
        if not isinstance(sample, Sample):
            raise GenerationFailed(f"a generate function returned {type(sample).__name__}, not a Sample "
                                   "(several samples per prompt: raise --n-samples-per-prompt instead)")
        if not sample.call_versions:
            who = f"{self._proxy.hook}: " if self._proxy is not None else ""
            raise GenerationFailed(f"{who}a sample reached the rollout without an engine call recorded: every call "
                                   "must go through args.engine.generate or the hook's args.sglang_router_ip/port "
                                   "(they add the version constraint and record the versions that served it)")
        if not sample.response_ids:
            raise GenerationFailed("a generated sample has an empty response")
        try:
            sample.check_consistent()
        except InvalidInput as exc:
            who = f"{self._proxy.hook}: " if self._proxy is not None else ""
            raise GenerationFailed(f"{who}a generated sample is inconsistent: {exc}") from None
        if self._routing is not None:
            check_covers_tokens(sample, self._routing)
        if sample.status == SampleStatus.PENDING:
            sample.status = SampleStatus.COMPLETED.value
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        sample.response = sample.response or text
        sample.metadata["response_text"] = sample.response
        return sample
