#!/usr/bin/env bash
# Build zerodp with the `cuda` feature on a Linux machine without a GPU or a CUDA toolkit, for a
# GPU machine with the NVIDIA driver of CUDA 13.0 (580) or newer and the CUDA 13.0 runtime
# libraries in /usr/local/cuda-13.0/lib64 (docs/gpus.md).
#
#   scripts/cuda-build.sh                 # zerodp, stripped, in target/cuda/zerodp
#   scripts/cuda-build.sh --tests         # and the test binaries, in target/cuda/tests/
#   scripts/cuda-build.sh --env           # only print the environment (eval it to run cargo yourself)
#   scripts/cuda-build.sh --tests --pack DIR   # and xz copies of zerodp and the GPU tests in DIR,
#                                              # for a GPU machine (scripts/gpu_check.sh unpacks them)
#
# What it does, and why (the facts are in ../shared/reference/cuda-build.md of the project):
# 1. A Python virtual environment with NVIDIA's CUDA 13.0 wheels from PyPI: nvcc (candle's kernels
#    are compiled to PTX at build time), the headers, cudart, cuBLAS, cuRAND, NVRTC and NCCL 2.28.
#    Every wheel is pinned to 13.0.x: the 580 driver rejects PTX from a newer nvcc, and
#    nvidia-cuda-nvcc alone would pull 13.5 dependencies.
# 2. A folder of unversioned library names (the wheels ship only libcublas.so.13 and the like) for
#    the linker's -l flags, plus a stub libcuda.so.1: the driver library is not on PyPI, so a
#    library defining every driver function cudarc declares (each returning an error) stands in
#    for it at link time; the GPU machine's real driver is loaded at run time.
# 3. cargo with CUDA_COMPUTE_CAP (default 90: H100 and H200; set it for another GPU), an rpath of
#    /usr/local/cuda-13.0/lib64, and its own target folder (target/cuda), so that the CPU build's
#    artefacts are left alone.
#
# A cold build takes about 20 minutes on 2 cores (most of it nvcc on candle's kernels); a rebuild
# after changing zerodp's Rust code takes a minute. The wheels take about 1.4 GB, under
# ${ZERODP_CUDA_PREFIX:-~/.cache/zerodp-cuda}.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PREFIX="${ZERODP_CUDA_PREFIX:-$HOME/.cache/zerodp-cuda}"
CAP="${CUDA_COMPUTE_CAP:-90}"
RUNTIME_LIBS="${ZERODP_CUDA_RUNTIME_LIBS:-/usr/local/cuda-13.0/lib64}"
TARGET_DIR="$ROOT/target/cuda"
WHEELS=(
    "cuda-toolkit[nvcc,cublas,curand,nvrtc,cudart,cccl]==13.0.2"
    "nvidia-cuda-crt==13.0.88"
    "nvidia-nvvm==13.0.88"
    "nvidia-nccl-cu13==2.28.9"
)

mode=build
pack=""
while (($#)); do
    case "$1" in
        --tests) mode=tests ;;
        --env) mode=env ;;
        --pack) pack="$(realpath -m "${2:?--pack needs a folder}")"; shift ;;
        -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "cuda-build.sh: unknown argument '$1' (use --tests, --env, --pack DIR or nothing)" >&2; exit 2 ;;
    esac
    shift
done

say() { echo "cuda-build: $*" >&2; }

# 1. The wheels.
if [[ ! -x "$PREFIX/venv/bin/python" ]]; then
    say "creating $PREFIX/venv"
    python3 -m venv "$PREFIX/venv"
fi
if [[ ! -f "$PREFIX/venv/.zerodp-wheels" ]] || [[ "$(cat "$PREFIX/venv/.zerodp-wheels")" != "${WHEELS[*]}" ]]; then
    say "installing the CUDA 13.0 wheels (about 1.4 GB) into $PREFIX/venv"
    "$PREFIX/venv/bin/pip" install -q --disable-pip-version-check "${WHEELS[@]}"
    echo "${WHEELS[*]}" >"$PREFIX/venv/.zerodp-wheels"
fi
SITE="$("$PREFIX/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
NVCC="$(find "$SITE/nvidia" -path '*/bin/nvcc' -type f | head -n1)"
if [[ -z "$NVCC" ]]; then
    say "no nvcc under $SITE/nvidia: the cuda-toolkit[nvcc] wheel did not install"
    exit 1
