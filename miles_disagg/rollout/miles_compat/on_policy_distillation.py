"""``miles.rollout.on_policy_distillation``: miles' SGLang-teacher recipe (``--custom-rm-path
...reward_func --custom-reward-post-process-path ...post_process_rewards --rm-url TEACHER``).

In miles the reward function asks the teacher (``--rm-url``) and the post-process stores its logprobs
on the sample and gives every sample the reward 0 (pure distillation: the learning signal is the OPD
term alone). Here the rollout itself asks the teacher of every training sample under ``--use-opd``
(:mod:`miles_disagg.rollout.teacher`), so these keep miles' meaning without a second call: the reward
is 0.0, and the post-process checks the teacher's logprobs are there and returns miles' zeros.
"""

from __future__ import annotations

from typing import Any

from miles_disagg.rollout.generate import GenerationFailed


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    """miles' OPD reward: the teacher's answer, which its post-process turns into 0.0 (see the module)."""
    return 0.0


def post_process_rewards(args: Any, samples: list, **kwargs: Any) -> tuple[list[float], list[float]]:
    """miles': ``(raw rewards, rewards)``, both 0 for every sample, once each carries its teacher logprobs."""
    if any(getattr(s, "teacher_logprobs", None) is None for s in samples):
        raise GenerationFailed("miles.rollout.on_policy_distillation.post_process_rewards: a sample has no teacher "
                               "logprobs; run with --use-opd --opd-type sglang and the teacher's --rm-url")
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
