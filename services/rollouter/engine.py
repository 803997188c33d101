"""Batched sampling with a KV cache for a causal LM (torch backend of the rollouter).

Knows nothing of NATS: prompts in, token ids + behaviour log-probs out. Sampling settings and LoRA adapters
are per row, so requests with different settings and adapters share one forward pass per decode step.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from shared.models.loading import Tokenizer, context_length, shipped_tensors
from shared.models.tokenizer import ByteTokenizer

Finish = Literal["stop", "length"]
BASE_ADAPTER = "__base__"  # peft's row name for "no adapter" in a mixed-adapter batch


class UnknownAdapter(ValueError):
    """A row names an adapter the served model does not have."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one row; temperature 0 means greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the row ends once its decoded text contains one
    ignore_eos: bool = False  # run to max_new_tokens even past EOS (benchmarks: fixed output lengths)


@dataclass
class GenResult:
    """One row's continuation: ids (the stop token included when finish is "stop") and their log-probs."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Finish = "length"
    versions: list[int] = field(default_factory=list)  # weight version that sampled each token


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = ByteTokenizer.pad_id) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts into ``input_ids`` and ``attention_mask`` of shape [B, max_len]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids, mask


def behaviour_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probs of the distribution actually sampled from, per row.

    Greedy rows (T=0) use log_softmax of the raw logits; others log_softmax(logits / T), restricted to the
    top-p nucleus and renormalised when top_p < 1 (tokens outside the nucleus get -inf).
    """
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    nucleus = (top_p < 1.0) & ~greedy
    if bool(nucleus.any()):
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        probs = sorted_logp.exp()
        # keep a token if the mass strictly before it is < top_p (the top token is always kept)
        before = torch.cumsum(probs, dim=-1) - probs
        keep_sorted = before < top_p[:, None]
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        keep = keep | ~nucleus[:, None]
        logp = torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)
    return logp


def tail_has_stop(tokenizer: Tokenizer, ids: Sequence[int], stops: Sequence[str]) -> bool:
    """Whether the text the last token completed contains a stop string, decoding only the tail of ``ids``.

    Checked after every token, so a stop string can only be new if it ends in the last token's text: the
    decoded tail must cover that text plus the longest stop string. The window doubles until it does.
    """
    if not stops or not ids:
        return False
    need = max(len(s) for s in stops) + len(tokenizer.decode(ids[-1:]))
    width = need
    while True:
        text = tokenizer.decode(ids[-width:])
        if len(text) >= need or width >= len(ids):
            return any(s in text for s in stops)
        width *= 2


def peft_adapters(model: torch.nn.Module) -> tuple[str, ...]:
    """The LoRA adapters of a peft model, sorted; () for a plain model."""
    peft = sys.modules.get("peft")  # a model can only be a PeftModel if peft was imported to build it
    if peft is None or not isinstance(model, peft.PeftModel):
        return ()
    return tuple(sorted(model.peft_config))


class ServesAdapters:
    """An engine's check of the adapter a row names, against its ``adapters`` (a LoRA model's, or none)."""

    adapters: tuple[str, ...]
    lora: bool

    def check_adapter(self, adapter: str | None) -> None:
        """Raise :class:`UnknownAdapter` unless this engine can serve rows of ``adapter`` (None: the base)."""
        if adapter is None or adapter in self.adapters:
            return
        if not self.lora:
            raise UnknownAdapter(f"adapter {adapter!r} requested, but this model has no LoRA adapters "
                                 "(send adapter None, or add a `lora` section and an agent naming it)")
        raise UnknownAdapter(f"adapter {adapter!r} is not one of this model's adapters {list(self.adapters)}")


