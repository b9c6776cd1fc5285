"""The version-aware router passes MoE routing replay through: the request's top-level
``return_routed_experts`` / ``routed_experts_start_len`` reach the worker, and each answer's
``meta_info["routed_experts"]`` comes back untouched beside the served versions (single and batched)."""

from __future__ import annotations

import base64

from fastapi import Request  # module level: handlers' string annotations resolve against globals

from router_fixtures import inprocess_router, retry_until_served, serve_in_thread

ROUTING = base64.b64encode(bytes(range(48))).decode()


def routing_worker(received: list):
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/model_info")
    async def model_info():
        return {"weight_version": "2"}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        received.append(body)
        item = {"text": "x", "output_ids": [1], "meta_info": {"weight_version": "2", "routed_experts": ROUTING}}
        return [item, item] if isinstance(body["input_ids"][0], list) else item

    return app


def test_routing_fields_and_answers_pass_through_the_router():
    received: list[dict] = []
    with serve_in_thread(routing_worker(received)) as worker_url, inprocess_router(workers=(worker_url,)) as router:
        router.client.wait_worker_version(worker_url, 2)
        single = retry_until_served(router, {"input_ids": [5, 6, 7], "return_routed_experts": True,
                                             "routed_experts_start_len": 2, "weight_version": {"min_version": 2}})
        assert single.status_code == 200, single.text
        assert received[-1] == {"input_ids": [5, 6, 7], "return_routed_experts": True, "routed_experts_start_len": 2}
        meta = single.json()["meta_info"]
        assert meta["routed_experts"] == ROUTING and (meta["weight_version_start"], meta["weight_version_end"]) == (2, 2)
        batched = retry_until_served(router, {"input_ids": [[5, 6], [5, 6]], "return_routed_experts": True})
        assert [item["meta_info"]["routed_experts"] for item in batched.json()] == [ROUTING, ROUTING]
        assert received[-1]["return_routed_experts"] is True
