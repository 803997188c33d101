"""Continuous batching for a Llama-family causal LM: rows join and leave the running batch at every decode step.

Knows nothing of NATS or asyncio: the rollouter's batcher calls :meth:`ContinuousEngine.step` on its worker
thread, handing it new rows, and gets back the rows that finished. :meth:`ContinuousEngine.generate` runs a
whole queue of requests to the end (tests, benchmarks).

- **KV pool.** Each running row owns one slot of a preallocated per-layer key/value pool
  ``[rows, kv_heads, length, head_dim]``; the running rows occupy slots ``0..B-1`` (a leaving row's slot is
  filled by moving another row into it), so a decode step attends over a view of the pool, never a copy.
  Rows are kept grouped by LoRA adapter in slot order, so every adapter's rows are one contiguous slice and a
  LoRA projection adds ``B·A·x`` on slices, with no gather per module. The pool grows (rows and length) on
  demand up to ``max_batch`` rows; ``max_tokens`` bounds the KV reserved by the rows in flight
  (prompt + ``max_new_tokens`` each).
- **Prefill once.** Rows waiting to start with the same adapter and prompt (a GRPO group's copies) share one
  prefill, whose KV is copied into each row's slot. A prefix cache keeps the KV of recent prompts: a prompt
  that starts like a cached one (a shared system prompt) prefills only what follows the common prefix.
- **Logits only where a token is sampled:** the LM head runs on the last position of a prefill and on the one
  new position of each decoding row.
- **Few-row products (CPU).** How a product of a few token rows runs (``F.linear``, ``W @ X^T``, oneDNN or
  Chorus's own kernel, on rows padded with zeros or not) is measured per weight shape when the engine starts
  (:mod:`.kernels`);
  :meth:`ContinuousEngine.kernel_choices` says what was chosen.
- **Versions.** Every token records the weight version that sampled it. When the weights change in place
  (a sync in ``interrupt`` mode), every running row's KV is recomputed under the new weights before its next
  token (a prefill of its prompt and the tokens it has so far), so each token's log-prob is exactly that of
  the weights named by its version.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from services.rollouter.engine import (
    BASE_ADAPTER,
    GenResult,
    SamplingParams,
    ServesAdapters,
    behaviour_logprobs,
    peft_adapters,
    tail_has_stop,
)
from services.rollouter.kernels import KernelPlan, planned_linear
from services.rollouter.speculate import PromptLookup, Speculation, verify
from shared.models.loading import Tokenizer, context_length, shipped_tensors
from shared.models.tokenizer import ByteTokenizer

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
LENGTH_STEP = 64  # the pool's length grows in multiples of this
PREFIX_ENTRIES = 32  # prompts kept in the prefix cache
GAP_EMA = 0.9  # the learnt cost of a step beyond its products follows the last steps
DRAFT_DECAY = 0.7  # a row's acceptance estimate weighs its last verifications most
MERGE_MAX = 16  # a starting row's last tokens computed in the step's shared forward; more are prefilled apart
# Matrix products of a few token rows (CPU): no fixed rule is fastest on every CPU (SmolLM2's LM head, one
# thread: on an AVX2 Xeon ``W @ X^T`` of 2 rows took 5.9 ms against 10.1 ms for ``F.linear`` of 1; on an
# AVX-512/AMX Xeon ``F.linear`` of 1, 2, 4 rows 11.8, 12.4, 21.4 ms against 11.3, 27.6, 27.0 ms). So each
# weight shape's choice for 1..PLAN_ROWS rows is timed when the engine starts (services/rollouter/kernels.py).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Unsupported(ValueError):
    """The network is not one this engine computes itself (the static engine serves it)."""


def support_problem(model: torch.nn.Module) -> str | None:
    """Why :class:`ContinuousEngine` cannot run ``model``, or None when it can."""
    inner = _inner(model)
    cfg = getattr(inner, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED:
        return f"model type {kind!r} is not one of {list(SUPPORTED)}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", kind != "qwen2"):
        return "sliding-window attention is not supported"
    for name, mod in inner.named_modules():
        if _is_lora(mod) and getattr(mod, "lora_variant", None):
            return f"{name}: LoRA variants (DoRA, ...) are not supported"
    return None


def _inner(model: torch.nn.Module) -> Any:
    """The causal LM under a peft wrapper (or the model itself)."""
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def _is_lora(mod: torch.nn.Module) -> bool:
    return hasattr(mod, "base_layer") and hasattr(mod, "lora_A") and hasattr(mod, "scaling")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class Row:
    """One generation in flight; ``handle`` is the caller's (the batcher's job and row index)."""

    prompt: list[int]
    params: SamplingParams
    adapter: str | None
    handle: Any = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = "length"
    kv_len: int = 0  # tokens whose keys/values are in the slot (all but ``pending``)
    pending: list[int] = field(default_factory=list)  # tokens the next forward pass computes (the last sampled)
    cache_key: tuple[str | None, tuple[int, ...]] | None = None  # prefix-cache entry to make after the forward
    kv_version: int | None = None  # weights the slot's KV was computed with; None before the first prefill
    stop_ids: frozenset[int] = frozenset()
    slot: int = -1
    admitted_at: float = 0.0
    lookup: PromptLookup | None = None  # n-gram index of its tokens, built when it first speculates
    draft: list[int] = field(default_factory=list)  # this step's draft tokens (after the last sampled one)
    draft_kept: float = 0.0  # draft tokens kept, and draft positions decided, lately (decayed): its acceptance
    draft_seen: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.ids

    @property
    def reserve(self) -> int:
        """KV positions this row may need: its prompt and every token it may generate."""
        return len(self.prompt) + self.params.max_new_tokens

    def result(self) -> GenResult:
        return GenResult(ids=self.ids, logprobs=self.logprobs, finish=self.finish,  # type: ignore[arg-type]
                         versions=self.versions)


class Stepwise(ServesAdapters):
    """What the continuous batcher needs of an engine besides ``step``, ``check_fits`` and ``reset``: rows made and
    checked, whether rows are in flight, and a whole queue run to the end (tests, benchmarks). Chorus's
    continuous engine and the vLLM backend share it."""

    tokenizer: Tokenizer
    running: list[Row]
    waiting: deque[Row]

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        raise NotImplementedError

    def step(self, new_rows: Iterable[Row] = ()) -> list[Row]:
        raise NotImplementedError

    def row(self, prompt: Sequence[int], params: SamplingParams, adapter: str | None = None,
            handle: Any = None) -> Row:
        """A row ready to hand to :meth:`step` (checked: adapter, budget)."""
        self.check_adapter(adapter)
        self.check_fits(len(prompt), params)
        stops = {int(s) for s in params.stop_ids}
        if not params.ignore_eos:
            stops.add(self.tokenizer.eos_id)
        return Row(list(prompt), params, adapter, handle, stop_ids=frozenset(stops))

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def rows_in_flight(self) -> int:
        return len(self.running) + len(self.waiting)

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 adapters: Sequence[str | None] | None = None) -> list[GenResult]:
        """Queue every prompt and step until all are done; results in the order of ``prompts``."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling settings")
        names: Sequence[str | None] = [None] * len(prompts) if adapters is None else adapters
        if len(names) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(names)} adapters")
        rows = [self.row(p, s, a, handle=i) for i, (p, s, a) in enumerate(zip(prompts, params, names, strict=True))]
        out: list[GenResult | None] = [None] * len(rows)
        pending: list[Row] = rows
        while pending or self.busy:
            for r in self.step(pending):
                out[r.handle] = r.result()
            pending = []
        return [r if r is not None else GenResult() for r in out]


