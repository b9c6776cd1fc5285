"""One trainer rank (a Ray actor): torch.distributed, a backend, and (disk-delta) its publisher.

Every method is called on all ranks at once by ``TrainerGroup`` (the backend's methods
are collective). Disk-delta publication is sharded: every rank's ``DeltaPublisher`` holds,
encodes and writes its share of the HF tensors (``backend.publish_share``), and rank 0
commits each version once every share is durable (``weights/commit.py``).
"""

from __future__ import annotations

import os
import time

from miles_disagg.config.actors import TrainerGroupConfig

PUSH_BUCKET_BYTES = 512 << 20  # colocated weight handoff: tensors shared per request
from miles_disagg.samples import Sample


class TrainerRank:
    def __init__(self, rank: int, world_size: int, config: TrainerGroupConfig):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.rank, self.world_size = rank, world_size
        self.train_config, self.weights_config, self.hf_dir = config.train, config.weights, config.hf_dir
        self.train_dir = config.train_dir or config.hf_dir  # full precision: what the backend trains
        self.temperature = config.temperature
        self.miles_args = config.miles_args
        self.initial_checkpoint = config.initial_checkpoint
        self.lora_base_dir = config.lora_base_dir  # publishes adapter versions (LoRA served by the engines)
        self.rollout_engines: tuple[str, ...] = ()
        self.backend = None
        self.publisher = None
        self._offloader = None

    def address(self) -> tuple[str, int]:
        import ray

        from miles_disagg.net.process import free_port

        return ray.util.get_node_ip_address(), free_port("0.0.0.0")

    def setup(self, master_addr: str, master_port: int, run_id: str | None, delta_filter: str = "none") -> dict:
        import torch

        from miles_disagg.trainer.backends import make_backend
        from miles_disagg.distributed import init_distributed

        torch.set_num_threads(1)
        start = time.perf_counter()
        backend = init_distributed(self.rank, self.world_size, master_addr, master_port)
        self.backend = make_backend(self.train_config, self.train_dir, rank=self.rank, world_size=self.world_size,
                                    temperature=self.temperature, initial_checkpoint=self.initial_checkpoint)
        if self.weights_config.update_weight_transfer_mode == "disk-delta":
            self.publisher = self._make_publisher(run_id, delta_filter)
        return {"backend": backend, "setup_s": time.perf_counter() - start,
                "run_id": self.publisher.run_id if self.publisher else run_id}

    def _make_publisher(self, run_id: str | None, delta_filter: str):
        from miles_disagg.weights.commit import TorchCollective
        from miles_disagg.weights.hooks import POST_WRITE_FLAG, MilesHookContext, load_hook
        from miles_disagg.weights.publisher import DeltaPublisher
        from miles_disagg.weights.safetensors_io import checkpoint_tensors

        w = self.weights_config
        hook = None
        if self.rank == 0:  # the committing rank runs the post-write hook, once per version
            hook = load_hook(w.custom_update_weight_post_write_path, POST_WRITE_FLAG,
                             MilesHookContext(self.miles_args, lambda: self.rollout_engines))
        base_dir = self._adapter_chain_base() if self.lora_base_dir else self.hf_dir
        base_in_store, model_in_store = w.rollout_base_from_store, None
        if self.lora_base_dir and "://" in w.update_weight_disk_dir:  # the adapter chain's version 0 into the store
            base_in_store, model_in_store = True, (self.hf_dir if w.rollout_base_from_store else None)
        sizes = {name: entry.nbytes for name, (_, entry) in checkpoint_tensors(base_dir).items()}
        publisher = DeltaPublisher(
            w.update_weight_disk_dir, base_dir=base_dir, run_id=run_id, encoding=w.update_weight_delta_encoding,
            checksum=w.update_weight_delta_checksum, filter=delta_filter, post_write_hook=hook,
            full_anchor_interval=w.update_weight_full_anchor_interval, base_in_store=base_in_store,
            model_in_store=model_in_store,
            share=self.backend.publish_share(sizes), collective=TorchCollective() if self.world_size > 1 else None)
        publisher.capture_baseline()  # the first update only captures the baseline
        return publisher

    def _adapter_chain_base(self) -> str:
        """The adapter chain's version 0 (the adapter as initialised: ``--seed``, or
        ``--lora-adapter-path``), written once by rank 0 and kept by later runs that build on it."""
        import torch.distributed as dist

        from miles_disagg.trainer.lora import adapter_config
        from miles_disagg.weights.adapters import is_adapter_dir, write_adapter_dir

        tensors = self.backend.adapter_tensors()  # collective under FSDP2
        if self.rank == 0 and not is_adapter_dir(self.lora_base_dir):
            write_adapter_dir(self.lora_base_dir, adapter_config(self.backend.lora, self.hf_dir), tensors)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        return self.lora_base_dir

    def _published_tensors(self):
        return self.backend.adapter_tensors().items() if self.lora_base_dir else self.backend.share_tensors()

    def set_rollout_engines(self, urls: list[str]) -> None:
        """The engines' URLs, for miles-signature post-write hooks (``rollout_engines``)."""
        self.rollout_engines = tuple(urls)

    def set_delta_filter(self, delta_filter: str) -> None:
        """The filter every later version is published with (``auto`` resolved by the driver)."""
        if self.publisher is not None:
            self.publisher.set_filter(delta_filter)

    def weight_checksums(self, algorithm: str) -> dict[str, str] | None:
        """Per-tensor checksums of what the engines must serve now: this rank's share of the last
        published state (disk-delta: the group merges the shares), or on rank 0 the policy itself
        (broadcast; collective; other ranks None)."""
        from miles_disagg.weights.checksums import checksum
        from miles_disagg.weights.torch_bytes import tensor_bytes

        if self.weights_config.update_weight_transfer_mode == "disk-delta":
            return self.publisher.published_checksums(algorithm)
        sums = {name: checksum(algorithm, tensor_bytes(t)) for name, t in self.backend.named_tensors()}
        return sums if self.rank == 0 else None

    def write_store_probe(self):
        """Rank 0: a probe file in the version store (rollout nodes read it back before training)."""
        from miles_disagg.weights.probe import write_probe

        return write_probe(self.weights_config.update_weight_disk_dir)

    def remove_store_probe(self, probe) -> None:
        from miles_disagg.weights.probe import remove_probe

        remove_probe(probe)

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: str) -> None:
        """This rank's part of the backend's checkpoint into ``directory`` (collective)."""
        self.backend.save_checkpoint(directory)

    def save_hf(self, directory: str) -> None:
        """Rank 0 writes the policy as an HF checkpoint (config and tokenizer from the base; not the
        base's record of its random initialisation, which the trained weights no longer are); collective."""
        import shutil

        from safetensors.torch import save_file

        from miles_disagg.models.tiny_qwen3 import INIT_RECORD_FILENAME

        tensors = {name: t.contiguous() for name, t in self.backend.named_tensors()}
        if self.rank != 0:
            return
        os.makedirs(directory, exist_ok=True)
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        for name in os.listdir(self.train_dir):  # the full-precision config (an FP8 base's declares FP8)
            if not name.endswith((".safetensors", ".index.json")) and name != INIT_RECORD_FILENAME:
                source = os.path.join(self.train_dir, name)
                if os.path.isfile(source):
                    shutil.copy2(source, os.path.join(directory, name))

    def load(self, directory: str) -> None:
        """Restore the backend from a save written by any number of ranks (collective)."""
        self.backend.load_checkpoint(directory)

    def publish_full(self):
        """A resumed trainer republishes its own state as a ``full`` version (rank 0; collective)."""
        return self.publish(full=True)

    def latest_published(self) -> dict | None:
        if self.publisher is None or self.publisher.latest is None:
            return None
        return {"run_id": self.publisher.latest.run_id, "version": self.publisher.latest.version}

    def train(self, steps: list[list[Sample]]):
        """This rank's share of each optimizer step -> the rollout's ``TrainResult`` (with
        ``--reset-optimizer-states`` the optimizer's history is cleared afterwards, as miles does)."""
        result = self.backend.train(steps)
        if self.train_config.reset_optimizer_states:
            from miles_disagg.trainer.optimizer_reset import reset_optimizer_states

            reset_optimizer_states(self.backend)
        return result

    def publish(self, full: bool = False):
        """Publish the current policy as the next version, every rank its share (collective; rank 0
        returns the version's ``PublishResult``, the others None)."""
        tensors = self._published_tensors()
        if self.publisher is None:
            for _ in tensors:
                pass
            return None
        return self.publisher.publish(tensors, full=full)

    # ------------------------------------------------------------------ broadcast transfer mode

    def tensor_meta(self) -> dict[str, list]:
        """Names, dtypes and shapes of the exported policy (the engines' receive plan)."""
        names, dtypes, shapes = [], [], []
        for name, tensor in self.backend.named_tensors():
            names.append(name)
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
        return {"names": names, "dtypes": dtypes, "shapes": shapes}

    def init_broadcast_group(self, master_addr: str, master_port: int, world_size: int, group_name: str) -> None:
        """Rank 0 joins the weight-update group as its rank 0 (blocks until every engine joined)."""
        import torch

        from miles_disagg.distributed import init_custom_process_group

        if self.rank != 0:
            return
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._broadcast_group = init_custom_process_group(
            backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
            world_size=world_size, rank=0, group_name=group_name)

    def broadcast_weights(self) -> float:
        """Send every exported tensor to the engines (rank 0; other ranks join the gather)."""
        import torch.distributed as dist

        start = time.perf_counter()
        for _, tensor in self.backend.named_tensors():
            if self.rank == 0:
                device_tensor = tensor.cuda() if dist.get_backend(self._broadcast_group) == "nccl" else tensor
                dist.broadcast(device_tensor, src=0, group=self._broadcast_group)
        return time.perf_counter() - start

    # ------------------------------------------------------------------ colocation (--colocate)

    def offload(self, params: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Move the optimizer state and/or the parameters off the device (gradients are dropped);
        see :mod:`miles_disagg.trainer.offload`. Returns the bytes moved by kind."""
        from miles_disagg.trainer.offload import HostOffloader

        module, optim = self.backend.offload_targets()
        if self._offloader is None:
            self._offloader = HostOffloader(next(module.parameters()).device)
        return self._offloader.offload(module, optim if optimizer else None, params=params)

    def onload(self) -> None:
        if self._offloader is not None:
            self._offloader.onload()

    def push_weights(self, engine_urls: list[str], version: int, bucket_bytes: int = PUSH_BUCKET_BYTES) -> dict:
        """Hand the policy to colocated engines by reference (``/update_weights_from_tensor``: CUDA
        IPC handles on GPU, shared memory on CPU), in buckets of about ``bucket_bytes``; the last
        bucket labels the engines' weights ``version``. Collective (rank 0 sends)."""
        from miles_disagg.trainer.colocated import push_named_tensors

        start = time.perf_counter()
        tensors = self.backend.named_tensors()
        if self.rank != 0:
            for _ in tensors:
                pass
            return {}
        sent = push_named_tensors(engine_urls, tensors, version, bucket_bytes)
        return {**sent, "seconds": time.perf_counter() - start}

    def named_tensor_bytes(self) -> dict[str, bytes]:
        """Rank 0's exported tensors as raw bytes (tests compare them with what engines serve)."""
        from miles_disagg.weights.torch_bytes import tensor_bytes

        return {name: tensor_bytes(t).tobytes() for name, t in self.backend.named_tensors()}
