"""Tower plans (which sparse features form which tower) and tower-module configs; no torch.

A *tower plan* is what ``recpipe towers partition`` writes and ``recpipe towers train`` reads,
a TOML file::

    # towers for `recpipe towers train --towers FILE`
    [partition]
    strategy = "coherent"        # how the towers were found: coherent, diverse, strided, given
    balance = 1.5                # the bound K: largest tower <= K x smallest
    seed = 0
    source = "200 training steps on data/dataset"

    [[tower]]
    features = ["planted_0_0", "planted_0_1", "item_id"]

    [[tower]]
    features = ["planted_1_0", "planted_1_1", "user_segment"]

Every sparse feature of the model must be in exactly one tower. In a multi-rank job tower ``t``
lives on host ``t`` (see ``docs/towers.md``).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from recpipe.errors import RecpipeError
from trainer.config import ModelConfig

__all__ = [
    "STRATEGIES",
    "TOWER_KINDS",
    "PartitionConfig",
    "Strategy",
    "TowerError",
    "TowerKind",
    "TowerModuleConfig",
    "TowerPlan",
    "TowersConfig",
    "load_plan",
    "plan_from_assignment",
]

Strategy = Literal["coherent", "diverse"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)

TowerKind = Literal["none", "dlrm", "dcn"]
TOWER_KINDS: tuple[str, ...] = get_args(TowerKind)


class TowerError(RecpipeError):
    """A tower plan or tower config that cannot be used (named in the message)."""


def _toml_str(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


@dataclass(frozen=True)
class TowerPlan:
    """Sparse features grouped into towers.

    Attributes:
        towers: the features of each tower, in order (disjoint, none empty).
        strategy: how the towers were found (``coherent``, ``diverse``, ``strided``, ``given``).
        balance: the bound K the partitioner kept (largest tower <= K x smallest), if any.
        seed: the partitioner's seed, if any.
        source: where the feature affinities came from (free text).
    """

    towers: tuple[tuple[str, ...], ...]
    strategy: str = "given"
    balance: float | None = None
    seed: int | None = None
    source: str = ""
    where: str = field(default="tower plan", compare=False, repr=False)

    def __post_init__(self) -> None:
        towers = tuple(tuple(t) for t in self.towers)
        object.__setattr__(self, "towers", towers)
        if not towers:
            msg = f"{self.where}: `towers` must hold at least one tower, got none"
            raise TowerError(msg)
        seen: dict[str, list[int]] = {}
        for t, features in enumerate(towers):
            if not features:
                msg = f"{self.where}: tower {t} has no feature"
                raise TowerError(msg)
            for name in features:
                if not isinstance(name, str) or not name:
                    msg = f"{self.where}: tower {t}: feature names must be strings, got {name!r}"
                    raise TowerError(msg)
                seen.setdefault(name, []).append(t)
        twice = [
            f"feature {name!r} is in towers {', '.join(map(str, ts[:-1]))} and {ts[-1]}"
            for name, ts in seen.items()
            if len(ts) > 1
        ]
        if twice:
            msg = f"{self.where}: " + "; ".join(twice) + " (each feature belongs to one tower)"
            raise TowerError(msg)

    @property
    def num_towers(self) -> int:
        """Towers T."""
        return len(self.towers)

    @property
    def features(self) -> tuple[str, ...]:
        """Every feature, tower by tower."""
        return tuple(f for t in self.towers for f in t)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Features per tower."""
        return tuple(len(t) for t in self.towers)

    def tower_of(self, feature: str) -> int:
        """The tower holding ``feature``."""
        for t, features in enumerate(self.towers):
            if feature in features:
                return t
        msg = f"{self.where}: feature {feature!r} is in no tower"
        raise TowerError(msg)

    def check_features(
        self, features: Iterable[str], *, owner: str = "the model", hint: str | None = None
    ) -> None:
        """Raise unless the towers hold exactly ``features`` (the sparse features of
        ``owner``, named in the message with ``hint``), each once."""
        want = list(features)
        have, wanted = set(self.features), set(want)
        missing = [f for f in want if f not in have]
        extra = [f for f in self.features if f not in wanted]
        if missing or extra:
            parts = []
            if missing:
                parts.append(
                    f"{len(missing)} of the {len(want)} sparse features of {owner} are in no "
                    f"tower: {missing!r}"
                )
            if extra:
                parts.append(f"the towers name {extra!r}, not sparse features of {owner}")
            msg = f"{self.where}: " + "; ".join(parts)
            if hint:
                msg += f"\nhint: {hint}"
            raise TowerError(msg)

    @classmethod
    def strided(cls, features: Sequence[str], towers: int) -> TowerPlan:
        """Feature ``i`` in tower ``i mod towers`` (the baseline a learned plan is compared to).

        >>> TowerPlan.strided(["a", "b", "c", "d", "e"], 2).towers
        (('a', 'c', 'e'), ('b', 'd'))
        """
        _check_count(len(features), towers)
        return cls(tuple(tuple(features[t::towers]) for t in range(towers)), strategy="strided")

    def to_toml(self) -> str:
        """TOML text that :meth:`from_toml` reads back to an equal plan."""
        lines = [
            "# towers for `recpipe towers train --towers FILE` (docs/towers.md)",
            "[partition]",
        ]
        lines.append(f"strategy = {_toml_str(self.strategy)}")
        if self.balance is not None:
            lines.append(f"balance = {float(self.balance)!r}")
        if self.seed is not None:
            lines.append(f"seed = {int(self.seed)}")
        if self.source:
            lines.append(f"source = {_toml_str(self.source)}")
        for features in self.towers:
            names = ", ".join(_toml_str(f) for f in features)
            lines += ["", "[[tower]]", f"features = [{names}]"]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str, *, source: str = "<string>") -> TowerPlan:
        """Parse :meth:`to_toml`'s format; errors name ``source``."""
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            msg = f"{source}: not valid TOML: {exc}"
            raise TowerError(msg) from exc
        unknown = sorted(set(doc) - {"partition", "tower"})
        if unknown:
            msg = f"{source}: unknown table(s) {unknown!r}; a tower plan has [partition] and [[tower]]"
            raise TowerError(msg)
        meta = doc.get("partition", {})
        if not isinstance(meta, Mapping):
            msg = f"{source}: [partition] must be a table"
            raise TowerError(msg)
        bad = sorted(set(meta) - {"strategy", "balance", "seed", "source"})
        if bad:
            msg = f"{source}: [partition]: unknown key(s) {bad!r}"
            raise TowerError(msg)
        towers = doc.get("tower", [])
        if not isinstance(towers, list) or not all(isinstance(t, Mapping) for t in towers):
            msg = f"{source}: `tower` must be an array of tables ([[tower]])"
            raise TowerError(msg)
        parsed = []
        for t, table in enumerate(towers):
            features = table.get("features")
            if set(table) != {"features"} or not isinstance(features, list):
                msg = f"{source}: [[tower]] {t} must hold exactly `features = [...]`, got {dict(table)!r}"
                raise TowerError(msg)
            parsed.append(tuple(features))
        return cls(
            tuple(parsed),
            strategy=str(meta.get("strategy", "given")),
            balance=meta.get("balance"),
            seed=meta.get("seed"),
            source=str(meta.get("source", "")),
            where=source,
        )

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_toml` to ``path``."""
        path = Path(path)
        path.write_text(self.to_toml())
        return path


def load_plan(path: str | Path) -> TowerPlan:
    """Read a tower plan file (see the module docstring).

    Raises:
        RecpipeError: the file is missing, not TOML, or not a valid plan (named in the message).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        msg = f"`towers` file {str(path)!r} cannot be read: {exc.strerror or exc}"
        raise TowerError(msg) from exc
    return TowerPlan.from_toml(text, source=str(path))


def _check_count(features: int, towers: int) -> None:
    if isinstance(towers, bool) or not isinstance(towers, int) or towers < 1:
        msg = f"`towers` must be a positive integer, got {towers!r}"
        raise TowerError(msg)
    if features < towers:
        msg = f"`towers` must be at most the number of features ({features}), got {towers}"
        raise TowerError(msg)


@dataclass(frozen=True)
class TowerModuleConfig:
    """What each tower does to its pooled embeddings before they leave the host.

    Attributes:
        kind: ``none`` (pass-through: the towers only move the pooled embeddings, and the model
            is the flat DLRM), ``dlrm`` (``cat(Linear(n·N -> p·N), Linear over the features
            n -> c)``: p + c vectors of N) or ``dcn`` (a CrossNet over the tower's n·N inputs,
            then ``Linear(n·N -> k·N)``).
        compression: the tower's input numbers over its output numbers, ``n·N / (k·N)``: every
            tower of n features emits k = n / compression vectors of the embedding dimension N
            (so compression must divide every tower's size). Ignored with ``none``.
        cross_layers: CrossNet layers of the ``dcn`` form.
    """

    kind: TowerKind = "none"
    compression: int = 1
    cross_layers: int = 1

    def __post_init__(self) -> None:
        if self.kind not in TOWER_KINDS:
            msg = f"`kind` must be one of {list(TOWER_KINDS)}, got {self.kind!r}"
            raise TowerError(msg)
        for name in ("compression", "cross_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"`{name}` must be a positive integer, got {value!r}"
                raise TowerError(msg)
        if self.kind == "none" and self.compression != 1:
            msg = f"`compression` {self.compression!r} needs a tower module (`kind` dlrm or dcn)"
            raise TowerError(msg)

    def vectors(self, features: int, *, tower: int = 0) -> int:
        """Vectors k a tower of ``features`` features emits.

        >>> TowerModuleConfig("dlrm", compression=4).vectors(8)
        2
        """
        if self.kind == "none":
            return features
        if features % self.compression:
            msg = (
                f"tower {tower} has {features} features: `compression` {self.compression} must "
                f"divide every tower's size (each tower emits size / compression vectors)"
            )
            raise TowerError(msg)
        return features // self.compression

    def ratio(self, sizes: Sequence[int]) -> float:
        """Compression of the whole model: features in / vectors out over all towers."""
        out = sum(self.vectors(n, tower=t) for t, n in enumerate(sizes))
        return sum(sizes) / out if out else math.inf


def plan_from_assignment(
    features: Sequence[str], assignment: Sequence[int], **meta: Any
) -> TowerPlan:
    """The plan putting ``features[i]`` in tower ``assignment[i]`` (features keep their order
    inside a tower).

    >>> plan_from_assignment(["a", "b", "c"], [1, 0, 1]).towers
    (('b',), ('a', 'c'))
    """
    towers = max(assignment) + 1 if len(assignment) else 0
    groups: list[list[str]] = [[] for _ in range(towers)]
    for name, t in zip(features, assignment, strict=True):
        groups[int(t)].append(name)
    return TowerPlan(tuple(tuple(g) for g in groups), **meta)


def _positive_int(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            msg = f"`{name}` must be a positive integer, got {value!r}"
            raise TowerError(msg)


@dataclass
class PartitionConfig:
    """What ``recpipe towers partition`` does.

    Attributes:
        dataset: clustered dataset directory; the affinities come from a model trained on its
            training part (the row groups ``recpipe train`` trains on).
        towers: towers T (an SPTT job puts one on each host).
        strategy: ``coherent`` (features whose embeddings align share a tower) or ``diverse``
            (they are spread over the towers).
        balance: K: the largest tower holds at most K times the features of the smallest.
        seed: seed of the short training run, the MDS start and the k-means starts.
        out: the tower plan to write (TOML, read by ``recpipe towers train --towers``).
        plot: also draw the 2-D MDS embedding, coloured by tower, into this PNG.
        checkpoint: take the embeddings from this ``recpipe train --checkpoint DIR`` run
            instead of a short training run.
        steps: steps of the short training run.
        batch_size: rows per batch of the short run and of the affinity batches.
        affinity_batches: training batches the mean of R Rᵀ is taken over.
        center: subtract each feature's mean embedding first (the covariance of the pooled
            embeddings instead of their raw second moment): the raw mean of R Rᵀ also holds the
            products of the features' mean embeddings, which can hide the structure.
        features: partition only these sparse features (default: all of the schema's).
        dims: dimensions of the MDS embedding (the plot shows the first two).
        eval_fraction: share of row groups held out (not trained on, not used for affinities).
        lr: learning rate of the short run (default: adagrad's).
        model: the short run's model (pooled features only: its ``attention`` is ignored).
    """

    dataset: str
    towers: int
    strategy: Strategy = "coherent"
    balance: float = 1.5
    seed: int = 0
    out: str = "towers.toml"
    plot: str | None = None
    checkpoint: str | None = None
    steps: int = 300
    batch_size: int = 256
    affinity_batches: int = 16
    center: bool = False
    features: tuple[str, ...] | None = None
    dims: int = 2
    eval_fraction: float = 0.1
    lr: float | None = None
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        _positive_int(self, "towers", "steps", "batch_size", "affinity_batches", "dims")
        if self.strategy not in STRATEGIES:
            msg = f"`strategy` must be one of {list(STRATEGIES)}, got {self.strategy!r}"
            raise TowerError(msg)
        if not (math.isfinite(self.balance) and self.balance >= 1):
            msg = f"`balance` must be a number >= 1, got {self.balance!r}"
            raise TowerError(msg)
        if self.features is not None:
            self.features = tuple(self.features)
        if not 0.0 <= self.eval_fraction < 1.0:
            msg = f"`eval_fraction` must be in [0, 1), got {self.eval_fraction!r}"
            raise TowerError(msg)


@dataclass
class TowersConfig:
    """How ``recpipe towers train`` arranges the model and the job.

    Attributes:
        towers: the tower plan (``recpipe towers partition --out FILE``).
        tower_module: ``none`` (pass-through: SPTT only moves the pooled embeddings, the model
            is the flat DLRM), ``dlrm`` or ``dcn`` (see ``docs/towers.md``).
        compression: each tower's input numbers over its output numbers (must divide every
            tower's size); the bytes crossing hosts shrink by exactly this.
        cross_layers: CrossNet layers of the ``dcn`` tower module.
        ranks_per_host: ranks per host L of a multi-rank job (default: the processes torchrun
            starts on one machine); on one machine a smaller L makes "hosts" of local ranks.
            The job needs hosts = towers.
        schedule: ``sptt``, or ``flat`` (pass-through only: the flat table-wise all-to-all of
            pooled embeddings, the baseline).
        features: the model's sparse features, which the plan must hold exactly (default:
            every sparse feature of the dataset, so a plan must hold each of them once).
    """

    towers: str
    tower_module: TowerKind = "none"
    compression: int = 1
    cross_layers: int = 1
    ranks_per_host: int | None = None
    schedule: Literal["sptt", "flat"] = "sptt"
    features: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _positive_int(self, "ranks_per_host")
        self.module_config()  # checks kind, compression, cross_layers
        if self.schedule not in ("sptt", "flat"):
            msg = f"`schedule` must be 'sptt' or 'flat', got {self.schedule!r}"
            raise TowerError(msg)
        if self.schedule == "flat" and self.tower_module != "none":
            msg = f"`schedule` 'flat' moves pooled embeddings: it needs `tower_module` 'none', got {self.tower_module!r}"
            raise TowerError(msg)
        if self.features is not None:
            self.features = tuple(self.features)

    def module_config(self) -> TowerModuleConfig:
        """The tower modules' config."""
        return TowerModuleConfig(self.tower_module, self.compression, self.cross_layers)