fi
CUDA_HOME_DIR="$(dirname "$(dirname "$NVCC")")"

# 2. Unversioned names and the stub driver library.
LIBS="$PREFIX/lib"
mkdir -p "$LIBS"
for name in cudart cublas cublasLt curand nvrtc nccl; do
    real="$(find "$SITE/nvidia" -name "lib$name.so.*" -type f | sort | head -n1)"
    if [[ -z "$real" ]]; then
        say "lib$name.so.* not found under $SITE/nvidia"
        exit 1
    fi
    ln -sf "$real" "$LIBS/lib$name.so"
done
CUDARC_SRC="$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -maxdepth 2 -type d -name 'cudarc-0.19.10' 2>/dev/null | head -n1)"
if [[ -z "$CUDARC_SRC" ]]; then
    (cd "$ROOT" && cargo fetch -q)
    CUDARC_SRC="$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -maxdepth 2 -type d -name 'cudarc-0.19.10' | head -n1)"
fi
if [[ ! -f "$LIBS/libcuda.so.1" ]] || [[ "$CUDARC_SRC/src/driver/sys/mod.rs" -nt "$LIBS/libcuda.so.1" ]]; then
    say "building the stub libcuda.so.1 from cudarc's driver declarations"
    {
        echo "/* Link-time stand-in for the NVIDIA driver library; never loaded on a GPU machine. */"
        grep -o 'pub unsafe fn cu[A-Za-z0-9_]*(' "$CUDARC_SRC/src/driver/sys/mod.rs" |
            sed -e 's/pub unsafe fn //' -e 's/($//' | sort -u |
            while read -r fn; do echo "int $fn(void) { return 999; }"; done
    } >"$LIBS/stub-libcuda.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$LIBS/libcuda.so.1" "$LIBS/stub-libcuda.c"
    ln -sf libcuda.so.1 "$LIBS/libcuda.so"
fi

# 3. The environment cargo builds in.
export PATH="$(dirname "$NVCC"):$PATH"
export CUDA_ROOT="$CUDA_HOME_DIR" CUDA_HOME="$CUDA_HOME_DIR" CUDA_PATH="$CUDA_HOME_DIR"
export CUDARC_CUDA_VERSION=13000 CUDA_COMPUTE_CAP="$CAP"
export LIBRARY_PATH="$LIBS${LIBRARY_PATH:+:$LIBRARY_PATH}"
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$LIBS -C link-arg=-Wl,-rpath,$RUNTIME_LIBS"
export CARGO_TARGET_DIR="$TARGET_DIR"
if [[ "$mode" == env ]]; then
    for v in PATH CUDA_ROOT CUDA_HOME CUDA_PATH CUDARC_CUDA_VERSION CUDA_COMPUTE_CAP LIBRARY_PATH RUSTFLAGS CARGO_TARGET_DIR; do
        printf 'export %s=%q\n' "$v" "${!v}"
    done
    exit 0
fi

cd "$ROOT"
say "cargo build --release --features cuda (CUDA_COMPUTE_CAP=$CAP, target $TARGET_DIR)"
cargo build --release --features cuda
strip -o "$TARGET_DIR/zerodp" "$TARGET_DIR/release/zerodp"
say "built $TARGET_DIR/zerodp ($(du -h "$TARGET_DIR/zerodp" | cut -f1)); it loads libcuda.so.1 and the CUDA 13.0 libraries of $RUNTIME_LIBS at run time"
if [[ "$mode" == tests ]]; then
    mkdir -p "$TARGET_DIR/tests"
    cargo test --release --features cuda --no-run --message-format=json |
        "$PREFIX/venv/bin/python" -c '
import json, shutil, subprocess, sys, os
out = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable") if m.get("reason") == "compiler-artifact" else None
    if exe and m["target"]["kind"] != ["bin"]:
        dst = os.path.join(out, m["target"]["name"])
        subprocess.run(["strip", "-o", dst, exe], check=True)
        print(dst)
' "$TARGET_DIR/tests"
fi
if [[ -n "$pack" ]]; then
    mkdir -p "$pack"
    xz -T0 -6 -c "$TARGET_DIR/zerodp" >"$pack/zerodp.xz"
    if [[ -x "$TARGET_DIR/tests/gpu" ]]; then
        xz -T0 -6 -c "$TARGET_DIR/tests/gpu" >"$pack/gpu.xz"
    fi
    say "packed into $pack: $(ls "$pack" | tr '\n' ' ')"
fi
