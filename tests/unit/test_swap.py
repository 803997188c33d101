"""Swappable learner state (FlexMARL §6.2): a learner whose state is exported after every micro-batch and imported
into a fresh learner of the same model continues bit for bit as one that never swapped."""

from __future__ import annotations

import pytest
import torch

from services.trainer.learner import Learner
from services.trainer.swap import SwapMeta, export_state, import_state, state_bytes
from tests.unit.test_learner import make_cfg, make_lora_cfg, make_sample


def _snapshot(learner: Learner) -> dict[str, torch.Tensor]:
    """Trainable tensors and AdamW's moments and step counters, cloned."""
    out = {f"w/{n}": p.detach().clone() for n, p in learner.net.named_parameters() if p.requires_grad}
    for n, p in learner.net.named_parameters():
        for k, v in learner.optimizer.state.get(p, {}).items():
            out[f"o/{k}/{n}"] = v.clone()
    return out


def _micro_batches(adapters: list[str | None], count: int, size: int) -> list[list]:
    out = []
    for b in range(count):
        batch = []
        for j in range(size):
            i = b * size + j
            s = make_sample(i, prompt_len=2 + i % 3, resp_len=2 + i % 4, reward=float((i * 7) % 5) / 4)
            batch.append(s.model_copy(update={"adapter": adapters[i % len(adapters)]}))
        out.append(batch)
    return out


def _train(make, batches, swap: bool) -> tuple[Learner, list[float]]:
    """Micro-batch after micro-batch (a step at every global batch); with ``swap`` the state leaves after every
    micro-batch and the next one runs on a freshly built learner that takes it in."""
    torch.manual_seed(0)
    learner = make()
    losses = []
    for mb in batches:
        losses.append(learner.micro_batch(mb, list(range(len(mb))), "grpo"))
        result = learner.step()
        if result is not None:
            losses.append(result.loss)
        if swap:
            header, buf, meta = export_state(learner, checksums=True)
            assert header.nbytes == state_bytes(learner)
            data = bytes(buf[: header.nbytes])  # the buffer leaves the learner; meta travels pickled
            meta = SwapMeta.unpack(meta.pack())
            del learner
            learner = make()
            torch.manual_seed(12345)  # the fresh learner's own RNG is overwritten by the swapped one
            import_state(learner, header, memoryview(data), meta, verify=True)
    return learner, losses


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_swapping_after_every_micro_batch_is_bit_identical_to_never_swapping(tmp_path, kind):
    if kind == "full":
        cfg = make_cfg(tmp_path, global_batch=8, train_extra=", entropy_coef: 0.01")
        adapters: list[str | None] = [None]
    else:
        cfg = make_lora_cfg(tmp_path, global_batch=8)
        adapters = list(cfg.adapters_of("m"))
    torch.set_num_threads(1)
    batches = _micro_batches(adapters, count=8, size=4)  # 4 optimizer steps, two micro-batches each
    stay, losses_stay = _train(lambda: Learner(cfg, "m"), batches, swap=False)
    moved, losses_moved = _train(lambda: Learner(cfg, "m"), batches, swap=True)
    assert stay.version == moved.version == 4
    assert losses_moved == losses_stay
    a, b = _snapshot(stay), _snapshot(moved)
    assert a.keys() == b.keys()
    assert any(k.startswith("o/exp_avg/") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if kind == "lora":  # the frozen base is not in the state, and did not move
        assert all("lora_" in k for k in a if k.startswith("w/"))


def test_a_swap_in_the_middle_of_a_global_batch_carries_the_accumulated_gradients(tmp_path):
    cfg = make_cfg(tmp_path, global_batch=8)
    torch.manual_seed(0)
    src = Learner(cfg, "m")
    mb = _micro_batches([None], 1, 4)[0]
    src.micro_batch(mb, list(range(4)), "grpo")
    header, buf, meta = export_state(src)
    assert any(s.name.startswith("g/") for s in header.slots)
    dst = Learner(cfg, "m")
    assert dst.accumulated == 0 and all(p.grad is None for p in dst.net.parameters())
    import_state(dst, header, buf, meta)
    assert dst.accumulated == 4
    for (n, p), q in zip(src.net.named_parameters(), dst.net.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_a_state_of_another_model_is_refused_before_anything_is_copied(tmp_path):
    cfg = make_cfg(tmp_path)
    other = make_lora_cfg(tmp_path)
    header, buf, meta = export_state(Learner(other, "m"))
    target = Learner(cfg, "m")
    before = _snapshot(target)
    with pytest.raises(ValueError, match="does not train|lacks"):
        import_state(target, header, buf, meta)
    after = _snapshot(target)
    assert all(torch.equal(before[k], after[k]) for k in before)
