"""A fake SGLang engine with tensor parallelism: its weight-update side only.

``python fake_tp_engine.py --port P --tp-size N`` serves the endpoints a broadcast update
touches. Like SGLang, ``/init_weights_update_group`` has each of its N TP workers (here: one
process each) join the trainer's group at ``rank_offset + tp_rank``, and
``/update_weights_from_distributed`` has every worker receive each tensor by
``broadcast(src=0)``. ``GET /received`` returns, per worker, the rank it joined with and the
sum and shape of every tensor it received, so a test can check that each rank got every
tensor. ``nccl`` is served with gloo (no GPU here), as the built-in engine does.
"""

# no "from __future__ import annotations": FastAPI must see the real Request class

import argparse
import multiprocessing as mp


def _worker(conn, tp_rank: int) -> None:
    import torch
    import torch.distributed as dist

    from miles_disagg.distributed import init_custom_process_group

    group, rank = None, None
    while True:
        command, args = conn.recv()
        try:
            if command == "join":
                rank = args["rank_offset"] + tp_rank
                group = init_custom_process_group(
                    backend="gloo", init_method=f"tcp://{args['master_address']}:{args['master_port']}",
                    world_size=args["world_size"], rank=rank, group_name=args["group_name"], timeout_s=60)
                conn.send(("ok", rank))
            elif command == "receive":
                received = {}
                for name, dtype, shape in zip(args["names"], args["dtypes"], args["shapes"]):
                    buffer = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
                    dist.broadcast(buffer, src=0, group=group)
                    received[name] = {"sum": float(buffer.double().sum()), "shape": list(buffer.shape)}
                conn.send(("ok", {"rank": rank, "tensors": received}))
            elif command == "stop":
                conn.send(("ok", None))
                return
        except Exception as exc:  # noqa: BLE001 - reported to the HTTP caller
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class FakeTPEngine:
    def __init__(self, tp_size: int):
        self.tp_size = tp_size
        self.version = "0"
        self.received: list[dict] = []
        context = mp.get_context("spawn")
        self.conns = []
        for tp_rank in range(tp_size):
            parent, child = context.Pipe()
            context.Process(target=_worker, args=(child, tp_rank), daemon=True).start()
            self.conns.append(parent)

    def all_workers(self, command: str, args: dict) -> list:
        for conn in self.conns:
            conn.send((command, args))
        answers = [conn.recv() for conn in self.conns]
        errors = [value for status, value in answers if status != "ok"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [value for _, value in answers]


def create_app(engine: FakeTPEngine):
    import asyncio

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()

    async def in_workers(command: str, args: dict) -> list:
        return await asyncio.get_running_loop().run_in_executor(None, engine.all_workers, command, args)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/server_info")
    async def server_info():
        return {"tp_size": engine.tp_size, "dp_size": 1, "pp_size": 1, "weight_version": engine.version}

    @app.get("/model_info")
    async def model_info():
        return {"weight_version": engine.version}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        body = await request.json()
        try:
            ranks = await in_workers("join", body)
        except RuntimeError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return {"success": True, "message": f"joined with ranks {ranks}"}

    @app.post("/update_weights_from_distributed")
    async def update(request: Request):
        body = await request.json()
        try:
            engine.received = await in_workers("receive", body)
        except RuntimeError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        if body.get("weight_version") is not None:
            engine.version = str(body["weight_version"])
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.get("/received")
    async def received():
        return {"workers": engine.received}

    for path in ("/pause_generation", "/continue_generation", "/flush_cache", "/begin_weight_update",
                 "/end_weight_update"):
        app.post(path)(_ok)
    return app


async def _ok():
    return {"status": "ok"}


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=2)
    args = parser.parse_args()
    engine = FakeTPEngine(args.tp_size)
    uvicorn.run(create_app(engine), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
