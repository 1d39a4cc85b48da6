"""Deterministic synthetic session logs (``recpipe synth``), shaped after RecD's characterization.

The generator writes the two raw-log streams (their contract: docs/data-contract.md) as
``.jsonl.zst``::

    out_dir/features/part-NNNNN.jsonl.zst   one line per inference request
    out_dir/events/part-NNNNN.jsonl.zst     zero or more label events per request
    out_dir/_synth.json                     config, counts, injected bad records, hidden-model AUC

It follows ``schemas/examples/synth.toml``. Sessions are generated in *blocks* of
``concurrent_sessions`` sessions that share a 20-minute window of time, so sessions interleave
as in production: a time-ordered batch of 4096 requests holds about 1.1 samples per session.
Session lengths are log-normal (mean ``mean_session_len``, long tail). Within a session:

- static user features (``user_age``, ``user_segment``, ``user_follows``, ...) never change;
- ``user_liked_items``/``user_liked_sellers`` shift together by one id with probability
  ``like_shift_prob`` per sample (a new id appended, the oldest dropped at ``max_len``), and
  ``user_recent_queries`` shifts on its own with ``query_shift_prob``;
- ``user_recent_items`` shifts on *every* request: the item of the session's previous request
  is appended and the oldest id dropped at ``max_len`` (the session's first request shows a
  history drawn for the session). It is never an exact duplicate of its predecessor, only a
  partial one: the case of a partial IKJT (RecD §7), not of an IKJT;
- item features change on every row, context features per row or per session.

Labels come from a hidden logistic model of the features (segment x category affinity, whether
the item's seller is among the user's liked sellers, item CTR, surface). Its own AUC on the
generated requests, the best any model can reach, is written to ``_synth.json``.

With ``planted_groups`` > 0 (off by default; ``recpipe synth --planted-groups G``) the logs also
carry G groups of ``planted_features`` one-id features ``planted_<g>_<j>`` with a known
interaction structure, for feature partitioners to find (``recpipe towers partition``): per
request each group draws a latent value; each feature of the group shows it (or, with
probability ``planted_noise``, a random value) as its id; and the label's logit gains
``planted_strength * sum over group pairs g < h of <U_g[z_g], U_h[z_h]> / sqrt(k)`` with zero-mean
k-dimensional codes U. Features of one group are interchangeable noisy views of one latent, so a
model learns aligned embeddings for them; groups are independent. The planted features are
appended to the schema, written to ``_schema.toml`` for ``recpipe etl build --schema``.

Memory is bounded by one block (~260k requests by default), so tens of millions of requests
stream through; every random draw comes from ``(seed, block)``-keyed generators or counter-based
hashes, so the same seed gives byte-identical files.

One concept, over 600 lines: the generator (its config, and the sessions, blocks and lines it
writes); the command is :mod:`etl.synth_cli`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import zstandard

from recpipe.errors import RecpipeError
from recpipe.kernels.splitmix import splitmix64
from schemas import DatasetSchema, SparseFeature, default_schema

__all__ = [
    "BAD_EVENT_KINDS",
    "BAD_KINDS",
    "SynthConfig",
    "SynthResult",
    "generate",
    "planted_groups",
    "planted_schema",
]

#: Kinds of bad feature records injected; the strings are the build's quarantine reasons.
BAD_KINDS: tuple[str, ...] = (
    "malformed_json",
    "missing_request_id",
    "missing_ts",
    "wrong_type",
    "non_finite",
    "id_out_of_range",
    "list_too_long",
    "duplicate_request_id",
)
#: Kinds of bad event records injected (additional event lines).
BAD_EVENT_KINDS: tuple[str, ...] = ("malformed_json", "wrong_type")

_START_TS = 1_700_000_000_000  # 2023-11-14T22:13:20Z, epoch ms
_BLOCK_MS = 20 * 60 * 1000  # every session of a block lies inside its 20 minutes
_USER_PARTITIONS = 3  # a user recurs at most every 3 blocks: > 30 min between its sessions
_MAX_SESSION_LEN = 5000
_CHUNK_ROWS = 32_768  # rows formatted and compressed at a time

# Vocabularies and list lengths of the synthetic features (must agree with synth.toml).
_N_SEGMENTS, _N_COUNTRIES, _N_DEVICES, _N_SURFACES = 64, 40, 8, 6
_N_ITEMS, _N_SELLERS, _N_CATEGORIES, _N_TAGS = 2_000_000, 50_000, 200, 5_000
_N_FOLLOWS, _N_QUERIES = 1_000_000, 500_000
_RECENT_LEN = 20  # user_recent_items' max_len
# The planted interaction groups (off by default): latent values per group, code dimensions.
_PLANTED_VALUES, _PLANTED_DIMS = 16, 4

_DENSE = ("user_age", "user_tenure_days", "item_price", "item_ctr", "context_hour")
_SPARSE = (
    "user_segment",
    "user_country",
    "user_follows",
    "user_liked_items",
    "user_liked_sellers",
    "user_recent_queries",
    "user_recent_items",
    "item_id",
    "item_seller",
    "item_category",
    "item_tags",
    "context_device",
    "context_surface",
)
# One line = _TEMPLATE % (request id, session part 1, ts, session part 2, item price, item ctr,
# hour, session part 3, liked lists, queries, recent items, item id, seller, category, tags,
# session part 4, surface); the session parts are formatted once per session.
_TEMPLATE = (
    b'{"request_id":"r-%d",%s"ts":%d,"dense":{%s"item_price":%.2f,"item_ctr":%.4f,'
    b'"context_hour":%.1f},"sparse":{%s%s"user_recent_queries":%s,"user_recent_items":%s,'
    b'"item_id":[%d],"item_seller":[%d],"item_category":[%d],"item_tags":%s,%s'
    b'"context_surface":[%d]}}'
)
_SESSION_PARTS = (
    b'"user_id":%d,',
    b'"user_age":%.1f,"user_tenure_days":%.1f,',
    b'"user_segment":[%d],"user_country":[%d],"user_follows":%s,',
    b'"context_device":[%d],',
)


def _mix(x: np.ndarray) -> np.ndarray:
    """One splitmix64 step from each state of ``x`` (uint64 out, wrapping arithmetic)."""
    return splitmix64(x)


def _hash(x: np.ndarray, salt: int) -> np.ndarray:
    return _mix(np.asarray(x, dtype=np.uint64) ^ _mix(np.array([salt], dtype=np.uint64)))


def _unit(x: np.ndarray, salt: int) -> np.ndarray:
    """Deterministic uniform [0, 1) per element of ``x``."""
    return (_hash(x, salt) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass
class SynthConfig:
    """What to generate.

    Args:
        num_requests: feature-log lines to write, bad ones included.
        seed: same seed, same bytes.
        mean_session_len: mean samples per session (log-normal lengths).
        session_len_sigma: log-normal sigma of session lengths (the tail).
        bad_fraction: fraction of feature lines replaced by bad records, spread evenly over
            :data:`BAD_KINDS`; the same fraction of extra bad event lines is added.
        with_session_id: write ``session_id``; without it sessions are recoverable from
            ``user_id`` and a 30-minute inactivity gap.
        files: number of files per stream (requests are spread over them like hosts).
        concurrent_sessions: sessions sharing one 20-minute block of time.
        like_shift_prob: per-sample probability that the liked lists shift by one id.
        query_shift_prob: per-sample probability that ``user_recent_queries`` shifts.
        zstd_level: compression level of the output files.
        planted_groups: groups of planted one-id features with a known interaction structure
            (0: none, the default; see the module docstring).
        planted_features: features per planted group.
        planted_noise: probability that a planted feature shows a random latent value
            instead of its group's.
        planted_strength: weight of the planted interactions in the label's logit.
    """

    num_requests: int = 200_000
    seed: int = 0
    mean_session_len: float = 16.5
    session_len_sigma: float = 0.9
    bad_fraction: float = 0.0
    with_session_id: bool = True
    files: int = 4
    concurrent_sessions: int = 16_000
    like_shift_prob: float = 0.25
    query_shift_prob: float = 0.3
    zstd_level: int = 1
    planted_groups: int = 0
    planted_features: int = 4
    planted_noise: float = 0.3
    planted_strength: float = 0.5

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> RecpipeError:
            return RecpipeError(f"`{name}` must be {rule}, got {getattr(self, name)!r}")

        for name in (
            "num_requests",
            "files",
            "concurrent_sessions",
            "seed",
            "planted_groups",
            "planted_features",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "an integer")
        if self.num_requests < 1:
            raise bad("num_requests", ">= 1")
        if self.seed < 0:
            raise bad("seed", ">= 0")
        if not 1 <= self.files <= 10_000:
            raise bad("files", "in [1, 10000]")
        if self.concurrent_sessions < 1:
            raise bad("concurrent_sessions", ">= 1")
        if not (math.isfinite(self.mean_session_len) and 1.5 <= self.mean_session_len <= 1000):
            raise bad("mean_session_len", "in [1.5, 1000]")
        if not (math.isfinite(self.session_len_sigma) and 0 <= self.session_len_sigma <= 3):
            raise bad("session_len_sigma", "in [0, 3]")
        for name in ("bad_fraction", "like_shift_prob", "query_shift_prob"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
                raise bad(name, "in [0, 1]")
        if self.bad_fraction > 0.5:
            raise bad("bad_fraction", "<= 0.5")
        if not 1 <= self.zstd_level <= 22:
            raise bad("zstd_level", "in [1, 22]")
        if not 0 <= self.planted_groups <= 64:
            raise bad("planted_groups", "in [0, 64]")
        if not 1 <= self.planted_features <= 256:
            raise bad("planted_features", "in [1, 256]")
        if not (isinstance(self.planted_noise, int | float) and 0.0 <= self.planted_noise <= 1.0):
            raise bad("planted_noise", "in [0, 1]")
        strength = self.planted_strength
        if not (isinstance(strength, int | float) and math.isfinite(strength) and strength >= 0):
            raise bad("planted_strength", "a finite number >= 0")


@dataclass
class SynthResult:
    """What :func:`generate` wrote.

    Attributes:
        root: the output directory.
        features: feature-log files.
        events: event-log files.
        num_requests: feature lines written, bad ones included.
        num_bad: bad feature lines per quarantine reason.
        num_bad_events: bad event lines per kind (extra lines, not requests).
        summary: everything in ``root/_synth.json``.
    """

    root: Path
    features: list[Path]
    events: list[Path]
    num_requests: int
    num_bad: dict[str, int]
    num_bad_events: dict[str, int] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def _check_schema() -> int:
    """Check the generator still matches synth.toml; return item_tags' max_len."""
    schema = default_schema()
    if (
        tuple(schema.dense_names) != _DENSE
        or tuple(schema.sparse_names) != _SPARSE
        or schema.feature("user_recent_items").max_len != _RECENT_LEN  # type: ignore[union-attr]
    ):
        raise RecpipeError(
            "schemas/examples/synth.toml and etl/synth.py disagree on the feature list; "
            "update both together"
        )
    tags = schema.feature("item_tags")
    if tags.truncate:  # type: ignore[union-attr]
        raise RecpipeError("synth.toml: `item_tags` must have truncate = false")
    return tags.max_len  # type: ignore[union-attr]


