"""What rollout hooks receive: ``args`` (a small typed object, not the run's config), the engine
caller that every generation goes through, and the prompt source of a rollout function.

miles hands its hooks the whole argument namespace. Ours get :class:`RolloutArgs`, whose fields
keep miles' names for what a hook typically reads:

=================================  ==========================================================
miles                              here
=================================  ==========================================================
``args.rollout_batch_size``        ``args.rollout_batch_size`` (groups per training step)
``args.n_samples_per_prompt``      ``args.n_samples_per_prompt``
``args.over_sampling_batch_size``  ``args.over_sampling_batch_size``
``args.rollout_max_response_len``  ``args.rollout_max_response_len`` (the whole episode's budget)
``args.rollout_temperature`` ...   ``args.rollout_temperature``, ``rollout_top_p``, ``rollout_top_k``
``GenerateState(args).sampling_params``  ``args.sampling_params`` (a fresh dict each time)
``GenerateState(args).tokenizer``  ``args.tokenizer``
``args.sglang_router_ip/port``     ``args.sglang_router_ip``, ``args.sglang_router_port``, ``args.router_url``
``args.hf_checkpoint``             ``args.hf_checkpoint``
``post(router_url + "/generate")`` ``await args.engine.generate(sample, sampling_params)``
``generate_and_rm_group(...)``     ``await args.generate_group(samples)``
=================================  ==========================================================

``args.engine`` adds the request's version constraint (``min_version = current - K``, or the
exact version during evaluation), retries refusals, appends the generated tokens with
``loss_mask`` 1 and their logprobs, and records the versions that served the call. A generate
hook may instead POST to ``args.sglang_router_ip/port`` itself (miles' ``post``, any client): that
address is its sample's own (``rollout/attribution.py``), which adds the same constraint and
records the same versions. A sample that reaches the trainer without a recorded call is refused.
With MoE routing (``--use-rollout-routing-replay``; see :mod:`miles_disagg.rollout.routed_experts`)
each ``args.engine`` call also asks for the routed experts of the positions no earlier call of the
sample ran and appends them to ``sample.rollout_routed_experts``: each token keeps the routing of
the call (and so the version) that first ran it. A hook must not cut tokens an engine already
routed, and an episode must end with an engine call (tokens appended after the last call were
routed by none).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from miles_disagg.rollout.attribution import CURRENT_LOG
from miles_disagg.rollout.opd_topk import TopKError, keep_student_top, pad_student_top
from miles_disagg.rollout.generate import (
    GenerationFailed, SamplingSettings, constrained, generate_one, sample_from_response)
from miles_disagg.rollout.routed_experts import RoutingShape, append_call_routing, request_fields, rows_held
from miles_disagg.samples import Sample, SampleStatus

VersionBound = Callable[[], "tuple[int | None, int | None]"]
"""Called at each request: ``(min_version, exact_version)`` to ask for (either may be None)."""


def keep_top(metadata: dict[str, Any], meta_info: dict, num_tokens: int) -> None:
    """Top-k OPD: a student call's ``output_top_logprobs`` kept in the sample's metadata
    (:func:`miles_disagg.rollout.opd_topk.keep_student_top`); ``GenerationFailed`` if the engine gave none."""
    try:
        keep_student_top(metadata, meta_info, num_tokens)
    except TopKError as exc:
        raise GenerationFailed(str(exc)) from None


class EngineCaller:
    """Version-constrained ``/generate`` calls through the router on behalf of rollout hooks."""

    def __init__(self, client, router_url: str, counters: dict[str, int], version_bound: VersionBound,
                 tokenizer, max_response_len: int, *, replay_after_dispatch: bool = True, run_id: str | None = None,
                 routing: RoutingShape | None = None, student_top_k: int = 0):
        """``student_top_k``: the ``top_logprobs_num`` each call asks for (top-k OPD; 0: none)."""
        self._client, self._url, self._counters = client, router_url, counters
        self._version_bound, self._tokenizer = version_bound, tokenizer
        self._max_response_len = max_response_len
        self._replay, self._run_id, self._routing = replay_after_dispatch, run_id, routing
        self._student_top_k = student_top_k

    def with_bound(self, version_bound: VersionBound, max_response_len: int | None = None) -> "EngineCaller":
        """The same caller asking for other versions (evaluation asks for exactly one)."""
        return EngineCaller(self._client, self._url, self._counters, version_bound, self._tokenizer,
                            max_response_len or self._max_response_len, replay_after_dispatch=self._replay,
                            run_id=self._run_id, routing=self._routing, student_top_k=self._student_top_k)

    @property
    def version_bound(self) -> VersionBound:
        return self._version_bound

    async def generate(self, sample: Sample, sampling_params: dict[str, Any] | None = None) -> Sample:
        """Continue ``sample`` (prompt and response so far) with one engine call and append the result.

        ``max_new_tokens`` is capped by what is left of ``--rollout-max-response-len`` after the
        response so far; with nothing left the sample is marked truncated and no call is made.
        The call asks for the version bound in force now (not at the episode's start).
        """
        params = dict(sampling_params or {})
        left = self._max_response_len - len(sample.response_ids)
        params["max_new_tokens"] = min(int(params.get("max_new_tokens", left)), left)
        if params["max_new_tokens"] <= 0:
            sample.status, sample.finish_reason = SampleStatus.TRUNCATED.value, "length"
            return sample
        min_version, exact_version = self._version_bound()
        body = constrained({"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True},
                           min_version, exact_version, self._run_id)
        start_len = rows_held(sample)
        if self._routing is not None:  # only the positions no earlier call of this sample ran
            body.update(request_fields(start_len, len(body["input_ids"])))
        if self._student_top_k:
            body["top_logprobs_num"] = self._student_top_k
        self._counters["requests"] = self._counters.get("requests", 0) + 1
        payload = await generate_one(self._client, self._url, body, self._counters,
                                     replay_after_dispatch=self._replay)
        if not isinstance(payload, dict):
            raise GenerationFailed(f"one prompt was sent, the router answered {type(payload).__name__}")
        part = sample_from_response(body["input_ids"], payload)
        if self._routing is not None:
            append_call_routing(sample, payload["meta_info"], start_len=start_len, shape=self._routing,
                                seqlen=len(body["input_ids"]) + len(part.response_ids))
        if self._student_top_k:
            keep_top(sample.metadata, payload["meta_info"], len(part.response_ids))
        sample.append_response(part.response_ids, part.response_logprobs, trained=True)
        sample.record_engine_call(part.weight_version_start, part.weight_version_end)
        log = CURRENT_LOG.get()  # inside a generate hook: the sample's log holds every call, in order
        if log is not None:
            log.calls.append([part.weight_version_start, part.weight_version_end])
        sample.response += self._tokenizer.decode(part.response_ids, skip_special_tokens=True)
        sample.finish_reason, sample.status = part.finish_reason, part.status
        sample.metadata.setdefault("requested_versions", []).append(
            {"min_version": min_version, "exact_version": exact_version})
        return sample

    def append_tool_output(self, sample: Sample, text: str) -> list[int]:
        """Append environment/tool ``text`` to the response: its tokens get ``loss_mask`` 0 (no gradient)."""
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        sample.append_response(ids, trained=False)
        pad_student_top(sample.metadata, len(ids))
        sample.response += text
        return ids


@dataclass(frozen=True)
class RolloutArgs:
    """What a rollout hook gets as ``args`` (see the module docstring for the mapping to miles' args)."""

    rollout_batch_size: int
    n_samples_per_prompt: int
    over_sampling_batch_size: int
    sampling: SamplingSettings
    max_weight_staleness: int | None
    hf_checkpoint: str
    router_url: str
    tokenizer: Any = field(repr=False)
    engine: EngineCaller = field(repr=False)
    evaluation: bool = False
    run_group: Callable[[list[Sample]], Awaitable[list[Sample]]] | None = field(default=None, repr=False)
    rollout_concurrency: int = 64
    rm_type: str | None = None
    custom_rm_path: str | None = None
    reward_key: str | None = None
    eval_reward_key: str | None = None
    group_rm: bool = False
    partial_rollout: bool = False  # miles' --partial-rollout is refused here: always False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"args.{name}: miles' argument {name!r} is not given to hooks here (their args carry "
                             "what docs/rollout-extensions.md, \"What hooks receive\", lists)")

    def at_router(self, router_url: str) -> "RolloutArgs":
        """The same args naming another router address (a generate hook's own, see rollout/attribution.py)."""
        return replace(self, router_url=router_url)

    @property
    def rollout_max_response_len(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def rollout_temperature(self) -> float:
        return self.sampling.temperature

    @property
    def rollout_top_p(self) -> float:
        return self.sampling.top_p

    @property
    def rollout_top_k(self) -> int:
        return self.sampling.top_k

    @property
    def sampling_params(self) -> dict[str, Any]:
        """The run's sampling parameters as an SGLang ``sampling_params`` dict (a new dict each time)."""
        return self.sampling.to_json()

    @property
    def sglang_router_ip(self) -> str:
        return urlsplit(self.router_url).hostname or ""

    @property
    def sglang_router_port(self) -> int:
        return urlsplit(self.router_url).port or 80

    async def generate_group(self, samples: list[Sample]) -> list[Sample]:
        """Generate and score one group of pending samples the way the rollout does (the custom
        generate function if one is configured, then the reward)."""
        if self.run_group is None:
            raise GenerationFailed("this args object cannot generate groups")
        return await self.run_group(samples)

    def for_evaluation(self, exact_version: int, sampling: SamplingSettings,
                       run_group: Callable[[list[Sample]], Awaitable[list[Sample]]] | None) -> "RolloutArgs":
        return replace(self, evaluation=True, sampling=sampling, run_group=run_group,
                       engine=self.engine.with_bound(lambda: (None, exact_version), sampling.max_new_tokens))


class PromptSamples:
    """A rollout function's ``data_source``: ``get_samples(n)`` draws ``n`` prompts and returns ``n``
    groups of ``n_samples_per_prompt`` pending samples (miles' ``DataSource.get_samples``)."""

    def __init__(self, draw: Callable[[int], list], make_group: Callable[[Any, int], list[Sample]],
                 n_samples_per_prompt: int):
        self._draw, self._make_group, self._n = draw, make_group, n_samples_per_prompt

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return [self._make_group(prompt, self._n) for prompt in self._draw(num_samples)]


@dataclass
class EvalSamples:
    """An eval function's ``data_source``: each ``--eval-prompt-data`` set by name, as groups of
    ``--n-samples-per-eval-prompt`` pending samples."""

    datasets: dict[str, list[list[Sample]]]
