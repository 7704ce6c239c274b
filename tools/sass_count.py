"""Count the instructions the quantized GEMVs and few-row GEMMs (layers/quant_kernels.py) issue per weight,
with no GPU: each kernel compiled by Triton for sm_90, disassembled with the cuobjdump Triton ships, and its
main loop (the longest backward branch) counted against the weights a thread takes per trip.

usage: python tools/sass_count.py"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from strata.layers import quant_kernels as qk  # noqa: E402


def compile_sass(fn, signature: dict, constexprs: dict, warps: int, aligned: tuple, stages: int = 3) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    for param in fn.params[len(signature):]:  # the parameters with defaults (PDL, the expert mode's): as given
        signature = {**signature, param.name: "constexpr"}
        constexprs = {param.name: param.default, **constexprs}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def loop_ops(sass: str) -> collections.Counter:
    """Opcodes of the longest loop: from a backward branch's target to the branch."""
    code = [(int(m.group(1), 16), m.group(2)) for m in
            re.finditer(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);", sass, re.M)]
    best = (0, 0, -1)
    for end, (addr, text) in enumerate(code):
        b = re.search(r"BRA\s+(0x[0-9a-f]+)", text)
        if b and int(b.group(1), 16) < addr:
            start = next(k for k, (a, _) in enumerate(code) if a == int(b.group(1), 16))
            best = max(best, (end - start + 1, start, end))
    _, start, end = best
    return collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", t).group(1)
                               for _, t in code[start:end + 1])


def main() -> None:
    kernels = qk._build()
    byte_sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "tab_ptr": "*i8", "y_ptr": "*bf16", "N": "i32", "K": "i32",
                "row_bytes": "i32", "ids_ptr": "*i64", "expert_bytes": "i64", "stride_x": "i32", "stride_y": "i32",
                "QTYPE": "constexpr", "GLU": "constexpr", "BLOCK_N": "constexpr",
                "UNROLL": "constexpr"}
    runs = []
    for name, qtype in (("Q4_K", qk.Q4_K), ("Q6_K", qk.Q6_K), ("Q8_0", qk.Q8_0)):
        for block_n, warps, unroll in ((16, 8, 1), (8, 4, 4)):
            sass = compile_sass(kernels["gemv"], byte_sig, {"QTYPE": qtype, "GLU": False, "BLOCK_N": block_n,
                                                           "UNROLL": unroll}, warps, (0, 1, 6))
            runs.append((f"gemv_kernel {name} {block_n, warps, unroll}", loop_ops(sass),
                         block_n * 256 * unroll / (32 * warps)))
    skinny8_sig = {"q_ptr": "*i8", "ds_ptr": "*fp32", "w_ptr": "*u8", "y_ptr": "*bf16", "ws_ptr": "*fp32",
                   "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "row_words": "i32", "stride_y": "i32",
                   "GLU": "constexpr", "BLOCK_N": "constexpr", "SPLIT": "constexpr", "ASM": "constexpr"}
    for name, skinny in (("Q4_K", "skinny_q4k8"), ("IQ4_XS", "skinny_q4k8"), ("Q4_0", "skinny_q4k8"),
                         ("Q6_K", "skinny_q6k8"), ("Q8_0", "skinny_q8_0w"), ("Q8_0", "skinny_q8_0")):
        qtype = {"QTYPE": getattr(qk, name)} if skinny == "skinny_q4k8" else {}
        for block_n, warps, stages, split in qk.WORD_SKINNY_CONFIGS[:3:2]:
            loop = qk._loop_stages(skinny, stages)
            sass = compile_sass(kernels[skinny], {**skinny8_sig, **{k: "constexpr" for k in loop}},
                                {"GLU": False, "BLOCK_N": block_n, "SPLIT": split, "ASM": True, **loop, **qtype},
                                warps, (0, 1, 2, 8, 9), stages)
            # a trip: a K step (GEMM_STEP_COLUMNS) of BLOCK_N rows, each weight against 16 x rows
            runs.append((f"{skinny}_kernel {name} {block_n, warps, stages, split}", loop_ops(sass),
                         block_n * qk.GEMM_STEP_COLUMNS[skinny] / (32 * warps)))
    lane_sig = {"q_ptr": "*i8", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "w_ptr": "*u8", "y_ptr": "*bf16", "N": "i32",
                "K": "i32", "row_words": "i32", "GLU": "constexpr", "RT": "constexpr", "WARPS": "constexpr",
                "KU": "constexpr", "ASM": "constexpr", "QTYPE": "constexpr"}
    for name, qtype in (("Q4_K", qk.Q4_K), ("Q5_K", qk.Q5_K), ("IQ4_XS", qk.IQ4_XS), ("Q4_0", qk.Q4_0),
                        ("Q6_K", qk.Q6_K), ("Q8_0", qk.Q8_0)):
        sig = {("row_bytes" if k == "row_words" and qtype == qk.Q6_K else k): v for k, v in lane_sig.items()}
        for rt, warps, ku, ks in qk.LANE_K_CONFIGS[:2]:
            sass = compile_sass(kernels[qk.INT8_GEMVS[qtype]], sig,
                                {"GLU": False, "RT": rt, "WARPS": warps, "KU": ku, "KS": ks, "ASM": True,
                                 "QTYPE": qtype}, warps, (0, 1, 2, 3, 4, 7))
            # a trip: each lane's 32 weights of KU superblocks in RT rows (Q8_0: its 16 bytes, 16 * 32 / 34
            # weights, of KU steps)
            lane_weights = 16 * 32 / 34 if qtype == qk.Q8_0 else 32
            runs.append((f"{qk.INT8_GEMVS[qtype]}_kernel {name} {rt, warps, ku, ks}", loop_ops(sass),
                         lane_weights * rt * ku))
    for label, ops, weights in runs:
        total = sum(ops.values())
        top = ", ".join(f"{k} {v / weights:.2f}" for k, v in ops.most_common(6))
        print(f"{label:36} {total / weights:6.2f} instructions a weight ({top})")


if __name__ == "__main__":
    main()
