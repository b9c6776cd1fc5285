"""Realistic weight deltas: bf16 weights derived from fp32 master weights under AdamW.

What a trainer publishes after one step is ``bf16(master_t)`` next to ``bf16(master_{t-1})``: an
element of the bf16 copy changes only when its fp32 master crosses a bf16 rounding boundary, so the
density (the fraction of elements that change) arises from the learning rate, the spread of Adam's
normalized update and each weight's magnitude, as in a real run - not from a chosen mask.

Model: :func:`miles_disagg.bench.delta_moe.moe_shapes` (GQA attention, norms, a router and per-expert
MLPs, embeddings and head; bf16 N(0, 0.02), norms near 1.0). Tensors that do not change:

* the token embeddings are frozen (a common RL setting; they get no gradient at all);
* experts that received no token in the published step have no gradient and AdamW skips them.

Optimizer: AdamW (beta1 0.9, beta2 0.999, eps 1e-8, weight decay 0.1) over ``steps`` steps; the
delta is the last one. Gradients per element are ``row_scale * (signal * s + noise_t)``: a persistent
direction ``s`` plus fresh noise every step, each row's scale log-normal (some rows' gradients are
orders of magnitude smaller than others', as across heads and features), so Adam's normalized update
``m_hat / (sqrt(v_hat) + eps)`` spreads over (0, 1] instead of the +-1 of a first step.

Everything is deterministic by ``seed`` (one generator per tensor, seeded by its position).
:func:`lr_for_density` finds the learning rate that gives a target density on a small model of the
same proportions (density is a per-element property, so it carries over to any size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from miles_disagg.bench.delta_moe import MOE_LAYERS, experts_hit, moe_shapes


@dataclass(frozen=True)
class AdamWRun:
    """The simulated run: optimizer, gradient statistics and which tensors get no gradient."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.1
    steps: int = 4  # the delta is the last of these
    signal: float = 0.5  # persistent share of the gradient (noise has unit scale)
    grad_scale: float = 1e-4
    row_scale_sigma: float = 1.5  # log-normal spread of per-row gradient scales
    num_experts: int = 16
    experts_per_token: int = 2
    tokens_per_step: int = 12  # few tokens: some experts get none
    freeze_embeddings: bool = True


@dataclass
class _Draws:
    """One tensor's random draws, independent of the learning rate (reused while calibrating)."""

    master: "object"  # torch.Tensor, fp32
    grads: list  # one torch.Tensor per step, or [] for a tensor without gradient


def _no_gradient(name: str, run: AdamWRun, hit: dict[int, set[int]]) -> bool:
    if run.freeze_embeddings and name == "model.embed_tokens.weight":
        return True
    parts = name.split(".")
    if "experts" not in parts:
        return False
    return int(parts[parts.index("experts") + 1]) not in hit[int(parts[2])]


def _draws(name: str, shape: tuple[int, ...], index: int, seed: int, run: AdamWRun, frozen: bool) -> _Draws:
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    master = torch.randn(shape, generator=gen) * 0.02
    if name.endswith("norm.weight"):
        master += 1.0
    if frozen:
        return _Draws(master, [])
    rows = shape[0] if len(shape) > 1 else 1
    row_scale = torch.exp(torch.randn((rows,) + (1,) * (len(shape) - 1), generator=gen) * run.row_scale_sigma)
    row_scale.mul_(run.grad_scale)
    direction = torch.randn(shape, generator=gen).mul_(run.signal)
    grads = [(torch.randn(shape, generator=gen).add_(direction)).mul_(row_scale) for _ in range(run.steps)]
    return _Draws(master, grads)


def _trajectory(draws: _Draws, lr: float, run: AdamWRun) -> tuple[np.ndarray, np.ndarray]:
    """(bf16 bytes before the last step, after it), from the fp32 master under AdamW."""
    import torch

    master = draws.master.clone()
    if not draws.grads:
        old = master.bfloat16().view(torch.uint8).reshape(-1).numpy()
        return old, old.copy()
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    old = None
    for t, grad in enumerate(draws.grads, start=1):
        if t == len(draws.grads):
            old = master.bfloat16().view(torch.uint8).reshape(-1).numpy()
        m.mul_(run.beta1).add_(grad, alpha=1 - run.beta1)
        v.mul_(run.beta2).addcmul_(grad, grad, value=1 - run.beta2)
        denom = (v / (1 - run.beta2 ** t)).sqrt_().add_(run.eps)
        master.mul_(1 - lr * run.weight_decay)  # decoupled weight decay, as torch.optim.AdamW
        master.addcdiv_(m, denom, value=-lr / (1 - run.beta1 ** t))
    new = master.bfloat16().view(torch.uint8).reshape(-1).numpy()
    assert old is not None
    return old, new


Shapes = list[tuple[str, tuple[int, ...]]]


def _tensors(size_mb: float, seed: int, run: AdamWRun,
             shapes: Shapes | None = None) -> Iterator[tuple[str, tuple[int, ...], int, bool]]:
    rng = np.random.default_rng(seed)
    shapes = shapes or moe_shapes(int(size_mb * 1024 * 1024), run.num_experts)
    layers = 1 + max((int(n.split(".")[2]) for n, _ in shapes if n.startswith("model.layers.")), default=MOE_LAYERS - 1)
    hit = {layer: experts_hit(run.num_experts, run.experts_per_token, run.tokens_per_step, rng)
           for layer in range(layers)} if run.num_experts else {}
    for index, (name, shape) in enumerate(shapes):
        yield name, shape, index, _no_gradient(name, run, hit)


def make_adamw_model(size_mb: float, lr: float, seed: int = 0, run: AdamWRun = AdamWRun(),
                     shapes: Shapes | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(old, new) bf16 byte arrays per tensor (uint8, flat): the last of ``run.steps`` AdamW steps.
    ``shapes``: the model's ``(name, shape)`` list (default: :func:`moe_shapes` of ``size_mb``)."""
    old, new = {}, {}
    for name, shape, index, frozen in _tensors(size_mb, seed, run, shapes):
        old[name], new[name] = _trajectory(_draws(name, shape, index, seed, run, frozen), lr, run)
    return old, new


def density(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> float:
    """Fraction of bf16 elements that differ between ``old`` and ``new``."""
    changed = sum(int(np.count_nonzero(old[n].view("<u2") != new[n].view("<u2"))) for n in new)
    return changed / max(1, sum(a.nbytes // 2 for a in new.values()))


CALIBRATION_MB = 4.0


def lr_for_density(target: float, seed: int = 0, run: AdamWRun = AdamWRun(), size_mb: float = CALIBRATION_MB,
                   tolerance: float = 0.03) -> float:
    """The learning rate whose last step changes about ``target`` of the elements (bisection in log lr).

    Calibrated on a ``size_mb`` model of the same proportions and seed; the result is reproducible.
    """
    if not 0 < target < 1:
        raise ValueError(f"target density must be in (0, 1), got {target}")
    draws = [_draws(name, shape, index, seed, run, frozen) for name, shape, index, frozen in _tensors(size_mb, seed, run)]

    def measured(lr: float) -> float:
        changed = total = 0
        for d in draws:
            old, new = _trajectory(d, lr, run)
            changed += int(np.count_nonzero(old.view("<u2") != new.view("<u2")))
            total += old.size // 2
        return changed / total

    lo, hi = math.log(1e-10), math.log(1e-2)
    for _ in range(40):
        mid = (lo + hi) / 2
        got = measured(math.exp(mid))
        if abs(got - target) <= tolerance * target:
            return math.exp(mid)
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return math.exp((lo + hi) / 2)