def _session_lengths(rng: np.random.Generator, count: int, cfg: SynthConfig) -> np.ndarray:
    sigma = cfg.session_len_sigma
    mu = math.log(cfg.mean_session_len - 0.5) - sigma * sigma / 2
    raw = rng.lognormal(mu, sigma, count) if sigma > 0 else np.full(count, math.exp(mu))
    return np.minimum(1 + np.floor(raw).astype(np.int64), _MAX_SESSION_LEN)


def _plan_blocks(cfg: SynthConfig) -> list[np.ndarray]:
    """Session lengths per block, summing to exactly ``num_requests``."""
    rng = np.random.default_rng([cfg.seed, 0x5E55])
    blocks, total = [], 0
    while total < cfg.num_requests:
        lengths = _session_lengths(rng, cfg.concurrent_sessions, cfg)
        csum = np.cumsum(lengths)
        if total + csum[-1] >= cfg.num_requests:
            k = int(np.searchsorted(csum, cfg.num_requests - total))
            lengths = lengths[: k + 1].copy()
            lengths[-1] -= total + int(csum[k]) - cfg.num_requests
        blocks.append(lengths)
        total += int(lengths.sum())
    return blocks


def _jagged(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices ``starts[i] + 0..lengths[i]-1`` and the owner of each."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    offsets = np.cumsum(lengths) - lengths
    within = np.arange(int(lengths.sum())) - offsets[owner]
    return starts[owner] + within, owner


def _dump_lists(values: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """JSON text of each list (values split by lengths)."""
    if len(lengths) == 0:
        return []
    vals = values.tolist()
    ends = np.cumsum(lengths).tolist()
    nested = [vals[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    if lengths.min() == 0:  # "[]" would break the split below
        return [bytes(bytearray(orjson.dumps(v))) for v in nested]
    # One orjson call, then C-level cuts: small orjson outputs each hold a ~4 KiB buffer.
    return orjson.dumps(nested)[1:-1].replace(b"],[", b"]\n[").split(b"\n")


def planted_groups(config: SynthConfig) -> list[tuple[str, ...]]:
    """The planted feature groups of ``config``, in schema order (empty when off).

    >>> planted_groups(SynthConfig(planted_groups=2, planted_features=2))
    [('planted_0_0', 'planted_0_1'), ('planted_1_0', 'planted_1_1')]
    """
    return [
        tuple(f"planted_{g}_{j}" for j in range(config.planted_features))
        for g in range(config.planted_groups)
    ]


def planted_schema(config: SynthConfig) -> DatasetSchema:
    """The schema of the logs ``config`` generates: the bundled synth schema, with the planted
    features (one id each, ``context`` kind) appended when ``planted_groups`` > 0."""
    schema = default_schema()
    names = [name for group in planted_groups(config) for name in group]
    if not names:
        return schema
    extra = tuple(SparseFeature(name, kind="context", max_len=1) for name in names)
    return replace(schema, sparse=(*schema.sparse, *extra))


class _Planted:
    """The planted interaction groups: latent values per request, ids and the logit term."""

    def __init__(self, cfg: SynthConfig) -> None:
        self.cfg = cfg
        self.names = [name for group in planted_groups(cfg) for name in group]
        rng = np.random.default_rng([cfg.seed, 0x9A7])
        codes = rng.normal(0, 1, (cfg.planted_groups, _PLANTED_VALUES, _PLANTED_DIMS))
        self.codes = codes - codes.mean(axis=1, keepdims=True)  # zero mean over the values
        # the id a feature shows for each latent value: [features, values]
        slots = np.arange(len(self.names) * _PLANTED_VALUES, dtype=np.uint64)
        ids = (_hash(slots, 0x9A8) % np.uint64(1 << 31)).astype(np.int64)
        self.ids = ids.reshape(len(self.names), _PLANTED_VALUES)
        self.snippets = [
            [b',"%s":[%d]' % (name.encode(), v) for v in row]
            for name, row in zip(self.names, self.ids.tolist())
        ]

    def draw(self, b: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b``'s ``[n, features]`` shown latent values and ``[n]`` logit terms."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 0x9A9, b])
        groups, per = cfg.planted_groups, cfg.planted_features
        latent = rng.integers(0, _PLANTED_VALUES, (n, groups))
        shown = np.repeat(latent, per, axis=1)  # (n, groups * per)
        noisy = rng.random(shown.shape) < cfg.planted_noise
        shown = np.where(noisy, rng.integers(0, _PLANTED_VALUES, shown.shape), shown)
        codes = self.codes[np.arange(groups), latent]  # (n, groups, k)
        pairs = np.einsum("ngk,nhk->ngh", codes, codes)
        upper = np.triu(np.ones((groups, groups), dtype=bool), k=1)
        term = pairs[:, upper].sum(axis=1) * cfg.planted_strength / math.sqrt(_PLANTED_DIMS)
        return shown, term

    def lines(self, shown: np.ndarray) -> list[bytes]:
        """The JSON members of each row's planted features (``,"planted_0_0":[id]...``)."""
        snippets = self.snippets
        return [b"".join([snippets[f][v] for f, v in enumerate(row)]) for row in shown.tolist()]


class _Model:
    """The hidden logistic model that draws labels."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng([seed, 0x30DE1])
        self.segment = rng.normal(0, 1, _N_SEGMENTS)
        self.category = rng.normal(0, 1, _N_CATEGORIES)
        self.affinity = rng.normal(0, 1, (_N_SEGMENTS, _N_CATEGORIES))
        self.surface = rng.normal(0, 1, _N_SURFACES)
        self.bias = -2.6

    def logit(self, seg, cat, match, ctr, surface) -> np.ndarray:
        ctr_logit = np.log(ctr / (1 - ctr))
        return (
            self.bias
            + 0.5 * self.segment[seg]
            + 0.5 * self.category[cat]
            + 0.9 * self.affinity[seg, cat]
            + 1.5 * match
            + 0.8 * (ctr_logit + 3.0)
            + 0.3 * self.surface[surface]
        )


@dataclass
class _BadPlan:
    """Bad rows of one block: positions (time order), kinds, duplicate sources, big ids."""

    positions: np.ndarray
    kinds: np.ndarray
    sources: np.ndarray
    big_ids: np.ndarray


@dataclass
class _Block:
    """One block's requests (time-ordered, rendered in chunks) and events, ready to write."""

    chunks: Iterator[tuple[list[bytes], np.ndarray]]
    events: list[bytes]
    event_file: np.ndarray
    probs: np.ndarray
    labels: np.ndarray
    good: np.ndarray
    session_of_row: np.ndarray


class _Generator:
    """Generates one block of sessions at a time; carries the bad-record plan across blocks.

    User attributes are fixed functions (hashes) of the user id and item attributes of the item
    id, so a returning user or a popular item looks the same everywhere.
    """

    def __init__(self, cfg: SynthConfig) -> None:
        self.cfg = cfg
        self.tags_max_len = _check_schema()
        self.model = _Model(cfg.seed)
        self.planted = _Planted(cfg) if cfg.planted_groups else None
        self.seedkey = int(_mix(np.array([cfg.seed], dtype=np.uint64))[0])
        n_bad = round(cfg.bad_fraction * cfg.num_requests)
        if 0 < n_bad < len(BAD_KINDS) and cfg.num_requests >= len(BAD_KINDS):
            n_bad = len(BAD_KINDS)  # at least one of every kind
        rng = np.random.default_rng([cfg.seed, 0xBAD])
        self.bad_kinds = rng.permutation(np.arange(n_bad) % len(BAD_KINDS))
        self.n_bad = n_bad
        self.bad_done = 0
        self.bad_events = dict.fromkeys(BAD_EVENT_KINDS, 0)

    def salt(self, tag: int) -> int:
        return (self.seedkey ^ (tag * 0x9E3779B1)) & 0xFFFFFFFFFFFFFFFF

    def block(self, b: int, lengths: np.ndarray, first_session: int, first_row: int) -> _Block:
        """Block ``b``: sessions of the given lengths, numbered from ``first_session``."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 0xB10C, b])
        S = len(lengths)
        n = int(lengths.sum())
        gsess = np.arange(first_session, first_session + S, dtype=np.uint64)
        sess_key = _hash(gsess, self.salt(1))
        offsets = np.cumsum(lengths) - lengths
        srow = np.repeat(np.arange(S), lengths)  # session of each row (session-major)
        pos = np.arange(n) - offsets[srow]

        # Time: each session covers a share of the block growing with its length; its samples
        # sit one per equal slot with jitter, so gaps stay well below 30 minutes.
        span = np.clip(0.5 + lengths / 40.0, 0.0, 1.0)
        start = rng.random(S) * (1.0 - span)
        frac = start[srow] + (span / lengths)[srow] * (pos + rng.random(n))
        ts = _START_TS + b * _BLOCK_MS + np.floor(frac * _BLOCK_MS).astype(np.int64)

        # Users: distinct within a block, drawn from the pool partition of this block.
        pool = 4 * cfg.concurrent_sessions
        part = b % _USER_PARTITIONS
        users = 1 + part * pool + rng.choice(pool, S, replace=False).astype(np.int64)
        u = users.astype(np.uint64)
        segment = (_hash(u, 11) % np.uint64(_N_SEGMENTS)).astype(np.int64)
        country = (_hash(u, 12) % np.uint64(_N_COUNTRIES)).astype(np.int64)
        age = 18 + np.floor(_unit(u, 13) * 62)
        tenure = np.floor(_unit(u, 14) ** 2 * 3650)
        follows_len = 1 + (_hash(u, 15) % np.uint64(32)).astype(np.int64)
        idx, owner = _jagged(np.zeros(S, dtype=np.int64), follows_len)
        follows = _hash(_hash(u, 16)[owner] + idx.astype(np.uint64), 17) % np.uint64(_N_FOLLOWS)
        follows_json = _dump_lists(follows.astype(np.int64), follows_len)
        device = (_hash(sess_key, 18) % np.uint64(_N_DEVICES)).astype(np.int64)

        # Shifting lists: a state changes at the session start and at each shift.
        like_shift = (rng.random(n) < cfg.like_shift_prob) & (pos > 0)
        query_shift = (rng.random(n) < cfg.query_shift_prob) & (pos > 0)
        like_l0 = np.minimum(50, 5 + (_hash(sess_key, 21) % np.uint64(80)).astype(np.int64))
        query_l0 = 1 + (_hash(sess_key, 22) % np.uint64(16)).astype(np.int64)
        like = self._states(like_shift, srow, pos, like_l0, lengths, offsets)
        query = self._states(query_shift, srow, pos, query_l0, lengths, offsets)

        def stream(state_sess, wstart, wlen, salt, vocab):
            j, own = _jagged(wstart, wlen)
            base = _hash(sess_key[state_sess], salt)[own]
            return (_hash(base + j.astype(np.uint64), salt + 1) % np.uint64(vocab)).astype(np.int64)

        l_sess, l_end = like
        l_start = np.maximum(0, l_end - 50)
        liked = stream(l_sess, l_start, l_end - l_start, 31, _N_ITEMS)
        s_start = np.maximum(0, l_end - 20)
        liked_for_sellers = stream(l_sess, s_start, l_end - s_start, 31, _N_ITEMS)
        sellers = self._seller(liked_for_sellers)
        q_sess, q_end = query
        q_start = np.maximum(0, q_end - 16)
        queries = stream(q_sess, q_start, q_end - q_start, 41, _N_QUERIES)
        liked_json = _dump_lists(liked, l_end - l_start)
        sellers_json = _dump_lists(sellers, l_end - s_start)
        query_json = _dump_lists(queries, q_end - q_start)
        like_state = np.cumsum((pos == 0) | like_shift) - 1
        query_state = np.cumsum((pos == 0) | query_shift) - 1

        # Items: 30% come from the user's liked items, the rest from a skewed catalogue.
        from_liked = rng.random(n) < 0.3
        ls = like_state
        lens = (l_end - l_start)[ls]
        loffs = (np.cumsum(l_end - l_start) - (l_end - l_start))[ls]
        pick = loffs + np.minimum(np.floor(rng.random(n) * lens).astype(np.int64), lens - 1)
        popular = 1 + np.floor(_N_ITEMS * rng.random(n) ** 3).astype(np.int64)
        item = np.where(from_liked, liked[pick], popular)
        iu = item.astype(np.uint64)
        seller = self._seller(item)
        category = (_hash(iu, 51) % np.uint64(_N_CATEGORIES)).astype(np.int64)
        price = np.round(np.exp(1.0 + 2.0 * _unit(iu, 52)), 2)
        ctr = 0.005 + 0.2 * _unit(iu, 53) ** 2
        surface = np.floor(rng.random(n) ** 2 * _N_SURFACES).astype(np.int64)
        hour = ((ts // 3_600_000) % 24).astype(np.float64)

        # Does the item's seller appear among the user's liked sellers?
        s_len = (l_end - s_start)[ls]
        s_off = (np.cumsum(l_end - s_start) - (l_end - s_start))[ls]
        sidx, sowner = _jagged(s_off, s_len)
        hit = (sellers[sidx] == seller[sowner]).astype(np.int8)
        match = np.maximum.reduceat(hit, np.cumsum(s_len) - s_len) > 0

        logit = self.model.logit(segment[srow], category, match, ctr, surface)
        planted_rows: list[bytes] | None = None
        if self.planted is not None:
            shown, term = self.planted.draw(b, n)
            logit = logit + term
        prob = 1.0 / (1.0 + np.exp(-logit))
        label = rng.random(n) < prob

        # Time order within the block; request ids follow it.
        order = np.argsort(ts, kind="stable")
        rid = first_row + np.arange(n)
        rows = {
            "sess": srow[order],
            "ts": ts[order],
            "like": like_state[order],
            "query": query_state[order],
        }
        sid_prefix = [b'"session_id":"s-%d",' % (first_session + i) for i in range(S)]
        if not cfg.with_session_id:
            sid_prefix = [b""] * S
        p1 = [sid_prefix[i] + _SESSION_PARTS[0] % u for i, u in enumerate(users.tolist())]
        p2 = [_SESSION_PARTS[1] % v for v in zip(age.tolist(), tenure.tolist())]
        p3 = [_SESSION_PARTS[2] % v for v in zip(segment.tolist(), country.tolist(), follows_json)]
        p4 = [_SESSION_PARTS[3] % v for v in device.tolist()]
        liked_part = [
            b'"user_liked_items":%s,"user_liked_sellers":%s,' % v
            for v in zip(liked_json, sellers_json)
        ]
        if self.planted is not None:
            planted_rows = self.planted.lines(shown[order])
        recent_json = self._recent_items(sess_key, lengths, srow, pos, item)
        uniq_items, item_inv = np.unique(item, return_inverse=True)
        tags_json = _dump_lists(*self._tags(uniq_items))
        o = order
        columns = (
            rid,
            rows["sess"],
            rows["ts"],
            price[o],
            ctr[o],
            hour[o],
            rows["like"],
            rows["query"],
            o,
            item[o],
            seller[o],
            category[o],
            item_inv[o],
            surface[o],
        )

        def render(lo: int, hi: int) -> list[bytes]:
            """Lines of time-ordered rows lo..hi-1."""
            cols = zip(*(c[lo:hi].tolist() for c in columns))
            lines = [
                _TEMPLATE
                % (
                    r,
                    p1[s],
                    t,
                    p2[s],
                    pr,
                    c,
                    h,
                    p3[s],
                    liked_part[lk],
                    query_json[q],
                    recent_json[ri],
                    it,
                    sl,
                    ca,
                    tags_json[ti],
                    p4[s],
                    sf,
                )
                for r, s, t, pr, c, h, lk, q, ri, it, sl, ca, ti, sf in cols
            ]
            if planted_rows is not None:  # before the closing braces of "sparse" and the line
                lines = [ln[:-2] + p + b"}}" for ln, p in zip(lines, planted_rows[lo:hi])]
            return lines

        line_file = rng.integers(0, cfg.files, n)
        bad = self._plan_bad(rng, n, first_row, line_file)
        good = np.ones(n, dtype=bool)
        good[bad.positions] = False
        events, event_file = self._events(rng, label[o], rows["ts"], rid, line_file)

        def chunks():
            for lo in range(0, n, _CHUNK_ROWS):
                hi = min(n, lo + _CHUNK_ROWS)
                lines = render(lo, hi)
                self._corrupt(lines, lo, hi, bad, rid, rows["ts"], render)
                yield lines, line_file[lo:hi]

        return _Block(
            chunks=chunks(),
            events=events,
            event_file=event_file,
            probs=prob[o],
            labels=label[o],
            good=good,
            session_of_row=rows["sess"] + first_session,
        )

    def _tags(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tag ids (flat) and list lengths of each item."""
        iu = items.astype(np.uint64)
        lengths = 1 + (_hash(iu, 54) % np.uint64(self.tags_max_len)).astype(np.int64)
        idx, owner = _jagged(np.zeros(len(items), dtype=np.int64), lengths)
        tags = _hash(iu[owner] + idx.astype(np.uint64), 55) % np.uint64(_N_TAGS)
        return tags.astype(np.int64), lengths

    @staticmethod
    def _recent_items(sess_key, lengths, srow, pos, item) -> list[bytes]:
        """JSON of ``user_recent_items`` per row (session-major): a shift on every request.

        Session ``s`` reads a sequence of ``h`` history ids (hashed from the session) followed
        by the items of its requests; row ``pos`` shows the last ``_RECENT_LEN`` ids of its
        first ``h + pos`` (so it is its predecessor with the previous request's item appended,
        the oldest id dropped once full).
        """
        hist = np.minimum(_RECENT_LEN, 5 + (_hash(sess_key, 23) % np.uint64(40)).astype(np.int64))
        seq_len = hist + lengths - 1
        seq_off = np.cumsum(seq_len) - seq_len
        seq = np.empty(int(seq_len.sum()), dtype=np.int64)
        j, own = _jagged(np.zeros(len(hist), dtype=np.int64), hist)
        ids = _hash(_hash(sess_key, 71)[own] + j.astype(np.uint64), 72) % np.uint64(_N_ITEMS)
        seq[seq_off[own] + j] = ids.astype(np.int64)
        viewed = pos < lengths[srow] - 1  # every request but the session's last
        seq[(seq_off[srow] + hist[srow] + pos)[viewed]] = item[viewed]
        end = hist[srow] + pos  # (n,) ids of the session's sequence seen so far
        length = np.minimum(end, _RECENT_LEN)
        idx, _ = _jagged(seq_off[srow] + end - length, length)
        return _dump_lists(seq[idx], length)

    @staticmethod
    def _seller(items: np.ndarray) -> np.ndarray:
        return (_hash(items.astype(np.uint64), 61) % np.uint64(_N_SELLERS)).astype(np.int64)

    @staticmethod
    def _states(shift, srow, pos, l0, lengths, offsets):
        """Session and window end (exclusive stream index) of each list state."""
        csum = np.cumsum(shift)
        shifts_before = csum - csum[offsets[srow]]  # shifts in positions 1..k of the session
        new = (pos == 0) | shift
        state_sess = srow[new]
        return state_sess, l0[state_sess] + shifts_before[new]

    def _plan_bad(self, rng, n, first_row, line_file) -> _BadPlan:
        """Pick this block's bad rows, continuing the global kind sequence."""
        total = self.cfg.num_requests
        want = round(self.n_bad * (first_row + n) / total) - round(self.n_bad * first_row / total)
        want = max(0, min(want, self.n_bad - self.bad_done, n))
        positions = np.sort(rng.choice(n, want, replace=False)) if want else np.zeros(0, int)
        kinds = self.bad_kinds[self.bad_done : self.bad_done + want]
        self.bad_done += want
        good = np.ones(n, dtype=bool)
        good[positions] = False
        # A duplicate copies the nearest good row before it (else after it), in the same file.
        sources = np.full(want, -1, dtype=np.int64)
        good_idx = np.flatnonzero(good)
        dup = kinds == BAD_KINDS.index("duplicate_request_id")
        if dup.any():
            if len(good_idx) == 0:
                raise RecpipeError("`bad_fraction` is too high: no good record left to duplicate")
            at = np.searchsorted(good_idx, positions[dup])
            before = good_idx[np.maximum(at - 1, 0)]
            after = good_idx[np.minimum(at, len(good_idx) - 1)]
            sources[dup] = np.where(at > 0, before, after)
            line_file[positions[dup]] = line_file[sources[dup]]
        big = np.uint64(1 << 63) + rng.integers(0, 1 << 62, want, dtype=np.uint64)
        return _BadPlan(positions, kinds, sources, big)

    def _corrupt(self, lines, lo, hi, bad: _BadPlan, rid, ts, render) -> None:
        """Replace the planned bad rows among lines lo..hi-1 (``lines[0]`` is row lo)."""
        a, b = np.searchsorted(bad.positions, [lo, hi])
        for k in range(a, b):
            i = int(bad.positions[k])
            line = lines[i - lo]
            reason = BAD_KINDS[bad.kinds[k]]
            if reason == "malformed_json":
                variants = (line[: len(line) // 2], b"this is not json", line[:-1] + b",}")
                line = variants[k % 3]
            elif reason == "missing_request_id":
                line = line.replace(b'"request_id":"r-%d",' % rid[i], b"", 1)
            elif reason == "missing_ts":
                line = line.replace(b',"ts":%d' % ts[i], b"", 1)
            elif reason == "wrong_type":
                key, value = (
                    (b"ts", b'"yesterday"'),
                    (b"user_age", b'"old"'),
                    (b"item_id", b'["abc"]'),
                    (b"context_surface", b'"x"'),
                )[k % 4]
                line = _replace_value(line, key, value)
            elif reason == "non_finite":
                token = (b"NaN", b"Infinity", b"-Infinity")[k % 3]
                line = _replace_value(line, b"item_price", token)
            elif reason == "id_out_of_range":
                line = _replace_value(line, b"item_id", b"[%d]" % int(bad.big_ids[k]))
            elif reason == "list_too_long":
                ids = b",".join(b"%d" % (7 + j) for j in range(self.tags_max_len + 1 + k % 4))
                line = _replace_value(line, b"item_tags", b"[" + ids + b"]")
            elif reason == "duplicate_request_id":
                src = int(bad.sources[k])
                line = render(src, src + 1)[0]
            lines[i - lo] = line

    def _events(self, rng, label, ts, rid, line_file) -> tuple[list[bytes], np.ndarray]:
        n = len(label)
        extra = rng.random(n)
        # Positives: one click, sometimes a second event; negatives: sometimes an explicit 0.
        count = np.where(label, 1 + (extra < 0.2), (extra < 0.3).astype(np.int64))
        row = np.repeat(np.arange(n), count)
        first = np.ones(len(row), dtype=bool)
        first[1:] = row[1:] != row[:-1]
        ev_label = np.where(first, label[row], rng.random(len(row)) < 0.5).astype(np.int64)
        ev_ts = ts[row] + 500 + rng.integers(0, 60_000, len(row))
        order = np.argsort(ev_ts, kind="stable")
        row, ev_label, ev_ts = row[order], ev_label[order], ev_ts[order]
        rid_l = rid[row].tolist()
        events = [
            b'{"request_id":"r-%d","ts":%d,"label":%d}' % (r, t, y)
            for r, t, y in zip(rid_l, ev_ts.tolist(), ev_label.tolist())
        ]
        files = line_file[row]
        n_bad = round(self.cfg.bad_fraction * len(events))
        if n_bad:
            pos = np.sort(rng.choice(len(events), n_bad, replace=False)).tolist()
            bad = []
            for k, i in enumerate(pos):
                if k % 2 == 0:
                    bad.append(events[i][: len(events[i]) // 2])
                else:
                    value = (b'"yes"', b"[1]", b'{"v":1}')[(k // 2) % 3]
                    bad.append(events[i].rsplit(b":", 1)[0] + b":" + value + b"}")
            self.bad_events["malformed_json"] += (n_bad + 1) // 2
            self.bad_events["wrong_type"] += n_bad // 2
            events = events + bad
            files = np.concatenate([files, files[pos]])
        return events, files


def _replace_value(line: bytes, key: bytes, value: bytes) -> bytes:
    """Replace the JSON value of ``"key":`` (a number or a flat list) in ``line``."""
    marker = b'"' + key + b'":'
    head, found, rest = line.partition(marker)
    if not found:
        raise RecpipeError(f"internal: key {key!r} not found in a generated line")
    end = (
        rest.index(b"]") + 1
        if rest.startswith(b"[")
        else min(i for i in (rest.find(b","), rest.find(b"}")) if i >= 0)
    )
    return head + marker + value + rest[end:]


def _auc_from_hist(pos: np.ndarray, neg: np.ndarray) -> float:
    """AUC from per-bin positive/negative counts of a score (ties within a bin count half)."""
    total_pos, total_neg = pos.sum(), neg.sum()
    if total_pos == 0 or total_neg == 0:
        return float("nan")
    neg_below = np.cumsum(neg) - neg
    return float(((pos * neg_below).sum() + 0.5 * (pos * neg).sum()) / (total_pos * total_neg))


def generate(
    out_dir: str | Path,
    config: SynthConfig | None = None,
    *,
    progress: bool = False,
) -> SynthResult:
    """Write synthetic feature and event logs under ``out_dir``.

    Args:
        out_dir: output directory (created; existing part files are overwritten).
        config: what to generate; defaults to :class:`SynthConfig()`.
        progress: show a tqdm progress bar on stderr.

    Returns:
        The files written, the counts of injected bad records, and the summary.
    """
    cfg = config or SynthConfig()
    root = Path(out_dir)
    t0 = time.perf_counter()
    gen = _Generator(cfg)
    blocks = _plan_blocks(cfg)
    feat_dir, ev_dir = root / "features", root / "events"
    for d in (feat_dir, ev_dir):
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("part-*.jsonl.zst"):
            old.unlink()
    features = [feat_dir / f"part-{i:05d}.jsonl.zst" for i in range(cfg.files)]
    events = [ev_dir / f"part-{i:05d}.jsonl.zst" for i in range(cfg.files)]
    params = zstandard.ZstdCompressionParameters.from_level(cfg.zstd_level, write_checksum=1)
    handles = [open(p, "wb") for p in features + events]  # noqa: SIM115 - closed below
    writers = [
        zstandard.ZstdCompressor(compression_params=params).stream_writer(h) for h in handles
    ]
    feat_w, ev_w = writers[: cfg.files], writers[cfg.files :]
    bins = 1 << 16
    hist_pos = np.zeros(bins, dtype=np.int64)
    hist_neg = np.zeros(bins, dtype=np.int64)
    lengths_all = np.concatenate(blocks)
    n_events = n_pos = batch_sessions = batch_count = 0
    bar = None
    if progress:
        from recpipe.progress import progress_bar

        bar = progress_bar(total=cfg.num_requests, unit="req", desc="synth", file=sys.stderr)
    try:
        first_session = first_row = 0
        for b, lengths in enumerate(blocks):
            blk = gen.block(b, lengths, first_session, first_row)
            for lines, files in blk.chunks:
                _write(feat_w, lines, files)
            _write(ev_w, blk.events, blk.event_file)
            n_events += len(blk.events)
            good = blk.good
            score = np.minimum((blk.probs[good] * bins).astype(np.int64), bins - 1)
            hist_pos += np.bincount(score[blk.labels[good]], minlength=bins)
            hist_neg += np.bincount(score[~blk.labels[good]], minlength=bins)
            n_pos += int(blk.labels[good].sum())
            n_rows = len(blk.good)
            for i in range(0, n_rows - 4096 + 1, 4096):
                batch_sessions += len(np.unique(blk.session_of_row[i : i + 4096]))
                batch_count += 1
            first_session += len(lengths)
            first_row += n_rows
            if bar is not None:
                bar.update(n_rows)
    finally:
        for w in writers:
            w.close()
        if bar is not None:
            bar.close()
    injected = gen.bad_kinds[: gen.bad_done]
    n_good = cfg.num_requests - gen.bad_done
    num_bad = {k: int((injected == i).sum()) for i, k in enumerate(BAD_KINDS)}
    summary = {
        "config": asdict(cfg),
        "num_requests": cfg.num_requests,
        "num_good_requests": n_good,
        "num_bad": num_bad,
        "num_events": n_events,
        "num_bad_events": dict(gen.bad_events),
        "num_sessions": len(lengths_all),
        "num_blocks": len(blocks),
        "samples_per_session": {
            "mean": float(lengths_all.mean()),
            "p50": float(np.percentile(lengths_all, 50)),
            "p90": float(np.percentile(lengths_all, 90)),
            "p99": float(np.percentile(lengths_all, 99)),
            "max": int(lengths_all.max()),
        },
        "samples_per_session_in_time_batch_4096": (
            4096 * batch_count / batch_sessions if batch_count else None
        ),
        "label_rate": n_pos / max(n_good, 1),
        "hidden_model_auc": _auc_from_hist(hist_pos, hist_neg),
        "ts_range": [_START_TS, _START_TS + len(blocks) * _BLOCK_MS],
        "features": [str(p.relative_to(root)) for p in features],
        "events": [str(p.relative_to(root)) for p in events],
        "bytes": sum(p.stat().st_size for p in features + events),
        "elapsed_s": round(time.perf_counter() - t0, 3),
    }
    if cfg.planted_groups:
        schema_file = root / "_schema.toml"
        schema_file.write_text(planted_schema(cfg).to_toml())
        summary["planted"] = {
            "groups": [list(g) for g in planted_groups(cfg)],
            "values": _PLANTED_VALUES,
            "code_dims": _PLANTED_DIMS,
            "schema": str(schema_file.relative_to(root)),
        }
    (root / "_synth.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return SynthResult(
        root=root,
        features=features,
        events=events,
        num_requests=cfg.num_requests,
        num_bad=num_bad,
        num_bad_events=dict(gen.bad_events),
        summary=summary,
    )


def _write(writers: list, lines: list[bytes], files: np.ndarray) -> None:
    """Append ``lines`` to their files, in order, one joined write per file and chunk."""
    for start in range(0, len(lines), _CHUNK_ROWS):
        part = files[start : start + _CHUNK_ROWS]
        for f in np.unique(part).tolist():
            idx = (np.flatnonzero(part == f) + start).tolist()
            writers[f].write(b"\n".join([lines[i] for i in idx]) + b"\n")
