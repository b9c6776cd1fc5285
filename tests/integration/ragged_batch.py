"""The ragged training batch of the trainer-group tests (1 rank against 2, the critic's group)."""

from __future__ import annotations

import torch

from miles_disagg.samples import Sample


def ragged_samples(n: int = 8) -> list[Sample]:
    """Ragged responses (2 to 7 tokens); in every third sample the tokens between its first and last are
    tool output its policy did not generate (masked out of the loss); advantages in [-0.5, 1.2]."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 60, (3 + i % 3,), generator=generator).tolist()
        length = 2 + (5 * i) % 6
        response = torch.randint(3, 60, (length,), generator=generator).tolist()
        mask = [0 if (i % 3 == 0 and 0 < t < length - 1) else 1 for t in range(length)]
        out.append(Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-4.0] * length,
                          advantage=float(i % 2) - 0.5 + 0.1 * i, loss_mask=mask))
    return out
