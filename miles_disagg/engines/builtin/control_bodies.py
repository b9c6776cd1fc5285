"""Request bodies of the built-in engine's control endpoints (weights, pause, abort, memory, LoRA).

Field names and defaults follow SGLang's ``io_struct.py`` (``UpdateWeightFromDiskReqInput``,
``PauseGenerationReqInput``, ``AbortReq``, ``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``DestroyWeightsUpdateGroupReqInput``,
``UpdateWeightVersionReqInput``, ``ReleaseMemoryOccupationReqInput``,
``ResumeMemoryOccupationReqInput``, ``UpdateWeightsFromTensorReqInput``, ``LoadLoRAAdapterReqInput``,
``UnLoadLoRAAdapterReqInput``) plus this project's ``PullWeights``; validation as in ``bodies.py``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BeforeValidator, Field, model_validator

from miles_disagg.engines.builtin.bodies import Body, NonEmptyStr, PathStr, Strings, VersionString, as_tuple

DEFAULT_GROUP = "weight_update_group"
PauseMode = Literal["abort", "retract", "in_place"]
MAX_LORA_NAME_CHARS = 256


class UpdateFromDisk(Body):
    """``UpdateWeightFromDiskReqInput`` (fields this engine acts on)."""

    model_path: PathStr
    weight_version: VersionString | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class PauseGeneration(Body):
    """``PauseGenerationReqInput``."""

    mode: PauseMode = "abort"


class UpdateWeightVersion(Body):
    """``UpdateWeightVersionReqInput``."""

    new_version: VersionString
    abort_all_requests: bool = True


class AbortReq(Body):
    """``AbortReq``: one request by ``rid``, or all of them."""

    rid: str = ""
    abort_all: bool = False


class DestroyGroup(Body):
    """``DestroyWeightsUpdateGroupReqInput``."""

    group_name: str = DEFAULT_GROUP


class InitGroup(Body):
    """``InitWeightsUpdateGroupReqInput`` (this engine joins at ``rank_offset``; rank 0 is the trainer)."""

    master_address: NonEmptyStr
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(gt=0)
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"

    @model_validator(mode="after")
    def _rank_in_world(self) -> Self:
        if not self.rank_offset < self.world_size:
            raise ValueError(f"need 0 < rank_offset < world_size, got rank_offset {self.rank_offset}, "
                             f"world_size {self.world_size}")
        return self


class DistributedUpdate(Body):
    """``UpdateWeightsFromDistributedReqInput``: names/dtypes/shapes broadcast from rank 0."""

    names: Strings
    dtypes: Strings
    shapes: Annotated[tuple[Annotated[tuple[Annotated[int, Field(ge=0)], ...], BeforeValidator(as_tuple)], ...],
                      BeforeValidator(as_tuple)]
    group_name: str = DEFAULT_GROUP
    weight_version: VersionString | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True

    @model_validator(mode="after")
    def _same_lengths(self) -> Self:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


class MemoryOccupation(Body):
    """``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``: ``tags`` null = all."""

    tags: Strings | None = None


class UpdateFromTensor(Body):
    """``UpdateWeightsFromTensorReqInput``: one serialized entry per TP rank (this engine has one)."""

    serialized_named_tensors: Annotated[tuple[NonEmptyStr, ...], BeforeValidator(as_tuple), Field(min_length=1)]
    load_format: Literal["direct"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: VersionString | None = None


class LoadLoraAdapter(Body):
    """SGLang's ``LoadLoRAAdapterReqInput``."""

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=4096)
    pinned: bool = False


class UnloadLoraAdapter(Body):
    """SGLang's ``UnLoadLoRAAdapterReqInput``."""

    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)


class PullWeights(Body):
    """This project's ``/pull_weights``: materialize and stage a published version."""

    target_version: Annotated[int, Field(ge=0)]  # an int: "3" is refused like every other wrong type
    source_dir: PathStr
    local_checkpoint_dir: PathStr | None = None  # None: the server's own (--local-checkpoint-dir)
