"""The CPU kernel that reads packed K/V (zerolite.quant.kv_decode): every path this CPU runs, forced
with ZEROLITE_CPU_KERNEL, equal bit for bit to the codecs' torch passes, for each codec and dtype,
on rows that reach each tail (widths off the vectors, groups of channels off them, odd widths with
a nibble of padding), random codes, rows of zeros, packed rows strided as the host buffers hold
them, rows split over threads, and states written into a view of a larger tensor: nothing past a
row's width or its last token is touched."""

from __future__ import annotations

import pytest
import torch

from zerolite.memory_model import kv_group_size, kv_key_share
from zerolite.quant import cpu_kernels
from zerolite.quant.kv_codec import KeyGroupCodec, KVCodec

# each instruction set the kernel has a path for (those above avx512 take its path)
PATHS = [path for path in cpu_kernels.supported_paths() if path in ("scalar", "avx2", "avx512")]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# 7: odd, a nibble of padding; 100: one group, 4 past the vectors of 8 and 16; 255: three groups of
# 85 (each ends mid-vector, and starts mid-byte at 4 bits); 256: two whole groups of 128
WIDTHS = [7, 100, 255, 256]
KEY_TOKENS = 8
CODECS = {"int8": KVCodec(8), "int4": KVCodec(4), "int4-key-groups": KeyGroupCodec(tokens=KEY_TOKENS)}
SENTINEL = float("nan")


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv(cpu_kernels.PATH_VARIABLE, request.param)
    return request.param


def random_rows(codec, states: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """states packed by codec, then every code byte replaced by a random one (scales and zeros kept
    finite, as encoding makes them); the rows of head 1 of sequence 0 all zero bytes."""
    packed = codec.encode(states)
    width, itemsize = states.shape[-1], states.dtype.itemsize
    if isinstance(codec, KeyGroupCodec):
        first_code = kv_key_share(width, codec.tokens) * itemsize
    else:
        first_code = width // kv_group_size(width) * itemsize * (2 if codec.bits == 4 else 1)
    codes = torch.randint(0, 256, (*packed.shape[:-1], packed.shape[-1] - first_code), dtype=torch.uint8,
                          generator=generator)
    packed[..., first_code:] = codes
    packed[0, 1] = 0
    return packed


def decode_both(codec, packed: torch.Tensor, dtype: torch.dtype, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's states, written into a view of a larger tensor filled with a sentinel, and the
    torch passes' (decoded alike); asserts the sentinel around the view is untouched."""
    *outer, tokens, _ = packed.shape
    larger = torch.full((*outer, tokens + 3, width + 5), SENTINEL, dtype=dtype)
    codec.decode_into(larger[..., 1:tokens + 1, 2:width + 2], packed)
    around = larger.clone()
    around[..., 1:tokens + 1, 2:width + 2] = SENTINEL
    assert around.isnan().all(), "the kernel wrote past the rows it was given"
    expected = torch.full((*outer, tokens, width), SENTINEL, dtype=dtype)
    codec.torch_decode_into(expected, packed)
    return larger[..., 1:tokens + 1, 2:width + 2], expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CODECS)
def test_the_kernel_decodes_bit_for_bit_as_the_torch_passes(path, name, dtype):
    codec, generator = CODECS[name], torch.Generator().manual_seed(len(name))
    for width in WIDTHS:
        states = (torch.randn(2, 3, 2 * KEY_TOKENS, width, generator=generator)
                  * torch.logspace(-3, 3, 2 * KEY_TOKENS)[:, None]).to(dtype)  # scales far apart token by token
        packed = random_rows(codec, states, generator)
        got, expected = decode_both(codec, packed, dtype, width)
        assert torch.equal(got, expected), (width, (got.float() - expected.float()).abs().max())
        assert not got[0, 1].any()  # rows of zeros (a row joining a running batch) decode to zeros
        got, expected = decode_both(codec, codec.encode(states), dtype, width)  # rows as encoding makes them
        assert torch.equal(got, expected), width


@pytest.mark.parametrize("name", CODECS)
def test_strided_rows_split_over_threads_decode_as_the_torch_passes(path, name):
    """Rows sequence-first, as a host buffer holds them (batch and heads one stride apart, tokens
    another), enough of them for several tasks, on two threads."""
    codec, generator = CODECS[name], torch.Generator().manual_seed(1)
    states = torch.randn(40 * KEY_TOKENS, 3, 2, 128, generator=generator).bfloat16()
    packed = codec.encode(states.permute(1, 2, 0, 3))
    strided = torch.empty(packed.shape[-2], *packed.shape[:-2], packed.shape[-1], dtype=torch.uint8)
    strided = strided.permute(1, 2, 0, 3)
    strided.copy_(packed)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, expected = decode_both(codec, strided, torch.bfloat16, 128)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, expected)
