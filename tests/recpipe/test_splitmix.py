"""splitmix64: the Numba scalar and array forms, the torch form and a NumPy reference agree."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from recpipe.kernels.hashing import hash_modulo_tensor, splitmix64_tensor
from recpipe.kernels.splitmix import GOLDEN, hash_modulo, mix64, salt_add, splitmix64

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)


def ref_splitmix64(x: int, add: int = GOLDEN) -> int:
    """The published splitmix64 step, in Python integers (wrapping by masking)."""
    mask = (1 << 64) - 1
    z = (x + add) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


@numba.njit
def _mix_each(x, add):  # mix64 called from another kernel, as the store's kernels do
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = mix64(x[i] + add)
    return out


def test_known_splitmix64_outputs():
    # the first outputs of a splitmix64 generator seeded with 0 (the reference sequence)
    state = np.array([GOLDEN * k % 2**64 for k in range(3)], dtype=np.uint64)
    assert splitmix64(state).tolist() == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]


@settings(max_examples=60, deadline=None)
@given(xs=st.lists(U64, max_size=40), add=U64)
def test_every_form_matches_the_reference(xs, add):
    expected = [ref_splitmix64(x, add) for x in xs]
    x = np.array(xs, dtype=np.uint64)
    assert splitmix64(x, add=add).tolist() == expected
    assert _mix_each(x, np.uint64(add)).tolist() == expected
    as_signed = torch.tensor([_signed(v) for v in xs], dtype=torch.int64)
    got = splitmix64_tensor(as_signed, add=add)
    assert [v % 2**64 for v in got.tolist()] == expected


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(I64, max_size=40), salt=st.integers(0, 1000), modulus=st.integers(1, 2**40))
def test_hash_modulo_forms_agree(ids, salt, modulus):
    expected = [_signed(ref_splitmix64(i % 2**64, salt_add(salt))) % modulus for i in ids]
    assert hash_modulo(np.array(ids, dtype=np.int64), salt=salt, modulus=modulus).tolist() == (
        expected
    )
    x = torch.tensor(ids, dtype=torch.int64)
    assert hash_modulo_tensor(x, salt=salt, modulus=modulus).tolist() == expected  # Numba
    torch_form = torch.remainder(splitmix64_tensor(x, add=salt_add(salt)), modulus)
    assert torch_form.tolist() == expected


def test_shapes_and_signed_input():
    x = np.arange(-3, 3, dtype=np.int64).reshape(2, 3)
    out = splitmix64(x)
    assert out.shape == (2, 3) and out.dtype == np.uint64
    assert out.ravel().tolist() == [ref_splitmix64(int(v) % 2**64) for v in x.ravel()]
    assert splitmix64(np.array([], dtype=np.uint64)).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_torch_form_on_cuda_matches_cpu():
    x = torch.randint(-(2**62), 2**62, (1000,), dtype=torch.int64)
    cuda = hash_modulo_tensor(x.cuda(), salt=5, modulus=1 << 20).cpu()
    assert torch.equal(cuda, hash_modulo_tensor(x, salt=5, modulus=1 << 20))


def test_importing_the_numpy_form_does_not_import_torch():
    code = "import sys, recpipe.kernels.splitmix, etl.synth; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# sha256 of the decompressed synthetic logs of two configs, written before etl.synth's hash
# moved to recpipe.kernels.splitmix: the generator's output must not change by a byte. Since synth
# gained `user_recent_items` the digests are of the logs with that feature cut out of each line
# (RECENT), which gives the earlier logs byte for byte, except that 4 planted bad lines of the
# first config are cut short at another byte (a share of the longer line): its digest was
# rewritten then, the second config's is the original one.
RECENT = re.compile(rb',?"user_recent_items":\[[^\]]*\]')
SYNTH_DIGESTS = [
    (
        {"num_requests": 3000, "seed": 5, "bad_fraction": 0.02, "files": 2},
        "bf6bcc42af40081e8759d24153f60440ea3eade50f311591416e8b3dd34eb8b7",
    ),
    (
        {"num_requests": 2000, "seed": 11, "with_session_id": False, "files": 1},
        "8445ef92b6b1391a46418791fad183ed2ad52b7c7752b762ffbde23d1e2ab664",
    ),
]


@pytest.mark.parametrize(("config", "digest"), SYNTH_DIGESTS)
def test_synthetic_logs_are_unchanged_by_a_byte(tmp_path, config, digest):
    from etl.synth import SynthConfig, generate

    generate(tmp_path, SynthConfig(**config))
    h = hashlib.sha256()
    for path in sorted(Path(tmp_path).rglob("part-*.jsonl.zst")):
        h.update(path.relative_to(tmp_path).as_posix().encode())
        with path.open("rb") as fh:
            h.update(RECENT.sub(b"", zstandard.ZstdDecompressor().stream_reader(fh).read()))
    assert h.hexdigest() == digest