class ContinuousEngine(Stepwise):
    """A persistent continuous-batching engine around one Llama-family causal LM (optionally peft LoRA)."""

    name = "continuous"  # what the rollouter's metrics call it

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer | None = None, *, version: int = 0,
                 seed: int = 0, max_batch: int = 64, max_tokens: int = 0,
                 prefix_entries: int = PREFIX_ENTRIES, plan_kernels: bool = True,
                 speculate: Speculation | None = None) -> None:
        why = support_problem(model)
        if why is not None:
            raise Unsupported(why)
        self.model = model.eval()
        self.inner = _inner(model)
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()  # type: ignore[assignment]
        self.adapters = peft_adapters(model)
        self.lora = bool(self.adapters)
        self.version = version
        self.max_batch = max_batch
        self.speculate = speculate if speculate is not None else Speculation()
        self.generator = torch.Generator().manual_seed(seed)
        self.rows_generated = 0
        self.tokens_generated = 0
        lm = self.inner
        # the decoder's parts, reached by the names Hugging Face gives them (untyped for torch)
        self.body: Any = lm.model
        self.layers: list[Any] = list(self.body.layers)
        self.lm_head: Any = lm.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.context = context_length(lm)
        cfg = lm.config
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.max_tokens = max_tokens or max_batch * (self.context or 4096)
        param = next(lm.parameters())
        self.device, self.dtype = param.device, param.dtype
        for what, tid in (("eos_id", self.tokenizer.eos_id), ("pad_id", self.tokenizer.pad_id)):
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"tokenizer {what} {tid} is outside the model's vocabulary [0, {self.vocab_size})")
        norm = self.body.norm
        self._plan_kernels = plan_kernels
        self._plan_choices()
        self._fused_norm = (self.dtype == torch.float32 and type(norm).__name__.endswith("RMSNorm")
                            and hasattr(norm, "variance_epsilon"))
        self._order = {a: i for i, a in enumerate((None, *self.adapters))}  # slot order of the adapter groups
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []  # by slot
        self.reserved = 0
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._cap_rows = 0
        self._cap_len = 0
        self._prefix: OrderedDict[tuple[str | None, tuple[int, ...]], tuple[int, list[torch.Tensor],
                                                                            list[torch.Tensor]]] = OrderedDict()
        self.prefix_entries = prefix_entries
        self.stats = {"steps": 0, "prefills": 0, "prefill_tokens": 0, "shared_prefills": 0, "prefix_hits": 0,
                      "prefix_tokens_saved": 0, "reprefills": 0, "decode_row_steps": 0,
                      "merged_prefill_tokens": 0, "spec_steps": 0, "draft_tokens": 0, "accepted_tokens": 0}

    # --- the API the batcher uses -------------------------------------------------------------
    def named_tensors(self) -> dict[str, torch.Tensor]:
        return shipped_tensors(self.model, lora=self.lora)

    def loaded(self, version: int) -> None:
        """A weight transport has written ``version`` into :meth:`named_tensors` (in place): serve it; running
        rows recompute their KV under it before their next token."""
        self.version = version

    def close(self) -> None:
        """Nothing to free beyond the model and the KV pool (the service's teardown)."""

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise ValueError if one row of this shape could never be admitted (over the KV budget or context)."""
        need = prompt_len + params.max_new_tokens
        if need > self.max_tokens:
            raise ValueError(f"a row of {prompt_len} prompt + {params.max_new_tokens} new tokens needs {need} KV "
                             f"positions, more than the rollouter's budget rollouter.max_tokens={self.max_tokens}")
        if prompt_len == 0:
            raise ValueError("every prompt needs at least one token")

    @torch.inference_mode()
    def step(self, new_rows: Iterable[Row] = ()) -> list[Row]:
        """Admit what fits (FIFO), start the rows that need it, and sample one token for every running row.

        Returns the rows that finished in this step (their slots are free again).
        """
        self.waiting.extend(new_rows)
        self._admit()
        stale = [r for r in self.running if r.kv_version != self.version]
        if stale:
            self._start(stale)
        if self.running:
            t0 = time.perf_counter()
            finished = self._forward()
            self._observe(time.perf_counter() - t0)
        else:
            finished = []
        self.stats["steps"] += 1
        return finished

    def reset(self) -> list[Row]:
        """Drop every row (waiting and running); returns them (their callers are told by the batcher)."""
        rows = list(self.waiting) + list(self.running)
        self.waiting.clear()
        self.running = []
        self.reserved = 0
        return rows

    # --- admission and slots ------------------------------------------------------------------
    def _admit(self) -> None:
        now = time.monotonic()
        while self.waiting and len(self.running) < self.max_batch:
            row = self.waiting[0]
            if self.running and self.reserved + row.reserve > self.max_tokens:
                break  # FIFO: nothing overtakes the head of the queue, so a long row never starves
            self.waiting.popleft()
            self.reserved += row.reserve
            row.admitted_at = now
            self._ensure(len(self.running) + 1, row.reserve)
            self._insert(row)

    def _ensure(self, rows: int, length: int) -> None:
        """Grow the pool to at least ``rows`` slots of ``length`` positions (copying what is there)."""
        length = min(length, self.context) if self.context else length
        if rows <= self._cap_rows and length <= self._cap_len:
            return
        new_rows = max(self._cap_rows, min(self.max_batch, max(rows, 2 * self._cap_rows, 1)))
        new_len = max(self._cap_len, -(-length // LENGTH_STEP) * LENGTH_STEP)
        shape = (new_rows, self.n_kv, new_len, self.head_dim)
        ks, vs = [], []
        for i in range(len(self.layers)):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self._k:
                n = len(self.running)
                k[:n, :, : self._cap_len] = self._k[i][:n]
                v[:n, :, : self._cap_len] = self._v[i][:n]
            ks.append(k)
            vs.append(v)
        self._k, self._v = ks, vs
        self._cap_rows, self._cap_len = new_rows, new_len

    def _move(self, src: int, dst: int) -> None:
        """Move the row in slot ``src`` (with its KV) to slot ``dst``."""
        row = self.running[src]
        n = row.kv_len
        if n:
            for k, v in zip(self._k, self._v, strict=True):
                k[dst, :, :n] = k[src, :, :n]
                v[dst, :, :n] = v[src, :, :n]
        self.running[dst] = row
        row.slot = dst

    def _group_bounds(self) -> list[tuple[str | None, int, int]]:
        """(adapter, first slot, end slot) of each adapter's contiguous run of rows."""
        out: list[tuple[str | None, int, int]] = []
        for i, r in enumerate(self.running):
            if out and out[-1][0] == r.adapter:
                out[-1] = (r.adapter, out[-1][1], i + 1)
            else:
                out.append((r.adapter, i, i + 1))
        return out

    def _insert(self, row: Row) -> None:
        """Give ``row`` the slot at the end of its adapter's group: each later group shifts right by one, moving
        its first row to the slot after its last."""
        key = self._order[row.adapter]
        bounds = self._group_bounds()
        self.running.append(row)
        hole = len(self.running) - 1
        for adapter, start, _end in reversed(bounds):
            if self._order[adapter] <= key:
                break
            self._move(start, hole)
            hole = start
        self.running[hole] = row
        row.slot = hole

    def _remove(self, row: Row) -> None:
        """Free ``row``'s slot, keeping slots 0..B-1 full and groups contiguous (one move per later group)."""
        hole = row.slot
        bounds = self._group_bounds()
        for _adapter, _start, end in bounds:
            if end <= hole:
                continue
            last = end - 1
            if last != hole:
                self._move(last, hole)
            hole = last
        self.running.pop()
        assert hole == len(self.running), (hole, len(self.running))
        self.reserved -= row.reserve
        row.slot = -1

    # --- the network --------------------------------------------------------------------------
    def _plan_choices(self) -> None:
        """Measure (or find cached) the kernel plan of every plain ``nn.Linear`` the engine multiplies by."""
        named: list[tuple[str, Any]] = []
        for layer in self.layers:
            for part in (layer.self_attn, layer.mlp):
                for name in PROJECTIONS:
                    mod = getattr(part, name, None)
                    if mod is not None:
                        named.append((name, mod.base_layer if _is_lora(mod) else mod))
        named.append(("head", self.lm_head))
        named = [(n, m) for n, m in named if type(m) is torch.nn.Linear]
        self.kernels = KernelPlan(((n, m.weight) for n, m in named),
                                  enabled=self._plan_kernels and self.device.type == "cpu")
        self._choices = {m: self.kernels.choices(m.weight) for _, m in named}
        # What a forward pass of t positions costs in matrix products, t = 1..PLAN_ROWS, from the plan's own
        # timings (every projection of every layer and the head): the price of a draft on this CPU.
        costs = [self.kernels.cost(m.weight) for _, m in named]
        known = [c for c in costs if c is not None]
        if costs and len(known) == len(costs):
            self._step_cost: list[float] | None = [sum(c[t] for c in known) for t in range(len(known[0]))]
            self._gap = 2.0 * self._step_cost[1]  # until steps are observed: streaming the weights, about 3x
        else:
            self._step_cost = None
            self._gap = 0.0
        self._positions = 0

    def kernel_choices(self) -> dict[str, str]:
        """Per weight shape (``"49152x576 head"``), how 1..16 rows are multiplied: ``"t:method"``, ``@r`` when
        padded to r rows; empty on CUDA or with the plan off."""
        return self.kernels.summary()

    def _linear(self, x: torch.Tensor, layer: Any) -> torch.Tensor:
        """``layer(x)`` for a plain ``nn.Linear`` the way the kernel plan says for ``x``'s row count."""
        if type(layer) is not torch.nn.Linear:
            return layer(x)
        return planned_linear(x, layer.weight, layer.bias, self._choices.get(layer))

    def _proj(self, mod: Any, x: torch.Tensor, groups: Sequence[tuple[str | None, int, int]]) -> torch.Tensor:
        """``mod(x)`` for rows (tokens) grouped by adapter: the base once, each adapter's delta on its slice."""
        if not _is_lora(mod):
            return self._linear(x, mod)
        y = self._linear(x, mod.base_layer)
        for adapter, s, e in groups:
            if adapter is None or adapter not in mod.lora_A or getattr(mod, "disable_adapters", False):
                continue
            xs = x[s:e]
            y[s:e] += mod.lora_B[adapter](mod.lora_A[adapter](xs.to(mod.lora_A[adapter].weight.dtype))).to(y.dtype) \
                * mod.scaling[adapter]
        return y

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, groups: Sequence[tuple[str | None, int, int]],
             attend: Any) -> torch.Tensor:
        """The decoder over flat tokens ``ids`` [T] at ``positions`` [T]; returns the final-norm hidden states [T, H].

        ``attend(layer, q, k, v)`` writes k/v [T, kv, D] into the pool and returns attention outputs [T, heads, D].
        """
        h = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(h[None], positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]
        t = ids.shape[0]
        if torch.get_num_threads() != self.kernels.threads and self.kernels.enabled:
            self._plan_choices()  # the plan is per thread count
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = self._norm(layer.input_layernorm, h)
            q = self._proj(attn.q_proj, x, groups).view(t, -1, self.head_dim)
            k = self._proj(attn.k_proj, x, groups).view(t, -1, self.head_dim)
            v = self._proj(attn.v_proj, x, groups).view(t, -1, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = attend(li, q, k, v).reshape(t, -1)
            h = h + self._proj(attn.o_proj, o, groups)
            x = self._norm(layer.post_attention_layernorm, h)
            mlp = layer.mlp
            gate = self._proj(mlp.gate_proj, x, groups)
            up = self._proj(mlp.up_proj, x, groups)
            h = h + self._proj(mlp.down_proj, mlp.act_fn(gate) * up, groups)
        return self._norm(self.body.norm, h)

    def _norm(self, mod: Any, x: torch.Tensor) -> torch.Tensor:
        """An RMSNorm in one fused op where it computes what the module does (float32), else the module."""
        if self._fused_norm:
            return F.rms_norm(x, (x.shape[-1],), mod.weight, mod.variance_epsilon)
        return mod(x)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.lm_head).float()

    # --- prefill ------------------------------------------------------------------------------
    def _start(self, rows: Sequence[Row]) -> None:
        """Rows whose slot holds no KV of the current weights (new, or interrupted by a load): reuse the longest
        cached prefix, and leave only a few tokens ``pending`` for the step's one forward pass.

        Rows with the same adapter and tokens (a GRPO group's copies) share the work: the first computes, the
        others copy its KV. A long remainder (over ``MERGE_MAX`` tokens), or one shared by copies, is
        prefilled apart, all but its last token, so the step's forward pads its queries to a few at most.
        """
        if any(v != self.version for v, _, _ in self._prefix.values()):
            self._prefix.clear()  # KV of other weights
        by_key: dict[tuple[str | None, tuple[int, ...]], list[Row]] = {}
        for r in rows:
            if r.kv_version is not None:
                self.stats["reprefills"] += 1
            by_key.setdefault((r.adapter, tuple(r.tokens)), []).append(r)
        for (adapter, tokens), group in by_key.items():
            first = group[0]
            start = self._reuse_prefix(first, adapter, tokens)
            if len(tokens) - start > MERGE_MAX or (len(group) > 1 and len(tokens) - start > 1):
                self._prefill_apart(first, adapter, tokens, start, len(tokens) - 1)
                start = len(tokens) - 1
                self._remember(first, (adapter, tokens[:start]), start)  # rows starting later in this step
            first.cache_key = (adapter, tokens)
            for r in group:
                if r is not first and start:
                    for k, v in zip(self._k, self._v, strict=True):
                        k[r.slot, :, :start] = k[first.slot, :, :start]
                        v[r.slot, :, :start] = v[first.slot, :, :start]
                    self.stats["shared_prefills"] += 1
                r.kv_len = start
                r.pending = list(tokens[start:])
                r.kv_version = self.version

    def _reuse_prefix(self, row: Row, adapter: str | None, tokens: tuple[int, ...]) -> int:
        """Copy the longest cached prefix of ``tokens`` (at most all but one) into ``row``'s slot; its length."""
        n = len(tokens)
        start = 0
        hit = None
        for key, (_version, ks, vs) in self._prefix.items():
            if key[0] != adapter:
                continue
            cached = key[1]
            m = 0
            limit = min(len(cached), n - 1)
            while m < limit and cached[m] == tokens[m]:
                m += 1
            if m > start:
                start, hit = m, (key, ks, vs)
        if hit is not None:
            key, ks, vs = hit
            self._prefix.move_to_end(key)
            for k, v, ck, cv in zip(self._k, self._v, ks, vs, strict=True):
                k[row.slot, :, :start] = ck[:, :start]
                v[row.slot, :, :start] = cv[:, :start]
            self.stats["prefix_hits"] += 1
            self.stats["prefix_tokens_saved"] += start
        return start

    def _prefill_apart(self, row: Row, adapter: str | None, tokens: tuple[int, ...], start: int, end: int) -> None:
        """KV of ``tokens[start:end]`` into ``row``'s slot, after the ``start`` already there (one forward, no logits)."""
        slot = row.slot
        ids = torch.tensor(tokens[start:end], dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device)
        mask = (torch.arange(end, device=self.device)[None, :] <= positions[:, None])[None, None] if start else None

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kp, vp = self._k[li], self._v[li]
            kp[slot, :, start:end] = k.transpose(0, 1)
            vp[slot, :, start:end] = v.transpose(0, 1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kp[slot : slot + 1, :, :end],
                                                 vp[slot : slot + 1, :, :end], attn_mask=mask,
                                                 is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads)
            return out[0].transpose(0, 1)

        self._run(ids, positions, [(adapter, 0, end - start)], attend)
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += end - start

    def _remember(self, row: Row, key: tuple[str | None, tuple[int, ...]] | None, n: int) -> None:
        """Keep the KV of the first ``n`` tokens in ``row``'s slot in the prefix cache under ``key``."""
        if key is None or not self.prefix_entries or n <= 0:
            return
        self._prefix[key] = (self.version, [k[row.slot, :, :n].clone() for k in self._k],
                             [v[row.slot, :, :n].clone() for v in self._v])
        self._prefix.move_to_end(key)
        while len(self._prefix) > self.prefix_entries:
            self._prefix.popitem(last=False)

    # --- the step's forward pass --------------------------------------------------------------
    def _forward(self) -> list[Row]:
        """One forward pass over every running row's pending tokens (one for a decoding row, a prompt's last
        few for a row that just started), the logits of each row's last position, one token sampled per row."""
        rows = self.running
        b = len(rows)
        drafted = self._draft(rows)
        counts = [len(r.pending) for r in rows]
        n_max = max(counts)
        dev = self.device
        flat = [t for r in rows for t in r.pending]
        self._positions = len(flat)
        ids = torch.tensor(flat, dtype=torch.long, device=dev)
        base = torch.tensor([r.kv_len for r in rows], dtype=torch.long, device=dev)
        counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
        row_of = torch.repeat_interleave(torch.arange(b, device=dev), counts_t)
        ends = torch.cumsum(counts_t, 0)
        offset = torch.arange(len(flat), device=dev) - (ends - counts_t)[row_of]
        pos = base[row_of] + offset
        width = int((base + counts_t).max())
        # query i of row r sees key j when j <= kv_len_r + i (its own past and its earlier pending tokens)
        limit = base[:, None] + torch.arange(n_max, device=dev)[None, :]  # [B, n_max]
        mask = (torch.arange(width, device=dev)[None, None, :] <= limit[:, :, None])[:, None]  # [B,1,n_max,W]
        # Grouped-query attention: the query heads that share a key/value head attend as one group of rows
        # ([B, kv, rep * n_max, D]) over that head's keys, rather than over keys repeated for every query head
        # (what SDPA's enable_gqa does on CPU): about 30% less time in attention at batch 8 here.
        rep = self.n_heads // self.n_kv
        if rep > 1 and n_max > 1:
            mask = mask.repeat(1, 1, rep, 1)  # rows (r, i) in the order of the grouped queries
        cum = [0]
        for c in counts:
            cum.append(cum[-1] + c)
        groups = [(a, cum[s], cum[e]) for a, s, e in self._group_bounds()]

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kp, vp = self._k[li], self._v[li]
            kp[row_of, :, pos] = k
            vp[row_of, :, pos] = v
            if n_max == 1:
                qb = q[:, :, None, :]
            else:
                qb = q.new_zeros((b, n_max, q.shape[1], q.shape[2]))
                qb[row_of, offset] = q
                qb = qb.transpose(1, 2)
            heads = qb.shape[1]
            if rep > 1:
                qb = qb.reshape(b, heads // rep, rep * n_max, qb.shape[-1])
            out = F.scaled_dot_product_attention(qb, kp[:b, :, :width], vp[:b, :, :width], attn_mask=mask)
            out = out.view(b, heads, n_max, out.shape[-1])
            if n_max == 1:
                return out[:, :, 0, :]
            return out.transpose(1, 2)[row_of, offset]

        hidden = self._run(ids, pos, groups, attend)
        if drafted:  # the logits of a drafting row's last sampled token and of each of its draft tokens
            end_list = ends.tolist()
            pick = torch.tensor([i for r, e in zip(rows, end_list, strict=True)
                                 for i in range(e - 1 - len(r.draft), e)], dtype=torch.long, device=dev)
        else:
            pick = ends - 1
        for r, c in zip(rows, counts, strict=True):
            r.kv_len += c
            r.pending = []
            if r.cache_key is not None:
                self._remember(r, r.cache_key, r.kv_len)
                r.cache_key = None
        self.stats["decode_row_steps"] += b
        self.stats["merged_prefill_tokens"] += len(flat) - b - drafted
        logits = self._logits(hidden[pick])
        if drafted:
            return self._sample_drafts(list(rows), logits)
        return self._sample(list(rows), logits)

    def _draft(self, rows: Sequence[Row]) -> int:
        """Give decoding rows prompt-lookup drafts (appended to their pending token) when few rows are in flight
        (:mod:`.speculate`); returns the draft tokens in all.

        How many: draft position m of a row is worth ``a^m`` expected tokens, ``a`` the row's recent acceptance
        (1/2 before it has any); positions are taken best first, and the step computes the number of them that
        gives the most expected tokens per unit of the step's cost (:meth:`_cost`), within ``step_tokens``.
        """
        spec = self.speculate
        if not spec.on or len(rows) > spec.max_rows:
            return 0
        used = sum(len(r.pending) for r in rows)
        budget = spec.step_tokens - used
        wants: list[list[int]] = []
        gains: list[tuple[float, int]] = []  # (expected tokens, row index) of each draft position
        for i, r in enumerate(rows):
            r.draft = []
            k = 0
            if len(r.pending) == 1 and r.cache_key is None and budget > 0:
                k = min(spec.draft_tokens, r.params.max_new_tokens - len(r.ids) - 1)
                if self.context:
                    k = min(k, self.context - len(r.prompt) - len(r.ids) - 1)
            if k <= 0:
                wants.append([])
                continue
            if r.lookup is None:
                r.lookup = PromptLookup(r.prompt + r.ids, spec.ngram_min, spec.ngram_max)
            want = r.lookup.draft(k)
            wants.append(want)
            a = min((r.draft_kept + 1.0) / (r.draft_seen + 2.0), 0.95)
            gains += [(a ** (m + 1), i) for m in range(len(want))]
        if not gains or budget <= 0:
            return 0
        gains.sort(key=lambda g: -g[0])
        gains = gains[:budget]
        base_cost = self._cost(used)
        best_n, best_rate, expected = 0, len(rows) / base_cost, float(len(rows))
        for n, (g, _) in enumerate(gains, start=1):
            expected += g
            rate = expected / self._cost(used + n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        sizes = [0] * len(rows)
        for _, i in gains[:best_n]:
            sizes[i] += 1
        total = 0
        for r, w, n in zip(rows, wants, sizes, strict=True):
            if n:
                r.draft = w[:n]
                r.pending = r.pending + r.draft
                total += n
        if total:
            self.stats["spec_steps"] += 1
            self.stats["draft_tokens"] += total
        return total

    def _cost(self, positions: int) -> float:
        """Seconds a step of ``positions`` tokens is expected to take: the kernel plan's matrix products plus what
        the plan does not see (weights streamed from memory rather than from a warm cache, attention, norms,
        sampling), learnt from the steps run (:meth:`_observe`). Where nothing was measured (CUDA, plan off): a
        pass that grows by a sixteenth per position."""
        cost = self._step_cost
        if cost is None:
            return 1.0 + (positions - 1) / 16.0
        if positions >= len(cost):
            return (cost[-1] + self._gap) * positions / (len(cost) - 1)
        return cost[positions] + self._gap

    def _observe(self, seconds: float) -> None:
        """Learn the part of a step the kernel plan does not predict, from a step that fits the plan."""
        cost = self._step_cost
        if cost is None or not 0 < self._positions < len(cost):
            return
        gap = max(seconds - cost[self._positions], 0.0)
        self._gap = GAP_EMA * self._gap + (1 - GAP_EMA) * gap

    def _sample(self, rows: Sequence[Row], logits: torch.Tensor) -> list[Row]:
        """Sample one token per row from ``logits`` [n, V], record it, and retire the rows that end."""
        temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=logits.device)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=logits.device)
        greedy = temperature <= 0
        logp = behaviour_logprobs(logits, temperature, top_p)
        if bool(greedy.all()):
            token = logits.argmax(-1)
        else:
            sampled = torch.multinomial(logp.exp().cpu(), 1, generator=self.generator).squeeze(-1).to(logits.device)
            token = torch.where(greedy, logits.argmax(-1), sampled)
        token_logp = logp.gather(-1, token[:, None]).squeeze(-1)
        tokens, lps = token.tolist(), token_logp.tolist()
        done = [r for r, t, lp in zip(rows, tokens, lps, strict=True) if self._emit(r, [t], [lp])]
        return self._retire(done)

    def _sample_drafts(self, rows: Sequence[Row], logits: torch.Tensor) -> list[Row]:
        """Like :meth:`_sample` for a step with drafts: ``logits`` has ``1 + len(r.draft)`` rows per row; each
        drafting row keeps the draft's verified prefix and one token of the model (:func:`.speculate.verify`)."""
        spans = [1 + len(r.draft) for r in rows]
        temperature = torch.tensor([r.params.temperature for r, n in zip(rows, spans, strict=True) for _ in range(n)],
                                   dtype=torch.float32, device=logits.device)
        top_p = torch.tensor([r.params.top_p for r, n in zip(rows, spans, strict=True) for _ in range(n)],
                             dtype=torch.float32, device=logits.device)
        logp = behaviour_logprobs(logits, temperature, top_p).cpu()
        argmax = logits.argmax(-1).tolist()
        done: list[Row] = []
        at = 0
        for r, n in zip(rows, spans, strict=True):
            draft, greedy = r.draft, r.params.temperature <= 0
            tokens, lps = verify(logp[at : at + n], argmax[at : at + n], draft, greedy, self.generator)
            at += n
            if draft:
                kept = len(tokens) - 1
                r.kv_len -= len(draft) - kept  # the rejected drafts' keys/values are written over later
                self.stats["accepted_tokens"] += kept
                # its acceptance: positions decided are the kept ones and the first rejected, if any
                r.draft_kept = DRAFT_DECAY * r.draft_kept + kept
                r.draft_seen = DRAFT_DECAY * r.draft_seen + kept + (kept < len(draft))
                r.draft = []
            if self._emit(r, tokens, lps):
                done.append(r)
        return self._retire(done)

    def _emit(self, r: Row, tokens: Sequence[int], lps: Sequence[float]) -> bool:
        """Record ``tokens`` (sampled in this step) on ``r`` up to the first that ends it; whether it ended."""
        tok = self.tokenizer
        ended = False
        n = 0
        for t, lp in zip(tokens, lps, strict=True):
            r.ids.append(t)
            r.logprobs.append(lp)
            r.versions.append(self.version)
            n += 1
            if t in r.stop_ids or (r.params.stop and tail_has_stop(tok, r.ids, r.params.stop)):
                r.finish = "stop"
                ended = True
            elif len(r.ids) >= r.params.max_new_tokens or (self.context and len(r.prompt) + len(r.ids) >= self.context):
                r.finish = "length"
                ended = True
            if ended:
                break
        r.pending = [r.ids[-1]]
        if r.lookup is not None:
            r.lookup.extend(list(tokens[:n]))
        return ended

    def _retire(self, done: list[Row]) -> list[Row]:
        for r in done:
            self._remove(r)
            self.rows_generated += 1
            self.tokens_generated += len(r.ids)
        return done


__all__ = ["BASE_ADAPTER", "ContinuousEngine", "Row", "Unsupported", "support_problem"]
