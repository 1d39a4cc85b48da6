"""Deduplicated attention pooling (RecD O7): a transformer encoder layer over a group's sequences.

:class:`AttentionPooling` takes the :class:`~trainer.modules.JaggedEmbeddings` of a sequence group
(from :class:`~trainer.modules.SequenceEmbeddings`) and returns one ``[B, D]`` embedding per batch
row. When every input feature comes from one IKJT group, the encoder runs on the U unique rows and
its ``[U, D]`` output is expanded with the inverse lookup; the plain path runs it on all B rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from recpipe.errors import RecpipeError
from trainer.modules import JaggedEmbeddings, expand_rows, table_seed

__all__ = ["AttentionPooling"]


def _pad(seq: JaggedEmbeddings, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, L, D]`` padded sequences (most recent first) and a ``[R, L]`` validity mask.

    Only the last ``max_len`` values of a row are kept. ``L`` is the longest kept row, so it is
    the same for the unique rows of a group and for the batch rows they expand to.
    """
    values, offsets = seq.values, seq.offsets
    rows, dim = seq.num_rows, values.shape[1]
    lengths = offsets[1:] - offsets[:-1]  # (R,)
    length = int(lengths.max()) if rows else 0
    length = min(length, max_len)
    if length == 0 or values.shape[0] == 0:
        return values.new_zeros(rows, max(length, 0), dim), lengths.new_zeros(
            rows, max(length, 0), dtype=torch.bool
        )
    n = values.shape[0]  # the lengths' sum: given, so that nothing is read back
    row = torch.repeat_interleave(torch.arange(rows, device=values.device), lengths, output_size=n)
    from_end = offsets[1:].index_select(0, row) - 1 - torch.arange(n, device=row.device)  # (N,)
    # a value beyond the last max_len of its row goes to a spare last row, dropped after (no
    # boolean selection: that would read its size back from a GPU)
    flat = torch.where(from_end < length, row * length + from_end, rows * length)  # (N,)
    padded = values.new_zeros(rows * length + 1, dim).index_copy(0, flat, values)[:-1]
    mask = torch.arange(length, device=row.device)[None, :] < lengths.clamp(max=length)[:, None]
    return padded.view(rows, length, dim), mask  # (R, L, D), (R, L)


class AttentionPooling(nn.Module):
    """A transformer encoder layer over a group's sequences, pooled at a CLS token (O7).

    The tokens of a row are ``[CLS, f1 values..., f2 values...]`` (each feature's values with a
    learned feature-type embedding and a position counted from the most recent id). One or more
    pre-norm encoder layers (multi-head self-attention and an MLP, padded positions masked out of
    every key) run over them; the CLS token's output is the row's ``[D]`` embedding.

    Deduplicated compute: when every input feature comes from the same IKJT group, the layer
    runs on the U unique rows and its ``[U, D]`` output is expanded with the inverse lookup;
    otherwise (plain KJT, or features of different groups) it runs on all B rows. Each row's
    result depends on that row only (padding is masked and the padded length is the same in
    both cases), so both paths compute the same numbers.

    Args:
        features: the sequence features, in token order.
        dim: embedding dimension D of the sequence values (and of the output).
        max_len: ids kept per feature (the most recent), one int or ``{feature: int}``.
        num_heads: attention heads (must divide ``dim``).
        num_layers: encoder layers.
        ffn_mult: hidden width of the MLP, as a multiple of ``dim``.
        seed: init seed.
    """

    def __init__(
        self,
        features: Sequence[str],
        *,
        dim: int,
        max_len: int | Mapping[str, int] = 50,
        num_heads: int = 2,
        num_layers: int = 1,
        ffn_mult: int = 2,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.features = tuple(features)
        if not self.features:
            msg = "`features` must name at least one sequence feature, got []"
            raise RecpipeError(msg)
        if dim < 1 or num_heads < 1 or dim % num_heads:
            msg = f"`num_heads` must divide `dim`, got num_heads={num_heads!r}, dim={dim!r}"
            raise RecpipeError(msg)
        lens = {f: max_len if isinstance(max_len, int) else max_len[f] for f in self.features}
        for f, n in lens.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                msg = f"`max_len` of {f!r} must be a positive integer, got {n!r}"
                raise RecpipeError(msg)
        self.max_len = lens
        self.dim, self.num_heads = dim, num_heads
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(table_seed(seed, "attention:" + "+".join(self.features)))
            self.cls = nn.Parameter(torch.randn(dim) * 0.02)
            self.type_emb = nn.Parameter(torch.randn(len(self.features), dim) * 0.02)
            self.pos_emb = nn.ParameterList(
                nn.Parameter(torch.randn(lens[f], dim) * 0.02) for f in self.features
            )
            self.layers = nn.ModuleList(
                _EncoderLayer(dim, num_heads, ffn_mult) for _ in range(num_layers)
            )
            self.norm = nn.LayerNorm(dim)

    def forward(self, sequences: Mapping[str, JaggedEmbeddings]) -> torch.Tensor:
        """``[B, D]`` pooled embedding of every batch row."""
        seqs = [sequences[f] for f in self.features]
        inverse = seqs[0].inverse
        dedup = inverse is not None and all(s.inverse is inverse for s in seqs)
        if not dedup:
            seqs = [s.expand() for s in seqs]
            inverse = None
        pooled = self.pool_rows(seqs)  # (R, D)
        return expand_rows(pooled, inverse)  # (B, D)

    def pool_rows(self, seqs: Sequence[JaggedEmbeddings]) -> torch.Tensor:
        """Run the encoder on the stored rows of ``seqs`` (same R each): ``[R, D]``."""
        rows = seqs[0].num_rows
        tokens = [self.cls.expand(rows, 1, self.dim)]  # (R, 1, D)
        masks = [torch.ones(rows, 1, dtype=torch.bool, device=self.cls.device)]
        for k, seq in enumerate(seqs):
            padded, mask = _pad(seq, self.max_len[self.features[k]])  # (R, L, D), (R, L)
            length = padded.shape[1]
            tokens.append(padded + self.type_emb[k] + self.pos_emb[k][:length])
            masks.append(mask)
        x = torch.cat(tokens, dim=1)  # (R, T, D)
        attend = torch.cat(masks, dim=1)[:, None, None, :]  # (R, 1, 1, T)
        for layer in self.layers:
            x = layer(x, attend)
        return self.norm(x[:, 0])  # (R, D)


class _EncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer: x + MHA(LN(x)); x + MLP(LN(x))."""

    def __init__(self, dim: int, num_heads: int, ffn_mult: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln1 = nn.LayerNorm(dim)
        # no key bias: it adds the same logit to every key of a query, so its exact gradient is
        # zero and an adaptive optimizer would only amplify rounding noise in it
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_mult * dim), nn.GELU(), nn.Linear(ffn_mult * dim, dim)
        )

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        rows, length, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)  # (R, T, D) each
        q, v = q + self.q_bias, v + self.v_bias
        shape = (rows, length, self.num_heads, dim // self.num_heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))  # (R, H, T, Dh)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)  # (R, H, T, Dh)
        x = x + self.proj(att.transpose(1, 2).reshape(rows, length, dim))
        return x + self.ffn(self.ln2(x))
