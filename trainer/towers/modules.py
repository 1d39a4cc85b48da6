"""Tower modules (DMT's TM): what a tower does to its features' pooled embeddings before they
leave the host.

A tower of n features gets ``x`` [B, n, N] (N: the embedding dimension) and emits k vectors of
N, ``[B, k, N]``, which join the model's global dot interaction. The compression ratio is
``n·N / (k·N) = n / k``: the bytes that cross hosts per sample shrink by exactly that.

* :class:`PassThrough`: k = n, the pooled embeddings as they are (SPTT alone: the model is the
  flat DLRM).
* :class:`DLRMTower`: ``cat(Linear(n·N -> p·N)(flatten x), Linear(n -> c) over the feature
  axis)``, p + c = k: a projection of all the tower's numbers, and c mixtures of its features.
* :class:`DCNTower`: a small CrossNet (DCN-v2, ``x_{l+1} = x_0 ⊙ (W x_l + b) + x_l``) over the
  tower's n·N numbers, then ``Linear(n·N -> k·N)``.

Their linear layers are :class:`ScaledLinear` (weights of unit variance times
``1 / sqrt(fan_in)``, zero biases): the outputs start at the scale of the pooled embeddings they
replace, and an optimizer step of ``lr`` on a stored weight moves the layer's effective weight by
``lr / sqrt(fan_in)`` (see the class for why that matters).

Every module reports its multiply-adds per sample (:meth:`TowerModule.flops`, 2 FLOPs each).
Nothing here imports training code.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.modules import table_seed
from trainer.towers.config import TowerModuleConfig

__all__ = [
    "CrossNet",
    "DCNTower",
    "DLRMTower",
    "PassThrough",
    "ScaledLinear",
    "TowerModule",
    "build_tower",
]


class TowerModule(nn.Module):
    """A tower's module: ``[B, n, N]`` in, ``[B, k, N]`` out.

    Args:
        features: n, the tower's features.
        dim: N, the embedding dimension.
        vectors: k, vectors out.
    """

    def __init__(self, features: int, dim: int, vectors: int) -> None:
        super().__init__()
        self.features, self.dim, self.vectors = features, dim, vectors

    @property
    def compression(self) -> float:
        """Numbers in over numbers out, n / k."""
        return self.features / self.vectors

    def flops(self) -> int:
        """FLOPs per sample of the forward pass (2 per multiply-add)."""
        return 0

    def extra_repr(self) -> str:
        return f"features={self.features}, dim={self.dim}, vectors={self.vectors}"


class PassThrough(TowerModule):
    """The tower's pooled embeddings, unchanged (k = n)."""

    def __init__(self, features: int, dim: int) -> None:
        super().__init__(features, dim, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x  # (B, n, N)


def _linear_flops(layer: nn.Linear) -> int:
    return 2 * layer.in_features * layer.out_features


class ScaledLinear(nn.Linear):
    """``nn.Linear`` with the equalised-learning-rate parametrisation (Karras et al., 2018):
    ``y = (x Vᵀ + b) / sqrt(fan_in)`` with V uniform in ``±sqrt(3)`` (unit variance) and b = 0.

    The layer computes what an ``nn.Linear`` of weights ``V / sqrt(fan_in)`` computes, so its
    outputs start with the scale of its inputs (variance ``fan_in · var(x) / fan_in``) and with
    no input-independent offset: a tower module stands where the pooled embeddings stood, and
    its outputs enter the dot interaction as they would. What changes is the step: an
    optimizer that moves every stored number by about ``lr`` whatever its gradient (Adagrad's
    and Adam's first steps) moves the effective weights by ``lr / sqrt(fan_in)``, not ``lr``;
    SGD's step on the outputs becomes ``lr · mean(x²)`` instead of ``lr · sum(x²)``. With
    ``nn.Linear``'s own parametrisation an Adagrad step at the model's ``lr`` changed a tower
    module's outputs by ``lr · sum |x|`` over its ``n·N`` inputs, many times the embeddings'
    size, and training diverged in the first steps (the less compressed the tower, the more
    output vectors, the worse).

    >>> layer = ScaledLinear(4, 2)
    >>> bool(layer.bias.eq(0).all()), bool(layer.weight.abs().max() <= 3**0.5), layer.gain
    (True, True, 0.5)
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.gain = in_features**-0.5

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.uniform_(-(3.0**0.5), 3.0**0.5)
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


class DLRMTower(TowerModule):
    """``cat(Linear(n·N -> p·N), Linear(n -> c) over the features)``: k = p + c vectors, with
    p = k - k // 2 projections and c = k // 2 feature mixtures."""

    def __init__(self, features: int, dim: int, vectors: int) -> None:
        super().__init__(features, dim, vectors)
        self.p, self.c = vectors - vectors // 2, vectors // 2
        self.project = ScaledLinear(features * dim, self.p * dim)
        self.mix = ScaledLinear(features, self.c) if self.c else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        out = self.project(x.flatten(1)).view(rows, self.p, self.dim)  # (B, p, N)
        if self.mix is None:
            return out
        mixed = self.mix(x.transpose(1, 2)).transpose(1, 2)  # (B, N, n) -> (B, c, N)
        return torch.cat([out, mixed], dim=1)  # (B, k, N)

    def flops(self) -> int:
        mix = 0 if self.mix is None else _linear_flops(self.mix) * self.dim
        return _linear_flops(self.project) + mix


class CrossNet(nn.Module):
    """DCN-v2 cross layers on ``[B, W]``: ``x_{l+1} = x_0 ⊙ (W_l x_l + b_l) + x_l``.

    Args:
        width: W.
        layers: cross layers.
    """

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ScaledLinear(width, width) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x  # (B, W)
        return x

    def flops(self) -> int:
        """FLOPs per sample."""
        return sum(_linear_flops(layer) + 2 * layer.out_features for layer in self.layers)


class DCNTower(TowerModule):
    """A CrossNet over the tower's n·N numbers, then ``Linear(n·N -> k·N)``."""

    def __init__(self, features: int, dim: int, vectors: int, *, layers: int = 1) -> None:
        super().__init__(features, dim, vectors)
        self.cross = CrossNet(features * dim, layers)
        self.project = ScaledLinear(features * dim, vectors * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        crossed = self.cross(x.flatten(1))  # (B, n·N)
        return self.project(crossed).view(rows, self.vectors, self.dim)  # (B, k, N)

    def flops(self) -> int:
        return self.cross.flops() + _linear_flops(self.project)


def build_tower(
    config: TowerModuleConfig, *, features: int, dim: int, seed: int, tower: int
) -> TowerModule:
    """Tower ``tower``'s module for ``features`` features of dimension ``dim``.

    Parameters are initialised from ``(seed, tower)`` alone, so every rank holding the tower
    builds the same module.
    """
    vectors = config.vectors(features, tower=tower)
    if config.kind == "none":
        return PassThrough(features, dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(table_seed(seed, f"tower:{tower}"))
        if config.kind == "dlrm":
            return DLRMTower(features, dim, vectors)
        return DCNTower(features, dim, vectors, layers=config.cross_layers)
