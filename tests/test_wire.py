"""The openpi wire format: byte-compatible with openpi-client, stricter on what it accepts.

Compatibility is checked against the real ``openpi_client.msgpack_numpy`` in
both directions; strictness is checked with frames built by hand with plain
msgpack, the way a buggy or hostile client would build them.
"""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy as openpi

from policy_operator.runtime.errors import ErrorKind, WireError
from policy_operator.runtime.serving import wire


def _arrays() -> dict[str, object]:
    rng = np.random.default_rng(7)
    base = rng.standard_normal((4, 6)).astype(np.float32)
    return {
        "image": rng.integers(0, 256, size=(5, 4, 3), dtype=np.uint8),
        "f32": base,
        "f64_big_endian": base.astype(">f8"),
        "f16": base.astype(np.float16),
        "i64": np.arange(-3, 9, dtype=np.int64).reshape(3, 4),
        "bool": base > 0,
        "zero_d": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "transposed": base.T,  # not C-contiguous
        "strided": base[::2, 1::2],
        "fortran": np.asfortranarray(base),
        "bytes_dtype": np.array([b"ab", b"c"]),
        "scalar_f32": np.float32(1.25),
        "scalar_i8": np.int8(-7),
        "scalar_u64": np.uint64(2**64 - 1),
        "scalar_bool": np.bool_(True),
    }


def _message() -> dict[str, object]:
    return {
        "prompt": "put the banana in the bowl",
        "arrays": _arrays(),
        "nested": [{"x": np.arange(3, dtype=np.int16)}, 1, 2.0, None, True, b"raw"],
    }


def _assert_same(a: object, b: object, path: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, (np.ndarray, np.generic)):
        assert type(a) is type(b), path
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), path
        assert np.array_equal(a, b), path
    else:
        assert a == b and type(a) is type(b), path


# --- compatibility with openpi-client -----------------------------------------------------
def test_pack_is_byte_identical_to_openpi() -> None:
    msg = _message()
    assert wire.packb(msg) == openpi.packb(msg)


@pytest.mark.parametrize("name", list(_arrays()))
def test_each_array_kind_is_byte_identical_to_openpi(name: str) -> None:
    value = _arrays()[name]
    assert wire.packb({"v": value}) == openpi.packb({"v": value})


def test_openpi_reads_what_we_write() -> None:
    msg = _message()
    _assert_same(msg, openpi.unpackb(wire.packb(msg)))


def test_we_read_what_openpi_writes() -> None:
    msg = _message()
    _assert_same(msg, wire.unpackb(openpi.packb(msg)))
    # openpi's streaming Packer (what WebsocketClientPolicy uses) writes the same bytes
    assert openpi.Packer().pack(msg) == openpi.packb(msg)
    _assert_same(msg, wire.decode_observation(openpi.Packer().pack(msg)))


def test_str_keyed_array_maps_from_other_writers_are_read() -> None:
    """A non-openpi msgpack writer may use str keys; the decoder accepts both spellings."""
    frame = msgpack.packb({"a": {"__ndarray__": True, "data": b"\x00\x00\x80?", "dtype": "<f4", "shape": [1]}})
    out = wire.unpackb(frame)["a"]
    assert out.dtype == np.float32 and out.tolist() == [1.0]


# --- refused dtypes --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        np.array([object()], dtype=object),
        np.zeros(2, dtype="V4"),
        np.zeros(2, dtype=[("a", "<f4")]),
        np.array([1 + 2j], dtype=np.complex64),
        np.complex128(1j),
    ],
    ids=["object", "void", "structured", "complex-array", "complex-scalar"],
)
def test_pack_refuses_object_void_complex(value: object) -> None:
    with pytest.raises(WireError, match="unsupported dtype"):
        wire.packb({"v": value})


@pytest.mark.parametrize("dtype", ["|O", "|V8", "<c8", "<c16"])
def test_unpack_refuses_object_void_complex_arrays(dtype: str) -> None:
    size = np.dtype(dtype).itemsize if dtype != "|O" else 8
    frame = msgpack.packb({"v": {b"__ndarray__": True, b"data": b"\x00" * size, b"dtype": dtype, b"shape": [1]}})
    with pytest.raises(WireError, match="unsupported dtype"):
        wire.unpackb(frame)


@pytest.mark.parametrize("dtype", ["|O", "<c8"])
def test_unpack_refuses_object_complex_scalars(dtype: str) -> None:
    frame = msgpack.packb({"v": {b"__npgeneric__": True, b"data": 0, b"dtype": dtype}})
    with pytest.raises(WireError, match="unsupported dtype"):
        wire.unpackb(frame)