class TorchEngine(ServesAdapters):
    """A persistent inference engine around one causal LM; weights are replaced in place on load.

    A LoRA (peft) model serves every adapter at once: each row names its adapter and a decode step is one
    forward pass with ``adapter_names``. A row without an adapter runs on the base with adapters disabled.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer | None = None, *, version: int = 0,
                 seed: int = 0, max_batch: int = 64) -> None:
        # a Hugging Face (or peft) model: its submodules are reached by name, which torch's types cannot follow
        self.model: Any = cast(Any, model)
        self.model.eval()  # peft routes rows to adapters only in eval mode
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()  # type: ignore[assignment]
        self.adapters = peft_adapters(model)
        self.lora = bool(self.adapters)
        self.version = version
        self.max_batch = max_batch
        self.generator = torch.Generator().manual_seed(seed)
        self.rows_generated = 0
        self.tokens_generated = 0
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context = context_length(self.model)
        for what, tid in (("eos_id", self.tokenizer.eos_id), ("pad_id", self.tokenizer.pad_id)):
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"tokenizer {what} {tid} is outside the model's vocabulary [0, {self.vocab_size})")

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """What a weight update carries (every parameter, or only the adapters of a LoRA model), by name."""
        return shipped_tensors(self.model, lora=self.lora)

    def loaded(self, version: int) -> None:
        """A weight transport has written ``version`` into :meth:`named_tensors` (in place): serve it."""
        self.version = version

    def close(self) -> None:
        """Nothing to free beyond the model (the service's teardown)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 adapters: Sequence[str | None] | None = None) -> list[GenResult]:
        """Generate for every prompt (chunks of ``max_batch`` rows, one after the other); ``adapters`` per row."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling settings")
        rows: Sequence[str | None] = [None] * len(prompts) if adapters is None else adapters
        if len(rows) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(rows)} adapters")
        for a in set(rows):
            self.check_adapter(a)
        out: list[GenResult] = []
        for start in range(0, len(prompts), self.max_batch):
            stop = start + self.max_batch
            out.extend(self._generate_batch(prompts[start:stop], params[start:stop], rows[start:stop]))
        return out

    @torch.inference_mode()
    def _generate_batch(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                        adapters: Sequence[str | None]) -> list[GenResult]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        n = len(prompts)
        tok = self.tokenizer
        dev = next(self.model.parameters()).device
        ids, mask = (t.to(dev) for t in left_pad(prompts, tok.pad_id))
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        budget = torch.tensor([p.max_new_tokens for p in params], dtype=torch.long)
        greedy = temperature <= 0
        # stop table: EOS plus each row's own stop ids
        stop_table = torch.zeros((n, self.vocab_size), dtype=torch.bool, device=dev)
        stop_table[:, tok.eos_id] = True
        for i, p in enumerate(params):
            if p.ignore_eos:
                stop_table[i, tok.eos_id] = False
            valid = [s for s in p.stop_ids if 0 <= s < stop_table.shape[1]]
            if valid:
                stop_table[i, valid] = True
        text_stops = {i: p.stop for i, p in enumerate(params) if p.stop}
        routing = {"adapter_names": [a or BASE_ADAPTER for a in adapters]} if self.lora else {}

        results = [GenResult() for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        step_input, step_pos, past = ids, positions, None
        for step in range(int(budget.max())):
            out = self.model(input_ids=step_input, attention_mask=mask, position_ids=step_pos,
                             past_key_values=past, use_cache=True, **routing)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            logp = behaviour_logprobs(logits, temperature, top_p)
            sampled = torch.multinomial(logp.exp().cpu(), 1, generator=self.generator).squeeze(-1).to(dev)
            token = torch.where(greedy, logits.argmax(-1), sampled)
            token_logp = logp.gather(-1, token[:, None]).squeeze(-1)

            active = ~done
            hit_stop = stop_table[torch.arange(n, device=dev), token]
            for i in torch.nonzero(active).flatten().tolist():
                results[i].ids.append(int(token[i]))
                results[i].logprobs.append(float(token_logp[i]))
                if i in text_stops and not hit_stop[i] and tail_has_stop(tok, results[i].ids, text_stops[i]):
                    hit_stop[i] = True
            finished_stop = active & hit_stop
            finished_len = active & ~hit_stop & (budget.to(dev) <= step + 1)
            for i in torch.nonzero(finished_stop).flatten().tolist():
                results[i].finish = "stop"
            done = done | finished_stop | finished_len
            if bool(done.all()):
                break
            # finished rows keep decoding PAD (ignored) so the batch shape stays fixed
            step_input = torch.where(done, torch.full_like(token, tok.pad_id), token)[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=-1)
        for r in results:
            r.versions = [self.version] * len(r.ids)
        self.rows_generated += n
        self.tokens_generated += sum(len(r.ids) for r in results)
        return results
