"""A user's agent for ``--use-session-server`` (``--custom-agent-function-path session_agent.run_agent``
with this directory on PYTHONPATH), written against the official ``openai`` client as any harness is.

The count-up-tool episode as a tool-calling conversation: the policy answers the prompt's digits with two
of its own, a counter tool answers the next two digits (a ``tool`` message), and the policy writes two more.
With ``SESSION_AGENT_RETRIES=1`` (the suite's short run) the agent, as harnesses that retry do, sends
its first request a second time in about half the sessions and keeps the first answer: the session's
trajectory tree gets a second root, and the session two samples.
Returned to the run (miles' contract): the positions of the policy's own characters in the response, which
the task's reward scores (``miles_disagg.rollout.counter_tool.count_up_tool_reward``).
"""

from __future__ import annotations

import os

import openai

from miles_disagg.rollout.counter_tool import counter_tool

TOOLS = [{"type": "function", "function": {"name": "count", "description": "the next two digits",
                                           "parameters": {"type": "object", "properties": {}}}}]


async def run_agent(base_url, prompt, request_kwargs, metadata):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    kwargs = {**request_kwargs, "max_tokens": 2}
    extra = {"top_k": kwargs.pop("top_k")} if "top_k" in kwargs else {}  # not an OpenAI field: sent as an extra
    messages = [{"role": "user", "content": prompt}]
    response, positions = "", []
    try:
        for turn in range(2):
            answer = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                          extra_body=extra, **kwargs)
            if turn == 0 and os.environ.get("SESSION_AGENT_RETRIES") == "1" and sum(map(ord, prompt)) % 2:
                await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                     extra_body=extra, **kwargs)  # a retry: a branch
            text = answer.choices[0].message.content or ""
            positions.extend(range(len(response), len(response) + len(text)))
            response += text
            if turn == 1 or answer.choices[0].finish_reason != "length":
                break
            tool = counter_tool(prompt + response)
            messages += [answer.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": "count-0", "content": tool}]
            response += tool
    finally:
        await client.close()
    return {"policy_positions": positions, "agent_response": response}
