"""Paramsync's protocol decisions and the in-place weight load it drives, without a broker."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.paramsync.protocol import AnnounceQueue, InstanceResult, decide, instances_from_keys
from shared.kernel.config import ChorusConfig
from shared.kernel.schemas import WeightsAnnounce
from shared.models.loading import load_model, shipped_tensors
from shared.models.weights import flatten, load_into, pack, unpack


def ann(v: int) -> WeightsAnnounce:
    return WeightsAnnounce(model="m", version=v, object_name=f"weights/m/v{v}", checksum=f"c{v}", nbytes=1)


def test_queued_announces_coalesce_to_the_newest() -> None:
    q = AnnounceQueue()
    for v in (3, 4, 5):
        q.offer(ann(v))
    taken = q.take()
    assert taken is not None and taken.version == 5
    assert q.coalesced == 2 and q.take() is None


def test_an_older_announce_never_replaces_a_newer_pending_one() -> None:
    q = AnnounceQueue()
    q.offer(ann(5))
    assert not q.offer(ann(4))
    taken = q.take()
    assert taken is not None and taken.version == 5


def test_announces_older_than_the_synced_version_are_ignored() -> None:
    q = AnnounceQueue()
    q.done(6)
    assert not q.offer(ann(5)) and q.ignored == 1
    assert q.offer(ann(6))  # a re-announce of the served version is synced again (new instances)


def test_instances_are_parsed_from_registration_keys() -> None:
    keys = ["rollouter.m.0", "rollouter.m.1", "rollouter.mm.9", "version.m", "rollouter.m."]
    assert instances_from_keys(keys, "rollouter.m.") == ["0", "1"]


def test_version_commits_once_every_live_instance_was_tried_and_one_loaded() -> None:
    ok = decide([InstanceResult("0", loaded=True), InstanceResult("1", loaded=True)])
    assert ok.commit and ok.loaded == ["0", "1"] and not ok.failed
    # a live instance that failed every attempt is reported (and kept out of routing); the others serve
    part = decide([InstanceResult("0", loaded=True), InstanceResult("1", loaded=False, error="checksum")])
    assert part.commit and part.loaded == ["0"] and part.failed == {"1": "checksum"}
    # every live instance failed: the old version keeps serving
    none = decide([InstanceResult("0", loaded=False, error="timeout"), InstanceResult("1", loaded=False,
                                                                                      reachable=False)])
    assert not none.commit and set(none.failed) == {"0", "1"}


def test_unreachable_instances_are_reported_but_do_not_block_the_version() -> None:
    out = decide([InstanceResult("0", loaded=True),
                  InstanceResult("1", loaded=False, reachable=False, error="no responders")])
    assert out.commit and out.loaded == ["0"] and out.failed == {"1": "no responders"}
    assert decide([]).commit


def lora_net() -> torch.nn.Module:
    cfg = ChorusConfig(models={"m": {"lora": {"r": 4}}},
                       agents={"solver": {"model": "m", "adapter": "sol"}, "verifier": {"model": "m", "adapter": "ver"}})
    return load_model(cfg, "m")


def trained_adapters() -> dict[str, torch.Tensor]:
    """Adapter tensors of a LoRA model moved away from version 0, as a trainer ships them."""
    net = lora_net()
    with torch.no_grad():
        for i, t in enumerate(shipped_tensors(net, lora=True).values()):
            t.add_(0.01 * (i + 1))
    return {k: v.detach().clone() for k, v in shipped_tensors(net, lora=True).items()}


def snapshot(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def test_an_adapter_only_update_loads_into_the_adapters_and_leaves_the_base_alone() -> None:
    sent = trained_adapters()
    header, buf = flatten("m", 3, sent)
    receiver = lora_net()
    before = snapshot(receiver)
    got_header, body = unpack(pack(header, buf))
    digest = load_into(shipped_tensors(receiver, lora=True), got_header, body)
    assert digest == header.checksum
    now = dict(receiver.named_parameters())
    assert all(torch.equal(now[k], sent[k]) for k in sent)
    base = [k for k in before if k not in sent]
    assert base and all(torch.equal(now[k], before[k]) for k in base)
    assert header.nbytes * 10 < sum(p.numel() * p.element_size() for p in receiver.parameters())


def test_a_shipped_tensor_the_receiver_lacks_is_refused_before_anything_is_written() -> None:
    sent = trained_adapters()
    sent["base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight"] = torch.zeros(4, 32)
    header, buf = flatten("m", 1, sent)
    receiver = lora_net()
    before = snapshot(receiver)
    with pytest.raises(ValueError, match="1 tensors the receiver does not have"):
        load_into(shipped_tensors(receiver, lora=True), header, buf)
    assert all(torch.equal(p, before[k]) for k, p in receiver.named_parameters())


def test_a_checksum_or_shape_mismatch_leaves_the_receiver_untouched() -> None:
    sent = trained_adapters()
    header, buf = flatten("m", 1, sent)
    receiver = lora_net()
    before = snapshot(receiver)
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_into(shipped_tensors(receiver, lora=True), dataclasses.replace(header, checksum="0" * 64), buf)
    last = list(sent)[-1]
    sent[last] = sent[last].reshape(-1)  # the same bytes under a different shape, in the last slot
    header, buf = flatten("m", 1, sent)
    with pytest.raises(ValueError, match=last):
        load_into(shipped_tensors(receiver, lora=True), header, buf)
    assert all(torch.equal(p, before[k]) for k, p in receiver.named_parameters())
