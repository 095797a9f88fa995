#!/usr/bin/env bash
# Build .fi/: a stripped flashinfer-python wheel plus the runtime dependency the GPU image lacks
# (apache-tvm-ffi), small enough to carry to the GPU machine (64 MiB per call, all carried paths).
#
# flashinfer-python 0.7.4 is a ~100 MB py3-none-any wheel; most of it is CUDA sources of kernels
# plait never builds (MoE, GEMMs, the cake_* and experimental backends). plait's flashinfer backend
# JIT-compiles only the FA2 batch-prefill module (bf16, page size 1), which serves both extend and
# tensor-core decode, and the CUDA-core batch-decode module (MHA models). Both are generated from
# the top-level templates in data/csrc and include headers from data/include and the vendored CCCL.
# So the stripped wheel keeps:
#   - every Python file `import flashinfer` can load (all of flashinfer/ except experimental/ and
#     moe_ep/, of which only the modules loaded at import time are kept), plus JSON data files;
#   - data/include, data/cccl, data/spdlog and the top-level files of data/csrc;
#   - no CUTLASS (not included by the FA2 kernels; an empty include dir stays so -isystem resolves).
# RECORD is regenerated so pip installs it like any wheel. With a local Python that has torch and
# tvm_ffi, the script then checks `import flashinfer`, generates the decode/prefill JIT sources and
# verifies that every header they include (transitively) that the full wheel ships is still there.
#
# Usage: benchmarks/tools/make_flashinfer_bundle.sh [path/to/flashinfer_python-0.7.4-py3-none-any.whl]
#   Without a path it uses $FI_WHEEL, else /tmp/fiw/<wheel>, else downloads it with pip.
# Then on the GPU machine (carry [".fi"]): see benchmarks/tools/gpu_flashinfer_check.sh.
set -euo pipefail

FI_VERSION=0.7.4
TVM_FFI_VERSION=0.1.15.post2  # flashinfer 0.7.4 needs apache-tvm-ffi >=0.1.11,<0.2
WHEEL_NAME=flashinfer_python-${FI_VERSION}-py3-none-any.whl
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
DEST=$ROOT/.fi
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3

src=${1:-${FI_WHEEL:-}}
if [ -z "$src" ] && [ -f "/tmp/fiw/$WHEEL_NAME" ]; then src=/tmp/fiw/$WHEEL_NAME; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$src" ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$work/dl" "flashinfer-python==$FI_VERSION"
  src=$work/dl/$WHEEL_NAME
fi

grep -qx '/.fi/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.fi/' >> "$ROOT/.git/info/exclude"
rm -rf "$DEST"
mkdir -p "$DEST"

# ---- 1. the stripped flashinfer wheel ----
"$PY" - "$src" "$DEST/$WHEEL_NAME" <<'EOF'
import base64, hashlib, sys, zipfile

src, dst = sys.argv[1], sys.argv[2]
DROP_EXT = (".cu", ".cuh", ".h", ".hpp", ".cpp", ".c", ".md")
# experimental/ modules that `import flashinfer` loads (0.7.4); the rest of experimental/ is 80 MB.
EXPERIMENTAL_KEEP = ("flashinfer/experimental/__init__.py", "flashinfer/experimental/cake_nvfp4_per_token/")
PLACEHOLDERS = ("flashinfer/data/cutlass/include/STRIPPED", "flashinfer/data/cutlass/tools/util/include/STRIPPED")


def keep(name: str) -> bool:
    if name.endswith("/") or name.endswith(".dist-info/RECORD"):
        return False
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info") or top == "b12x":
        return True
    if top != "flashinfer":
        return False  # build_backend.py, build_utils.py: build-time only
    if name.startswith("flashinfer/data/"):
        rest = name[len("flashinfer/data/"):]
        if rest.startswith(("include/", "cccl/", "spdlog/")):
            return True
        if rest.startswith("csrc/"):
            return "/" not in rest[len("csrc/"):]  # templates and sources, not kernel subtrees
        return "/" not in rest  # data/*.py
    if name.startswith("flashinfer/moe_ep/"):
        return False
    if name.startswith("flashinfer/experimental/"):
        return name.startswith(EXPERIMENTAL_KEEP) and name.endswith(".py")
    return not name.endswith(DROP_EXT)


def digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


