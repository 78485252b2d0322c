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
open(out, "w").write(head + body)
