#!/usr/bin/env bash
# The kernel and engine tests on 64-bit ARM (Grace, Graviton), cross-built here and run under
# qemu-user: the library's unit tests and the integration tests of the kernels, collectives,
# stages, mixed precision, ZeRO++ and the Hugging Face families. On aarch64 the kernels' portable
# bodies are compiled for NEON (the target's baseline) and the products take the gemm crate's
# NEON kernels; the expected values these tests hold are x86's and transformers', so the two
# CPUs are checked against each other. Tests that run the `zerodp` binary are left out (an
# emulated binary per call would take most of the time).
#
#   scripts/aarch64_tests.sh            # needs: qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross
#                                       # and `rustup target add aarch64-unknown-linux-gnu`
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=qemu-aarch64
# Where qemu finds the target's loader and libc; tests read it to know they are emulated.
export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
for tool in qemu-aarch64 aarch64-linux-gnu-gcc; do
    command -v "$tool" >/dev/null || {
        echo "no $tool: apt-get install qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross" >&2
        exit 2
    }
done

cargo test --target "$target" --lib
cargo test --target "$target" --test it -- \
    comm::collectives comm::in_place \
    model::kernel_math model::gpt model::masked_loss model::candle_unit \
    model::hf_gpt2 model::hf_llama model::hf_families \
    zero::equivalence zero::mixed_precision zero::zeropp zero::gpt \
    --skip mixed_precision_cli
