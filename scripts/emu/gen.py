# Builds kern.inc: the chunk build's generated header, common.cuh and moe.cu, for the emulator.
import sys
src, repo, native, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
s = open(src).read()
head = s[: s.index("// Shared by every kernel file")]
head = head.replace("#define DS4_NATIVE_BLOCKS 0", f"#define DS4_NATIVE_BLOCKS {native}")
body = open(repo + "/kernels/common.cuh").read() + "\n" + open(repo + "/kernels/moe.cu").read()
body = body.replace('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));', "f = emu_h2f(h);")
body = body.replace('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));', "h = emu_f2h(f);")
assert "asm(" not in body.replace("asm volatile", ""), "an asm statement is left"
open(out, "w").write(head + body)
