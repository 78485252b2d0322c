// SwiGlu and Add, one invocation per element.

@group(0) @binding(2) var<storage, read_write> A0: array<f32>;
@group(0) @binding(3) var<storage, read_write> A1: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;

// args: n, clamp. out = silu(min(gate, c)) * clamp(up, -c, c).
@compute @workgroup_size(256)
fn swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let i = group_index(wid, nwg) * 256u + lid;
    if (i < arg(0u)) {
        OUT[i] = swiglu_clamped(A0[i], A1[i], argf(1u));
    }
}

// args: n.
@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let i = group_index(wid, nwg) * 256u + lid;
    if (i < arg(0u)) {
        OUT[i] = o(A0[i] + A1[i]);
    }
}
