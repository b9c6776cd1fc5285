"""A launched built-in engine driven over HTTP, and the throughput measurement ``bench engine`` and
``scripts/gpu_check.sh``'s engine sections share.

:func:`engine_throughput` takes any object with ``generate(body) -> dict`` (the engine's ``/generate``
answer): :class:`HttpEngine` here, or ``bench engine``'s own client.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from miles_disagg.bench.common import progress

_progress = progress("engine")


class HttpEngine:
    """A launched engine (:func:`miles_disagg.engines.launch.launch_engine`'s handle) and an HTTP
    client for it: ``post``, ``get``, ``generate``; :meth:`stop` closes the client and stops the engine."""

    def __init__(self, launched):
        import httpx

        self.launched = launched
        self.client = httpx.Client(base_url=launched.url, timeout=600, trust_env=False)

    def post(self, path: str, body: dict):
        return self.client.post(path, json=body)

    def get(self, path: str) -> dict:
        return self.client.get(path).json()

    def generate(self, body: dict) -> dict:
        return self.check(self.post("/generate", body))

    @staticmethod
    def check(response) -> dict:
        """The JSON answer of a 200 response; ``RuntimeError`` with the path, status and body otherwise."""
        if response.status_code != 200:
            raise RuntimeError(f"{response.request.url.path}: {response.status_code} {response.text[:300]}")
        return response.json()

    def stop(self) -> None:
        self.client.close()
        self.launched.stop()


def engine_throughput(engine, prompts: list[list[int]], max_new: int, concurrency: int) -> float:
    """Generated tokens per second over ``prompts`` (greedy, ``max_new`` tokens each, ``ignore_eos``),
    ``concurrency`` requests in flight, after one short untimed warm-up request."""
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    engine.generate({"input_ids": prompts[0], "sampling_params": {**params, "max_new_tokens": 4}})
    _progress(f"engine: {len(prompts)} x {max_new} tokens at concurrency {concurrency}")

    def one(prompt: list[int]) -> int:
        return engine.generate({"input_ids": prompt, "sampling_params": params})["meta_info"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - start)