def test_pack_refuses_unknown_python_objects() -> None:
    with pytest.raises(TypeError, match="cannot serialize"):
        wire.packb({"v": object()})


# --- malformed arrays ------------------------------------------------------------------------
def _array_map(**fields: object) -> bytes:
    base: dict[bytes, object] = {b"__ndarray__": True, b"data": b"\x00" * 24, b"dtype": "<f4", b"shape": [2, 3]}
    for key, value in fields.items():
        if value is _DROP:
            base.pop(key.encode())
        else:
            base[key.encode()] = value
    return msgpack.packb({"v": base})


_DROP = object()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"data": b"\x00" * 20}, r"needs 24 bytes, got 20"),
        ({"data": b"\x00" * 28}, r"needs 24 bytes, got 28"),
        ({"shape": [3, 3]}, r"needs 36 bytes, got 24"),
        ({"shape": [2, -3]}, r"bad array shape"),
        ({"shape": "2x3"}, r"bad array shape"),
        ({"shape": [2.0, 3]}, r"bad array shape"),
        ({"shape": [1] * 9}, r"bad array shape"),
        ({"data": "text, not bytes"}, r"data must be bytes"),
        ({"dtype": "no-such-dtype"}, r"bad dtype"),
        ({"dtype": 42}, r"bad dtype"),
        ({"data": _DROP}, r"without 'data'"),
        ({"shape": _DROP}, r"without 'shape'"),
        ({"dtype": _DROP}, r"without 'dtype'"),
    ],
    ids=[
        "short",
        "long",
        "shape-bigger",
        "negative-dim",
        "shape-str",
        "shape-float",
        "too-many-dims",
        "data-str",
        "dtype-unknown",
        "dtype-int",
        "no-data",
        "no-shape",
        "no-dtype",
    ],
)
def test_malformed_array_is_a_wire_error(fields: dict[str, object], message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.unpackb(_array_map(**fields))


def test_well_formed_array_map_decodes() -> None:
    """The control for the table above: the same map, unmodified, is a (2, 3) float32 array."""
    out = wire.unpackb(_array_map())["v"]
    assert out.shape == (2, 3) and out.dtype == np.float32 and not out.any()


@pytest.mark.parametrize(
    "scalar",
    [
        {b"__npgeneric__": True, b"data": 2**64 - 1, b"dtype": "<i8"},  # does not fit int64
        {b"__npgeneric__": True, b"data": "abc", b"dtype": "<f4"},
        {b"__npgeneric__": True, b"data": {"a": 1}, b"dtype": "<f4"},
        {b"__npgeneric__": True, b"data": 1, b"dtype": "<M8"},
    ],
    ids=["int-overflow", "str-as-float", "map-as-float", "datetime-without-unit"],
)
def test_malformed_scalar_is_a_wire_error(scalar: dict[bytes, object]) -> None:
    with pytest.raises(WireError):
        wire.unpackb(msgpack.packb({"v": scalar}))


def test_huge_declared_shape_is_a_wire_error() -> None:
    frame = msgpack.packb({"v": {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [0, 2**63]}})
    with pytest.raises(WireError):
        wire.unpackb(frame)


# --- malformed frames -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", b"\x92\x01", b"\x81\xa1a", b"\x01\x02", b"GET / HTTP/1.1\r\n\r\n"],
    ids=["empty", "reserved-byte", "truncated-array", "truncated-map", "extra-data", "http"],
)
def test_non_msgpack_bytes_are_a_wire_error(frame: bytes) -> None:
    with pytest.raises(WireError, match="not valid msgpack"):
        wire.decode_observation(frame)


def test_text_frame_is_a_wire_error() -> None:
    with pytest.raises(WireError, match="text frame"):
        wire.decode_observation(wire.packb({"prompt": "x"}).decode("latin-1"))


@pytest.mark.parametrize(
    "value", [[1, 2], 3, "prompt", None, np.zeros(3, np.float32)], ids=["list", "int", "str", "nil", "array"]
)
def test_non_map_frame_is_a_wire_error(value: object) -> None:
    with pytest.raises(WireError, match="observation must be a map"):
        wire.decode_observation(wire.packb(value))


