#!/usr/bin/env bash
# weightd.sglang against the real SGLang 0.5.23 on the CPU
# (tests/python/engines/test_sglang.py; docs/integration.md "SGLang").
# Not part of .ci/run: SGLang's venv is 11 GB and took 13 minutes to install
# on the 2-core CI machine with a warm network (776 s), which with the main
# tests (~13 min) and scripts/test-engines.sh would crowd CI's 45 minutes;
# run it by hand or in a nightly job. The venv is kept under build/ while
# tests/python/engines/sglang.txt is unchanged (pip's cache: ~/.cache/pip).
# The steps are scripts/test-engines.sh's, for SGLang.
exec "$(dirname "$0")/test-engines.sh" sglang
