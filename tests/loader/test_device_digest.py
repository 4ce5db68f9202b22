"""``device_digest`` (issue 56): a digest of a tensor's bytes computed with
integer torch operations on the tensor's own device, the same for the same
bytes on any device and any chunking, different for any one changed word;
checked here against a plain-Python reference of the documented algorithm
(docs/guides/rl-updates.md, "Digests")."""

import pytest

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode

from instant_staging.loader import _digest, device_digest, device_digests

from support.tensors import raw_bytes


def reference(t):
    """The algorithm as the docs write it, in Python integers."""
    data = bytes(raw_bytes(t.contiguous()).numpy()) if t.numel() else b""
    n = len(data)
    data += b"\0" * (-n % 4)
    words = [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]
    lanes = []
    for prime, base in _digest._LANES:
        h = 0
        for i, w in enumerate(words):
            h = (h + w * pow(base, i + 1, prime)) % prime
        lanes.append(h)
    return f"{n:x}:{lanes[0]:08x}{lanes[1]:08x}"


CASES = {
    "f32": torch.randn(1000),
    "bf16 odd": torch.randn(7, dtype=torch.bfloat16),
    "u8 odd": torch.arange(13, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "i64": torch.arange(-5, 300, dtype=torch.int64),
    "f8": torch.randn(33).to(torch.float8_e4m3fn),
    "strided": torch.randn(6, 5)[:, 1],
    "unaligned view": torch.arange(30, dtype=torch.uint8)[1:],
    "scalar": torch.tensor(2.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_digest_is_the_documented_algorithm_whatever_the_chunk(name):
    t = CASES[name]
    want = reference(t)
    assert device_digest(t) == want
    for words in (1, 3, 64):
        assert device_digests({"t": t}, words=words)["t"] == want


def mixed():
    """Many small tensors of a few repeated sizes (a model's experts and
    layers), big ones, odd sizes, several dtypes, views, empties."""
    g = torch.Generator().manual_seed(3)
    out = {f"expert.{i}": torch.randn(24, generator=g).bfloat16() for i in range(40)}
    out.update({f"norm.{i}": torch.randn(9, generator=g) for i in range(12)})
    out.update({
        "big": torch.randn(3000, generator=g),
        "big bf16 odd": torch.randn(2001, generator=g).bfloat16(),
        "u8 odd": torch.randint(0, 256, (37,), dtype=torch.uint8, generator=g),
        "unaligned": torch.randint(0, 256, (90,), dtype=torch.uint8, generator=g)[3:],
        "strided": torch.randn(20, 7, generator=g)[:, 2],
        "i64": torch.arange(-40, 41, dtype=torch.int64),
        "bool": torch.rand(21, generator=g) > 0.5,
        "f8": torch.randn(66, generator=g).to(torch.float8_e4m3fn),
        "c64": torch.randn(5, dtype=torch.complex64, generator=g),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(-0.0),
    })
    return out


@pytest.mark.parametrize("words", [1, 5, 24, 64, 1000, 1 << 22])
def test_many_tensors_at_once_are_each_the_documented_algorithm(words):
    tensors = mixed()
    assert device_digests(tensors, words=words) == {n: reference(t) for n, t in tensors.items()}


class _Ops(TorchDispatchMode):
    """Counts the torch operations that are not views."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def test_many_small_tensors_cost_a_few_operations_a_batch_not_a_tensor():
    tensors = {f"expert.{i}": torch.randn(16) for i in range(500)}
    tensors.update({f"odd.{i}": torch.randn(16 + i % 3) for i in range(60)})
    device_digests(tensors)                      # the power tables, built once
    with _Ops() as ops:
        digests = device_digests(tensors)
    assert ops.count < 20
    assert digests["expert.7"] == reference(tensors["expert.7"])


def test_an_empty_tensor_has_the_digest_of_no_bytes():
    assert device_digest(torch.empty(0, 3)) == "0:0000000000000000"


def test_any_one_changed_word_and_a_swap_change_the_digest():
    t = torch.randn(4096)
    base = device_digest(t)
    seen = {base}
    for i in (0, 1, 2047, 4095):
        u = t.clone()
        u.view(torch.int32)[i] ^= 1
        seen.add(device_digest(u))
    u = t.clone()
    u[[10, 11]] = u[[11, 10]]
    seen.add(device_digest(u))
    seen.add(device_digest(torch.cat([t, torch.zeros(1)])))      # a trailing zero: another length
    assert len(seen) == 7


def test_the_digest_follows_the_bytes_not_the_dtype():
    t = torch.randn(16)
    assert device_digest(t) == device_digest(t.view(torch.int32)) == device_digest(t.view(2, 8))


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        device_digest([1, 2])
    with pytest.raises(ValueError, match="dense"):
        device_digest(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match="words"):
        device_digests({"a": torch.zeros(1)}, words=0)


@pytest.mark.gpu
def test_cpu_and_cuda_agree():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for t in CASES.values():
        assert device_digest(t.cuda()) == device_digest(t)
    big = torch.randn(3 << 20, dtype=torch.bfloat16)
    assert device_digest(big.cuda()) == device_digest(big)


@pytest.mark.gpu
@pytest.mark.parametrize("words", [5, 1 << 22])
def test_many_cuda_tensors_at_once_are_each_the_documented_algorithm(gpu, words):
    tensors = mixed()
    on_gpu = {n: t.cuda() for n, t in tensors.items()}
    on_gpu["unaligned"] = tensors["unaligned"].cuda()[1:]           # an odd offset on the device
    tensors["unaligned"] = tensors["unaligned"][1:]
    assert device_digests(on_gpu, words=words) == {n: reference(t) for n, t in tensors.items()}