def test_non_string_keys_are_a_wire_error() -> None:
    with pytest.raises(WireError, match="keys must be strings"):
        wire.decode_observation(msgpack.packb({1: "x", "prompt": "y"}))
    with pytest.raises(WireError, match="keys must be strings"):
        wire.decode_observation(msgpack.packb({b"prompt": "y"}))


def test_deeply_nested_frame_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        wire.decode_observation(b"\x91" * 100_000 + b"\xc0")


def _nested_maps(depth: int) -> bytes:
    """``{"a": {"a": ... {}}}``: ``depth`` maps inside each other, 3 bytes each."""
    return b"\x81\xa1a" * depth + b"\x80"


@pytest.mark.parametrize("depth", [30, 1000])
def test_deeply_nested_maps_are_a_wire_error(depth: int) -> None:
    """1,000 nested maps decode within msgpack's own stack, then overflow Python's recursion in whatever walks
    the frame (an internal error with a 166 KB traceback); 30 pass every per-container limit."""
    frame = b"\x82\xa6prompt\xa1p\xa6nested" + _nested_maps(depth)
    with pytest.raises(WireError, match="nests maps and lists more than|more than .* maps and lists"):
        wire.decode_observation(frame)


def test_observations_nested_a_few_deep_still_decode() -> None:
    """ALOHA-style ``{"images": {camera: array}}`` and lists of small arrays stay valid."""
    obs = {
        "images": {f"cam_{i}": np.zeros((4, 4, 3), np.uint8) for i in range(4)},
        "state": [0.0] * 14,
        "history": [[np.zeros(8, np.float32) for _ in range(4)]],
        "prompt": "p",
    }
    _assert_same(wire.decode_observation(wire.packb(obs)), obs)


@pytest.mark.parametrize(
    "payload, words",
    [
        ({f"observation/image_{i}": np.zeros((1, 1, 3), np.uint8) for i in range(3000)}, "exceeds max_map_len"),
        ({"prompt": "p", **{f"k{i}": i for i in range(wire.MAX_MAP_LEN + 1)}}, "exceeds max_map_len"),
        ({"cameras": [{"x": 1} for _ in range(wire.MAX_CONTAINERS + 1)]}, "more than 512 maps and lists"),
        ({"state": list(range(wire.MAX_ARRAY_LEN + 1))}, "exceeds max_array_len"),
    ],
    ids=["3000-camera-maps", "257-keys", "513-maps", "4097-item-list"],
)
def test_structurally_absurd_frames_are_refused_while_decoding(payload: dict[str, object], words: str) -> None:
    with pytest.raises(WireError, match=words):
        wire.decode_observation(wire.packb(payload))


def test_a_frame_of_a_million_keys_is_refused_at_its_header() -> None:
    """msgpack checks a map's declared length before building it: the refusal costs nothing of the frame."""
    frame = b"\xdf" + (1_200_000).to_bytes(4, "big") + b"\xa1k\x00" * 1000  # claims 1.2 M keys, holds 1,000
    with pytest.raises(WireError, match="exceeds max_map_len"):
        wire.decode_observation(frame)


def test_ext_types_are_a_wire_error() -> None:
    with pytest.raises(WireError):
        wire.decode_observation(msgpack.packb({"prompt": msgpack.ExtType(5, b"x" * 10)}))


def test_random_and_mutated_frames_only_ever_raise_wire_error() -> None:
    """Whatever arrives, decoding either succeeds or raises WireError: nothing else reaches the handler."""
    rng = random.Random(1234)
    valid = wire.packb(
        {
            "observation/image": np.zeros((4, 4, 3), np.uint8),
            "prompt": "p",
            "observation/joint_position": np.arange(7, dtype=np.float32),
            "seed": np.int64(3),
        }
    )
    frames = [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))) for _ in range(300)]
    for _ in range(700):
        mutated = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.getrandbits(8)
        frames.append(bytes(mutated[: rng.randint(1, len(mutated))]) if rng.random() < 0.3 else bytes(mutated))
    outcomes = {"ok": 0, "refused": 0}
    for frame in frames:
        try:
            wire.decode_observation(frame)
            outcomes["ok"] += 1
        except WireError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == len(frames)


def test_error_dict_shape() -> None:
    assert wire.error_dict(ErrorKind.BAD_FRAME, "why") == {
        "type": "error",
        "error": {"kind": "bad_frame", "message": "why"},
    }
    for kind in ErrorKind:
        assert openpi.unpackb(wire.packb(wire.error_dict(kind, "m"))) == {
            "type": "error",
            "error": {"kind": kind.value, "message": "m"},
        }
