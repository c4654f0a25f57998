"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU; print ptxas register/spill lines.

Run in a process where TRITON_INTERPRET is unset (test_compile_sm90.py does that).
Integer arguments that are multiples of 16 at run time get the same divisibility hint
the JIT would give them, so register use matches a real launch.
"""
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vlmq.kernels import _triton_attn as A  # noqa: E402
from vlmq.kernels import _triton_kv as KV  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
ALIGNED = {"s_qt", "s_qh", "s_kb", "s_kt", "s_kh", "s_vb", "s_vt", "s_vh", "s_ot", "s_oh", "s_os", "s_pt", "s_ph",
           "s_ps", "s_xb", "s_xt", "s_xh", "s_cb", "s_ct", "s_ch", "s_db", "s_dt", "s_dh", "tokens_per_split",
           "block_size", "head_dim"}


def compile_kernel(fn, types, consts, num_warps=4, check_spills=False):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "*" + types["_ptr"] if n.endswith("_ptr") else "i32")
           for n in names}
    div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr") or n in ALIGNED}
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()}, attrs=div)
    kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps, **A.LAUNCH})
    if not check_spills:
        print(f"{fn.__name__} {consts} :: compiled")
        return
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    os.unlink(f.name)
    spills = [line.strip() for line in out.splitlines() if "spill" in line]
    print(f"{fn.__name__} {consts} :: {' | '.join(spills)}")


def main():
    attn = {"_ptr": "bf16", "bt_ptr": "*i32", "indptr_ptr": "*i32", "start_ptr": "*i32", "end_ptr": "*i32",
            "out_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    for block_m, block_n, block_d, warps, has_start in [(16, 32, 128, 4, True), (128, 32, 128, 8, False),
                                                        (16, 64, 64, 4, False)]:
        compile_kernel(A._group_attn_kernel, attn, dict(HAS_START=has_start, BLOCK_M=block_m, BLOCK_N=block_n,
                                                        BLOCK_D=block_d, PREC="tf32", UPCAST=False), warps, True)
    compile_kernel(A._group_attn_kernel, {**attn, "_ptr": "fp32"}, dict(
        HAS_START=False, BLOCK_M=16, BLOCK_N=16, BLOCK_D=128, PREC="ieee", UPCAST=False), 4, True)
    compile_kernel(A._merge_splits_kernel, {"_ptr": "fp32", "out_ptr": "*bf16"},
                   dict(BLOCK_H=1, BLOCK_S=64, BLOCK_D=128))
    compile_kernel(A._merge_pair_kernel, {"_ptr": "fp32", "oa_ptr": "*bf16", "ob_ptr": "*bf16", "out_ptr": "*bf16"},
                   dict(BLOCK_H=32, BLOCK_D=128))
    compile_kernel(KV._store_kv_kernel, {"_ptr": "bf16", "slot_ptr": "*i64"}, dict(BLOCK_H=4, BLOCK_D=128))
    for qtype, is_int in [("i8", True), ("fp8e4nv", False)]:
        compile_kernel(KV._quant_kernel, {"_ptr": "bf16", "q_ptr": "*" + qtype, "scale_ptr": "*fp32"},
                       dict(QMAX=127.0 if is_int else 448.0, IS_INT=is_int, BLOCK_T=16, BLOCK_D=128))
        compile_kernel(KV._dequant_kernel, {"_ptr": "bf16", "q_ptr": "*" + qtype, "scale_ptr": "*fp32"},
                       dict(BLOCK_T=16, BLOCK_D=128))
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
