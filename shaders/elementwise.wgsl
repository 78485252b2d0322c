// SwiGlu and Add, one invocation per element.

@group(0) @binding(2) var<storage, read_write> A0: array<f32>;
@group(0) @binding(3) var<storage, read_write> A1: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;
// SwiGLU's output quantized to Q8_0 (quantize_q8_0's layout: n / 4 words of quants, then the scales).
@group(0) @binding(5) var<storage, read_write> XQ: array<u32>;

// In a chunk, one dispatch of either computes every row of the chunk: row wid.z, whose three
// vectors (of one length) start x_stride() words after the previous row's (0 in a decode
// program; swiglu only without q8, which writes one row).

// args: n, clamp, q8. out = silu(min(gate, c)) * clamp(up, -c, c); with q8 (n a multiple of
// 32), each 32-lane group also quantizes the block of 32 it wrote.
@compute @workgroup_size(256)
fn swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    if (!guard_at(P.pos + wid.z)) {
        return;
    }
    let n = arg(0u);
    let i = group_index(wid, nwg) * 256u + lid;
    let ro = wid.z * x_stride();
    var v = 0.0;
    if (i < n) {
        v = swiglu_clamped(A0[ro + i], A1[ro + i], argf(1u));
        OUT[ro + i] = v;
    }
    if (arg(2u) != 0u) {
        let q = q8_block(v, lid);
        if (i < n && lid % 4u == 0u) {
            XQ[i / 4u] = q.x;
        }
        if (i < n && lid % 32u == 0u) {
            XQ[n / 4u + i / 32u] = q.y;
        }
    }
}

// args: n.
@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    if (!guard_at(P.pos + wid.z)) {
        return;
    }
    let i = group_index(wid, nwg) * 256u + lid;
    let ro = wid.z * x_stride();
    if (i < arg(0u)) {
        OUT[ro + i] = o(A0[ro + i] + A1[ro + i]);
    }
}
