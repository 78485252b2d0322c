# Builds kern.inc for the emulator: a build's generated header (decode or chunk), common.cuh, then the
# kernel files named (from kernels/, in the order given).
#   gen.py CHUNK_SOURCE REPO NATIVE OUT FILE...
import re
import sys
src, repo, native, out, files = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
s = open(src).read()
head = s[: s.index("// Shared by every kernel file")]
head = head.replace("#define DS4_NATIVE_BLOCKS 0", f"#define DS4_NATIVE_BLOCKS {native}")
body = "\n".join(open(f"{repo}/kernels/{f}").read() for f in ["common.cuh"] + files)
body = body.replace('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));', "f = emu_h2f(h);")
body = body.replace('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));', "h = emu_f2h(f);")
# kernels/matvec.cu's mma_s8_m16n8k32 (A from two uint2, C the bias) as the emulator's collective.
body = body.replace(
    'asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "\n'
    '        "{%10,%10,%10,%10};"\n'
    '        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])\n'
    '        : "r"(wa.x), "r"(wb.x), "r"(wa.y), "r"(wb.y), "r"(x.x), "r"(x.y), "r"(Q8_MMA_BIAS));',
    "const unsigned a[4] = {wa.x, wb.x, wa.y, wb.y}, b[2] = {x.x, x.y};\n"
    "    d[0] = d[1] = d[2] = d[3] = Q8_MMA_BIAS;\n"
    "    emu_mma_s8<32>(d, a, b);",
)
# common.cuh's cp.async copies, their wait, ldmatrix and dynamic shared memory (mat_mul_q8_0_tile).
for n in (16, 4):
    body = body.replace(
        f'asm volatile("cp.async.{"cg" if n == 16 else "ca"}.shared.global [%0], [%1], {n};" '
        '::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");',
        f"emu_cp_async(dst, src, {n});",
    )
body = body.replace('asm volatile("cp.async.wait_all;" ::: "memory");', "emu_cp_async_wait();")
body = body.replace(
    'asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"\n'
    '                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])\n'
    '                 : "r"((u32)__cvta_generic_to_shared(p)));',
    "emu_ldmatrix_x4(d, p);",
)
body = body.replace("extern __shared__ __align__(16) u8 q8t_smem[];", "static __align__(16) u8 q8t_smem[Q8T_SMEM];")
body = body.replace(
    "extern __shared__ __align__(16) float attn_r2_smem[];", "static __align__(16) float attn_r2_smem[ATTN_R2_SMEM / 4];"
)
body = body.replace(
    "extern __shared__ __align__(16) float attn_w_smem[];", "static __align__(16) float attn_w_smem[ATTN_W_SMEM / 4];"
)
body = body.replace("extern __shared__ __align__(16) u8 gut_smem[];", "static __align__(16) u8 gut_smem[GUT_SMEM];")
body = body.replace(
    "extern __shared__ __align__(16) float hc_pre_smem[];", "static __align__(16) float hc_pre_smem[5 * HC_PRE_MAX_EMBD];"
)
# What ds4_dynamic_smem reads: the emulator's emu_dynamic_smem.
assert body.count("    u32 bytes = 0;\n#if __CUDA_ARCH__") == 1, "common.cuh ds4_dynamic_smem changed"
body = body.replace("    u32 bytes = 0;\n#if __CUDA_ARCH__", "    u32 bytes = emu_dynamic_smem;\n#if __CUDA_ARCH__")
# The int8 MMA wrappers (kernels/moe.cu mma_s8_k32: d, a, b) call the emulator's warp collective.
body = re.sub(
    r'asm\("mma\.sync\.aligned\.m16n8k(16|32)\.row\.col\.s32\.s8\.s8\.s32 .*?\);',
    r"emu_mma_s8<\1>(d, a, b);",
    body,
    flags=re.S,
)
# The byte permutes (kernels/moe.cu prmt: d from a, b, c) call the emulator's.
body = body.replace('asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));', "d = emu_prmt(a, b, c);")
assert "asm(" not in body.replace("asm volatile", ""), "an asm statement is left"
assert 'asm volatile("cp.async' not in body and 'asm volatile("ldmatrix' not in body, "a cp.async or ldmatrix asm is left"
open(out, "w").write(head + body)
