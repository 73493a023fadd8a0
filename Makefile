# The two set-up commands. Both install what they need (system packages via
# scripts/install-deps.sh) and work on a fresh clone.

CARGO ?= cargo
# Silences Mesa's lavapipe warning when no session runtime dir exists (CI, containers).
export XDG_RUNTIME_DIR ?= /tmp/kvplug-xdg-runtime

.PHONY: demo test deps fmt-check clippy unit

## make demo: runs the main job on the default cpu backend.
demo: deps
	$(CARGO) run --quiet -p kvplug-core --example trace

## make test: everything CI checks.
test: deps fmt-check clippy unit

deps:
	@mkdir -p $(XDG_RUNTIME_DIR) && chmod 700 $(XDG_RUNTIME_DIR)
	@./scripts/install-deps.sh

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

unit:
	$(CARGO) test --workspace
