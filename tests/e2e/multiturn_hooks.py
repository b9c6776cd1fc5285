"""A user's multi-turn generate function, loaded by ``train_async.py`` from this file by dotted path
(``--custom-generate-function-path multiturn_hooks.generate`` with this directory on PYTHONPATH).

Three policy turns of one token with a tool answer after each of the first two: the tool echoes
the policy's last character twice and appends ``=``. The tool's characters are environment
output: they carry ``loss_mask`` 0.
"""

from __future__ import annotations


def echo_tool(text: str) -> str:
    return text[-1:] * 2 + "=" if text else "="


async def generate(args, sample, sampling_params):
    params = {**sampling_params, "max_new_tokens": 1}
    for turn in range(3):
        sample = await args.engine.generate(sample, params)
        if turn == 2 or sample.finish_reason != "length":
            break
        start = len(sample.response_ids)
        tool_ids = args.engine.append_tool_output(sample, echo_tool(sample.response))
        sample.metadata.setdefault("tool_spans", []).append([start, len(tool_ids)])
    return sample
