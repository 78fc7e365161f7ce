"""Build flash-attn 2 from its source release for one GPU setup only: head_dim 128, bf16, forward.

A full flash-attn build compiles 72 kernel files and takes a long time; an inference engine for
Qwen3 (head_dim 128, bf16) needs six of them. This script unpacks the source release, cuts the
CUDA extension's sources down to those six plus the API file, switches on the library's own
DISABLE_* switches (backward, dropout, alibi, softcap, uneven K, local attention), narrows the
dtype and head-dim dispatch so anything else raises, and installs the result with pip.

    python benchmarks/build_flash_attn.py path/to/flash_attn-2.8.3.tar.gz [--arch 90] [--jobs 16] [--target DIR]

The resulting wheel serves head_dim 128 in bf16, forward only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

KEEP_SOURCES = [
    "csrc/flash_attn/flash_api.cpp",
    *(
        f"csrc/flash_attn/src/flash_fwd{split}_hdim128_bf16{causal}_sm80.cu"
        for split in ("", "_split")
        for causal in ("", "_causal")
    ),
    "csrc/flash_attn/src/flash_bwd_hdim128_bf16_sm80.cu",
    "csrc/flash_attn/src/flash_bwd_hdim128_bf16_causal_sm80.cu",
]
DISABLES = ["BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "UNEVEN_K", "LOCAL"]

FP16_SWITCH_BF16_ONLY = """#define FP16_SWITCH(COND, ...)               \\
  [&] {                                      \\
    if (COND) { throw std::runtime_error("this flash-attn build serves bfloat16 only"); } \\
    using elem_type = cutlass::bfloat16_t;   \\
    return __VA_ARGS__();                    \\
  }()
"""
HEADDIM_SWITCH_128_ONLY = """#define HEADDIM_SWITCH(HEADDIM, ...)   \\
  [&] {                                    \\
    if (HEADDIM != 128) { throw std::runtime_error("this flash-attn build serves head_dim 128 only"); } \\
    constexpr static int kHeadDim = 128;   \\
    return __VA_ARGS__();                  \\
  }()
"""


def replace_macro(text: str, name: str, body: str) -> str:
    """Swap a multi-line #define (continued with backslashes, ending in `}()`) for `body`."""
    pattern = re.compile(rf"#define {name}\(.*?\n(?:.*\\\n)*.*\}}\(\)\n")
    new, count = pattern.subn(body.replace("\\", "\\\\"), text, count=1)
    if count != 1:
        raise SystemExit(f"could not find the {name} macro to narrow")
    return new


def patch(root: Path) -> None:
    setup = (root / "setup.py").read_text()
    start = setup.index('name="flash_attn_2_cuda"')
    sources_start = setup.index("sources=[", start)
    sources_end = setup.index("],", sources_start)
    kept = "".join(f'                "{s}",\n' for s in KEEP_SOURCES)
    setup = setup[:sources_start] + "sources=[\n" + kept + "            " + setup[sources_end:]
    for flag in DISABLES:
        setup = setup.replace(f'# "-DFLASHATTENTION_DISABLE_{flag}",', f'"-DFLASHATTENTION_DISABLE_{flag}",', 1)
    defines = ", ".join(f'"-DFLASHATTENTION_DISABLE_{flag}"' for flag in DISABLES)
    setup = setup.replace(
        'compiler_c17_flag=["-O3", "-std=c++17"]', f'compiler_c17_flag=["-O3", "-std=c++17", {defines}]'
    )
    (root / "setup.py").write_text(setup)
    switch = root / "csrc/flash_attn/src/static_switch.h"
    text = replace_macro(switch.read_text(), "FP16_SWITCH", FP16_SWITCH_BF16_ONLY)
    text = replace_macro(text, "HEADDIM_SWITCH", HEADDIM_SWITCH_128_ONLY)
    text = "#include <stdexcept>\n" + text
    switch.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tarball", type=Path)
    parser.add_argument("--arch", default="90", help="CUDA architectures, e.g. 90 for Hopper")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    parser.add_argument("--target", type=Path, help="install here (pip's --target), not into site-packages")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="flash_attn_build_"))
    with tarfile.open(args.tarball) as tar:
        tar.extractall(work, filter="data")
    root = next(work.glob("flash_attn-*"))
    patch(root)
    env = dict(
        os.environ,
        FLASH_ATTN_CUDA_ARCHS=args.arch,
        FLASH_ATTENTION_FORCE_BUILD="TRUE",
        MAX_JOBS=str(args.jobs),
        NVCC_THREADS="2",
    )
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", "."]
    if args.target:
        cmd += ["--target", str(args.target.resolve())]
    subprocess.run(cmd, cwd=root, env=env, check=True)


if __name__ == "__main__":
    main()