zin = zipfile.ZipFile(src)
record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
records = []
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if not keep(info.filename):
            continue
        data = zin.read(info)
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        records.append(f"{info.filename},{digest(data)},{len(data)}")
    for name in PLACEHOLDERS:
        data = b"CUTLASS stripped by plait's make_flashinfer_bundle.sh (not used by the FA2 kernels)\n"
        zout.writestr(name, data)
        records.append(f"{name},{digest(data)},{len(data)}")
    records.append(f"{record_name},,")
    zout.writestr(record_name, "\n".join(records) + "\n")
kept = len(records) - 1
print(f"kept {kept} of {len(zin.infolist())} entries")
EOF

# ---- 2. runtime dependencies missing on the GPU image (Python 3.12, manylinux x86-64) ----
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "apache-tvm-ffi==$TVM_FFI_VERSION"
# Already on the GPU image: torch, numpy, ninja, einops, click, packaging, requests, tabulate, tqdm,
# nvidia-ml-py, jinja2, typing-extensions, cuda-bindings. Optional (imported lazily, not carried):
# nvidia-cudnn-frontend, nvidia-cutlass-dsl, cuda-tile, nccl4py, nccl-extensions.

ls -l "$DEST"
du -cb "$DEST"/* | tail -1 | awk '{printf "bundle: %.1f MiB\n", $1 / 1048576}'

# ---- 3. check on this machine: import, JIT source generation, include closure ----
if ! "$PY" -c "import torch, tvm_ffi" 2>/dev/null; then
  echo "skipping the local check (needs torch and tvm_ffi in $PY)"
  exit 0
fi
site=$work/site
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$DEST/$WHEEL_NAME"
# Pure-Python needs of `import flashinfer` that the GPU image has but a plain dev venv may not.
for mod_pkg in pynvml:nvidia-ml-py einops:einops tabulate:tabulate; do
  "$PY" -c "import ${mod_pkg%%:*}" 2>/dev/null || \
    "$PY" -m pip install -q --no-deps --no-compile --target "$site" "${mod_pkg##*:}"
done
cd "$work"
FLASHINFER_WORKSPACE_BASE=$work/ws FLASHINFER_CUDA_ARCH_LIST=9.0 PYTHONPATH=$site \
  "$PY" - "$src" "$site/flashinfer" <<'EOF'
import pathlib, re, sys, zipfile

import torch

import flashinfer
from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: F401
from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper  # noqa: F401
from flashinfer.jit.attention.modules import (
    _gen_batch_prefill_independent_paged_module, _gen_batch_prefill_primary_module, gen_batch_decode_module)

full_wheel, root = zipfile.ZipFile(sys.argv[1]), pathlib.Path(sys.argv[2])
full_names = set(full_wheel.namelist())
specs = []
for hd in (64, 128, 256):
    args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, hd, hd, 0, False, False)
    specs.append(_gen_batch_prefill_primary_module("fa2", *args, False))
    specs.append(_gen_batch_prefill_independent_paged_module("fa2", *args, False))
    specs.append(gen_batch_decode_module(*args))

data = root / "data"
inc_dirs = ["cccl/cub", "cccl/libcudacxx/include", "cccl/thrust", "include", "csrc",
            "cutlass/include", "cutlass/tools/util/include", "spdlog/include"]
pattern = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
todo = [pathlib.Path(s) for spec in specs for s in spec.sources]
todo += [p for spec in specs for p in pathlib.Path(spec.sources[0]).parent.glob("*.inc")]
seen, missing = set(), set()
while todo:
    f = todo.pop()
    for name in pattern.findall(f.read_text(errors="ignore")):
        for cand in [f.parent / name] + [data / d / name for d in inc_dirs]:
            if cand.is_file():
                if cand.resolve() not in seen:
                    seen.add(cand.resolve())
                    todo.append(cand)
                break
        else:  # not in the stripped tree: fine for CUDA/system headers, a bug if the full wheel has it
            if any(f"flashinfer/data/{d}/{name}" in full_names for d in inc_dirs):
                missing.add(name)
print(f"import ok (flashinfer {flashinfer.__version__}); {len(specs)} JIT specs generated; "
      f"{len(seen)} bundled headers/sources in their include closure")
if missing:
    sys.exit(f"headers the JIT sources include but the bundle lacks: {sorted(missing)}")
print("include closure complete")
EOF
