"""The msgpack codec: arrays survive bit-exactly, broken payloads raise DecodeError with a reason."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shared.kernel.codec import DecodeError, decode, decode_json, encode, encode_json
from shared.kernel.schemas import ActionRequest, Array, GenRequest, MicroBatch, Sample

ints = arrays(np.int32, st.integers(0, 40))
floats = arrays(np.float32, st.integers(0, 40), elements=st.floats(width=32, allow_nan=True, allow_infinity=True))
text = st.text(min_size=1, max_size=12)


def _arr(a: np.ndarray) -> Array:
    return Array.of(a, str(a.dtype))


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 30))
    return Sample(
        run="r", episode=draw(text), sample_id=draw(text), env_idx=draw(st.integers(0, 10**6)),
        rollout_idx=draw(st.integers(0, 64)), agent="solver", model="m", turn=draw(st.integers(0, 8)),
        prompt_ids=_arr(draw(ints)),
        response_ids=_arr(draw(arrays(np.int32, n))),
        behavior_logprobs=_arr(draw(arrays(np.float32, n, elements=st.floats(width=32)))),
        reward=draw(st.floats(allow_nan=False)), group_key=draw(text), group_size=draw(st.integers(1, 64)),
        version=draw(st.integers(0, 10**6)), versions=draw(st.dictionaries(text, st.integers(0, 100), max_size=3)),
    )


def _same_bits(a: Array, b: Array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.data == b.data


@settings(max_examples=60, deadline=None)
@given(samples())
def test_sample_round_trips_with_bit_exact_arrays(s: Sample) -> None:
    back = decode(Sample, encode(s))
    assert back == s
    for f in ("prompt_ids", "response_ids", "behavior_logprobs"):
        assert _same_bits(getattr(back, f), getattr(s, f))


@settings(max_examples=60, deadline=None)
@given(st.lists(ints, max_size=5), st.integers(1, 4096), st.floats(0, 5))
def test_gen_request_round_trips(prompts: list[np.ndarray], max_new: int, temp: float) -> None:
    req = GenRequest(request_id="q", prompts=[_arr(p) for p in prompts], max_new_tokens=max_new, temperature=temp)
    back = decode(GenRequest, encode(req))
    assert back == req
    assert all(np.array_equal(a.numpy(), p) for a, p in zip(back.prompts, prompts, strict=True))


@settings(max_examples=25, deadline=None)
@given(st.lists(samples(), max_size=4), floats)
def test_micro_batch_round_trips_including_nan_logprobs(ss: list[Sample], extra: np.ndarray) -> None:
    if ss:
        ss[0] = ss[0].model_copy(update={"behavior_logprobs": _arr(extra), "response_ids": _arr(
            np.zeros(len(extra), np.int32))})
    mb = MicroBatch(batch_id="b", model="m", samples=ss, trained_version_seen=3)
    back = decode(MicroBatch, encode(mb))
    assert [s.sample_id for s in back.samples] == [s.sample_id for s in ss]
    for a, b in zip(back.samples, ss, strict=True):
        assert _same_bits(a.behavior_logprobs, b.behavior_logprobs)  # NaN payload bits kept too


@settings(max_examples=60, deadline=None)
@given(st.lists(st.fixed_dictionaries({"expected": st.text(max_size=5), "response": st.text(max_size=9),
                                       "finished": st.booleans()}), max_size=6))
def test_action_request_round_trips(payloads: list[dict]) -> None:
    req = ActionRequest(action_id="a", kind="check_answer", payloads=payloads)
    assert decode(ActionRequest, encode(req)) == req


@settings(max_examples=60, deadline=None)
@given(samples(), st.data())
def test_truncated_payload_raises_decode_error_with_reason(s: Sample, data: st.DataObject) -> None:
    raw = encode(s)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(DecodeError) as exc:
        decode(Sample, raw[:cut])
    assert exc.value.reason


def test_garbage_and_wrong_shapes_are_rejected_with_readable_reasons() -> None:
    with pytest.raises(DecodeError, match="not msgpack"):
        decode(Sample, b"\xc1\xc1\xc1")
    with pytest.raises(DecodeError, match="expected a map"):
        decode(Sample, msgpack.packb([1, 2, 3]))
    req = GenRequest(request_id="q", prompts=[Array.of([1, 2, 3])], max_new_tokens=2)
    raw = msgpack.unpackb(encode(req))
    raw["prompts"][0]["data"] = raw["prompts"][0]["data"][:-1]  # 11 bytes for 3 int32
    with pytest.raises(DecodeError, match="prompts"):
        decode(GenRequest, msgpack.packb(raw, use_bin_type=True))
    del raw["request_id"]
    with pytest.raises(DecodeError, match="request_id"):
        decode(GenRequest, msgpack.packb(raw, use_bin_type=True))


def test_wrong_schema_version_raises() -> None:
    raw = msgpack.unpackb(encode(ActionRequest(action_id="a", kind="k", payloads=[])))
    raw["schema"] = 99
    with pytest.raises(DecodeError, match="schema version 99"):
        decode(ActionRequest, msgpack.packb(raw, use_bin_type=True))


def test_json_codec_is_plain_json_and_rejects_garbage() -> None:
    assert decode_json(encode_json({"kind": "step", "version": 3})) == {"kind": "step", "version": 3}
    with pytest.raises(DecodeError, match="not JSON"):
        decode_json(b"{nope")
