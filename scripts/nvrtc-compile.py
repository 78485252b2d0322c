"""Compiles the ds4 kernel source with NVRTC (libnvrtc of CUDA 13) for a real architecture, with
the canonical profile's flags and ptxas's verbose report: prints the compile log, and writes the
cubin when a path is given. Used by scripts/kernel-registers and scripts/kernel-sass.

    python3 scripts/nvrtc-compile.py SOURCE.cu ARCH [OUT.cubin]
"""
import ctypes
import sys

src, arch = sys.argv[1], sys.argv[2]
lib = ctypes.CDLL("libnvrtc.so.13")
prog = ctypes.c_void_p()
if lib.nvrtcCreateProgram(ctypes.byref(prog), open(src, "rb").read(), b"ds4_kernels.cu", 0, None, None):
    sys.exit("nvrtc-compile: nvrtcCreateProgram failed")
opts = [f"--gpu-architecture={arch}", "--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false",
        "--ptxas-options=-v"]
arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
if rc:
    sys.exit(f"nvrtc-compile: NVRTC failed ({rc}):\n{log.value.decode()}")
print(log.value.decode())
if len(sys.argv) > 3:
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    open(sys.argv[3], "wb").write(cubin.raw)
