"""Settings of one built-in engine process: the ``miles-disagg engine`` flags, declared once.

Pure: no heavy imports, so ``miles-disagg engine --help`` does not load torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles_disagg.net.asgi_guard import DEFAULT_MAX_REQUEST_BYTES, MAX_REQUEST_BYTES_HELP
from miles_disagg.config.commands import ADMIN_API_KEY_HELP, API_KEY_HELP
from miles_disagg.config.components import ENGINE_DTYPES  # weight dtypes the model runner loads
from miles_disagg.config.fields import REQUIRED, flag
from miles_disagg.engines.roots import lora_base_from_store_dir

DEVICES = ("cpu", "cuda")


REGION_HELP = "This host's region label: pull answers carry it, so a run records WAN bytes per region (empty: none)."

@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Run the built-in rollout engine (SGLang HTTP API) on one device."""

    model_path: Path = flag(REQUIRED, "HF causal LM checkpoint directory (config.json, safetensors, tokenizer files).")
    host: str = flag("127.0.0.1", "Address the HTTP server binds (loopback only unless told otherwise).")
    port: int = flag(30000, "HTTP port.")
    weight_version: str = flag("0", "Version reported before any update (a string, as in SGLang, whose default is "
                                    "'default'; this project's versions are ints and its base is 0).")
    device: str = flag("cpu", "Device the model runs on.", choices=DEVICES)
    dtype: str = flag("auto", "Weight dtype (auto: the checkpoint's).", choices=ENGINE_DTYPES)
    max_running_requests: int = flag(64, "Most requests decoded together in one batch; the rest wait in the queue.")
    random_seed: int = flag(0, "Seeds the generators of requests without sampling_seed.")
    prefix_cache_tokens: int = flag(32768, "Tokens of KV the prefix cache keeps (a radix tree, LRU eviction, "
                                           "dropped at every weight swap; 0: off).", metavar="N")
    pull_weights_pre_read_hook: str | None = flag(
        None, "Run hook(source_dir, target_version) before /pull_weights reads a version "
              "(miles passes --sglang-custom-pull-weights-pre-read-hook here).",
        name="--custom-pull-weights-pre-read-hook", metavar="MODULE:FUNCTION")
    weight_store_dirs: list[str] = flag([], "A version store /pull_weights may read (repeatable); pulls naming any "
                                             "other source_dir are refused with 403.",
                                         name="--weight-store-dir", metavar="DIR", repeat="append")
    region: str = flag("", REGION_HELP, metavar="NAME")
    local_checkpoint_dir: Path | None = flag(None, "The one host-local checkpoint /pull_weights materializes into "
                                                   "(and /update_weights_from_disk may load); none: no pulls.",
                                             metavar="DIR")
    allow_unverified_versions: bool = flag(False, "Testing only: accept /update_weight_version and version labels "
                                                  "that no verified load backs (stock SGLang's behaviour).")
    enable_return_routed_experts: bool = flag(False, "Let /generate requests ask for return_routed_experts (SGLang's "
                                                     "flag): each token's experts in meta_info['routed_experts'] "
                                                     "(mixture-of-experts models only).")
    enable_lora: bool = flag(False, "SGLang's: serve LoRA adapters (/load_lora_adapter, /unload_lora_adapter, "
                                    "lora_path on /generate); several resident, a batch may mix them.")
    max_loaded_loras: int = flag(4, "SGLang's: most LoRA adapters resident at once (a load beyond is refused, 409).",
                                 metavar="N")
    max_lora_rank: int = flag(64, "SGLang's: the highest adapter rank a load accepts.", metavar="N")
    lora_base_dir: Path | None = flag(None, "A run's LoRA adapter versions: /pull_weights materializes the store's "
                                            "adapter chain onto this version 0 and /activate_weights serves it beside "
                                            "the base without a pause (needs --enable-lora).", metavar="DIR")
    lora_base_from_store: bool = flag(False, "The adapter chain's version 0 comes from the object store "
                                             "(--weight-store-dir s3://...): the first /pull_weights fetches it "
                                             "onto this node, into --lora-base-dir (default: "
                                             "<--local-checkpoint-dir>.lora-v0); needs --enable-lora.")
    lora_resident_versions: int = flag(2, "With --lora-base-dir: the most adapter versions kept resident after an "
                                          "activation, the newest served and the older ones for requests pinned "
                                          "to them (the oldest leaves once its requests end).", metavar="K")
    lora_roots: list[str] = flag([], "A directory /load_lora_adapter may read adapters under (repeatable); any "
                                     "other lora_path is refused with 403.", name="--lora-root", metavar="DIR",
                                 repeat="append")
    api_key: str | None = flag(None, API_KEY_HELP, metavar="KEY")
    admin_api_key: str | None = flag(None, ADMIN_API_KEY_HELP, metavar="KEY")
    max_request_bytes: int = flag(DEFAULT_MAX_REQUEST_BYTES, MAX_REQUEST_BYTES_HELP, metavar="N")

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(ENGINE_DTYPES)}, got {self.dtype!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.lora_base_from_store:
            object.__setattr__(self, "lora_base_dir",  # a frozen config: its default fixed here once
                               lora_base_from_store_dir(self.lora_base_dir, self.local_checkpoint_dir,
                                                        self.weight_store_dirs))
        if self.lora_base_dir is not None and not self.enable_lora:
            raise ValueError("--lora-base-dir needs --enable-lora")
        if self.max_loaded_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loaded-loras and --max-lora-rank must be >= 1")
        if self.lora_resident_versions < 1 or (self.lora_base_dir is not None
                                               and self.lora_resident_versions > self.max_loaded_loras - 2):
            raise ValueError(f"--lora-resident-versions must be >= 1 and, with --lora-base-dir, at most "
                             f"--max-loaded-loras - 2 ({self.max_loaded_loras - 2}: the next version loads beside "
                             f"them while an evicted one finishes its requests), got {self.lora_resident_versions}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"--prefix-cache-tokens must be >= 0, got {self.prefix_cache_tokens}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port out of range: {self.port}")
        self.guard()  # bad keys or limit: ValueError naming the flag

    def guard(self):
        """The keys (flags, else the environment) and request limit the server enforces."""
        from miles_disagg.net.asgi_guard import ServerGuard
        from miles_disagg.net.auth import ApiKeys

        return ServerGuard(ApiKeys.resolve(self.api_key, self.admin_api_key), self.max_request_bytes)

    def roots(self):
        from miles_disagg.engines.roots import WeightRoots

        return WeightRoots.of(self.model_path, self.weight_store_dirs, self.local_checkpoint_dir)
