"""The form a run's versions take: what its engines serve, derived from the base checkpoint.

A run whose ``--hf-checkpoint`` is an unquantized checkpoint publishes the trainer's tensors as they
are. A run whose base is a blockwise-FP8 checkpoint (``config.json`` ``quantization_config``,
``float8_e4m3fn`` weights each with a ``weight_scale_inv``) publishes every version in that form: the
trainer keeps full precision, and each weight the base stores as FP8 is quantized with the rule
:func:`miles_disagg.models.fp8.quantize` (the converter's), so the bytes an engine applies equal
``miles-disagg convert-fp8`` of the trainer's weights. Deltas are then computed on the FP8 bytes and
the scales.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Collection, Iterable, Iterator, Mapping

from miles_disagg.models.fp8 import BlockFp8, quantize, scale_name, scheme_of, weight_name_of_scale
from miles_disagg.types import FormatError

FP8_DTYPE_CODE = "F8_E4M3"


class ServedForm:
    """Turns the trainer's ``(name, tensor)`` pairs into the served ones (identity when unquantized)."""

    def __init__(self, scheme: BlockFp8 | None = None, fp8_weights: Collection[str] = ()):
        self.scheme = scheme
        self.fp8_weights = frozenset(fp8_weights)

    @classmethod
    def of_checkpoint(cls, base_dir: str | Path, dtypes: Mapping[str, str]) -> "ServedForm":
        """The form of the checkpoint at ``base_dir`` (``dtypes``: its tensors' safetensors dtype codes).
        ``FormatError`` for an FP8 checkpoint whose weights and scales do not pair up."""
        config_path = Path(base_dir) / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        scheme = scheme_of(config, source=str(config_path))
        if scheme is None:
            return cls()
        fp8 = {name for name, code in dtypes.items() if code == FP8_DTYPE_CODE}
        unscaled = sorted(name for name in fp8 if scale_name(name) not in dtypes)
        orphans = sorted(name for name in dtypes if weight_name_of_scale(name) not in (None, *fp8))
        if unscaled or orphans:
            raise FormatError(f"FP8 checkpoint {base_dir}: weights without a scale {unscaled[:3]}, "
                              f"scales without an FP8 weight {orphans[:3]}")
        return cls(scheme, fp8)

    @property
    def quantized(self) -> bool:
        return self.scheme is not None

    def describe(self) -> str:
        if self.scheme is None:
            return "unquantized"
        return f"blockwise FP8 e4m3 {self.scheme.block[0]}x{self.scheme.block[1]} ({len(self.fp8_weights)} weights)"

    def share_with_scales(self, share: Iterable[str]) -> frozenset[str]:
        """A publishing rank's share with every FP8 weight's scale beside it (and no scale alone):
        a weight and its scale are quantized together, so one rank owns both."""
        names = {name for name in share if weight_name_of_scale(name) is None or not self.quantized}
        return frozenset(names | {scale_name(name) for name in names if name in self.fp8_weights})

    def served_tensors(self, named: Iterable[tuple[str, Any]], owned: Collection[str]) -> Iterator[tuple[str, Any]]:
        """The served pairs of the trainer's: each FP8 weight this rank owns becomes its FP8 weight and
        its scale (one of another rank's share is skipped unquantized); everything else as given."""
        for name, tensor in named:
            if name not in self.fp8_weights:
                yield name, tensor
            elif name in owned:
                q, scale = quantize(tensor, self.scheme.block)
                yield name, q
                yield scale_name(name), scale
