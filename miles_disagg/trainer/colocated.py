"""The trainer's side of the colocated weight handoff: SGLang's ``/update_weights_from_tensor``.

Rank 0 copies the exported tensors into buckets of about ``bucket_bytes`` (on the GPU when
there is one, so they travel as CUDA IPC handles; else in shared memory), and sends each
bucket's handles to every engine, one serialized entry per engine TP rank, inside one
weight-update session per engine (``/begin_weight_update`` ... ``/end_weight_update``). A
bucket is freed only after every engine answered, i.e. copied it. The last bucket carries
``weight_version`` (and ``flush_cache``), so an engine reports the new version only once it
holds all of it. Any refusal raises the engine client's typed error naming the engine.
"""

from __future__ import annotations

from typing import Iterable

import torch


def push_named_tensors(engine_urls: list[str], named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       bucket_bytes: int) -> dict:
    from miles_disagg.engines.client import EngineClient
    from miles_disagg.engines.updater import engine_ranks

    clients = [EngineClient(url) for url in engine_urls]
    try:
        ranks = [engine_ranks(c.server_info()) for c in clients]
        for client in clients:
            client.begin_weight_update()
        try:
            sent = _send_buckets(clients, ranks, named_tensors, version, bucket_bytes)
        finally:
            for client in clients:
                client.end_weight_update()
    finally:
        for client in clients:
            client.close()
    return sent


def _send_buckets(clients, ranks: list[int], named_tensors, version: int, bucket_bytes: int) -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = num_tensors = num_buckets = total = 0
    for name, tensor in named_tensors:
        # a copy of our own: the engines must never see the trainer's live storage
        bucket.append((name, tensor.to(device, copy=True)))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            _send(clients, ranks, bucket, version=None)
            num_tensors, total, num_buckets = num_tensors + len(bucket), total + size, num_buckets + 1
            bucket, size = [], 0
    _send(clients, ranks, bucket, version=version)  # the last (maybe empty) bucket labels the version
    return {"tensors": num_tensors + len(bucket), "bytes": total + size, "buckets": num_buckets + 1}


def _send(clients, ranks: list[int], bucket: list[tuple[str, torch.Tensor]], version: int | None) -> None:
    from miles_disagg.engines.tensor_transfer import serialize_named_tensors

    payload = serialize_named_tensors(bucket)
    for client, num_ranks in zip(clients, ranks):
        client.update_weights_from_tensor([payload] * num_ranks, weight_version=version, flush_cache=version is not None)
    if bucket and bucket[0][1].is_cuda:
        torch.cuda.synchronize()
