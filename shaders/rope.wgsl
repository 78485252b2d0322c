// RopeTail: rotate the last n_rot dims of each head by a host-computed table of (cos, sin) per
// position and pair, the very values the CPU reference rotates by (backends/gpu_tables.rs).

@group(0) @binding(2) var<storage, read_write> X: array<f32>;
@group(0) @binding(3) var<storage, read> TABLE: array<f32>;

// (cos, sin) of pair k (of `pairs`) at the table position of args 3-5 (pos_mode: 0 the current
// position `cur`, 1 the compressed row's cur + 1 - ratio; inverse: sin negated), for both entry
// points.
fn rope_cos_sin(k: u32, pairs: u32, cur: u32) -> vec2<f32> {
    var pos = cur;
    if (arg(3u) == 1u) {
        pos = select(0u, cur + 1u - arg(4u), cur + 1u >= arg(4u));
    }
    let c = TABLE[(pos * pairs + k) * 2u];
    var s = TABLE[(pos * pairs + k) * 2u + 1u];
    if (arg(5u) != 0u) {
        s = -s;
    }
    return vec2<f32>(c, s);
}

// args: n_head, head_dim, n_rot, pos_mode (0: pos, 1: pos + 1 - ratio), ratio, inverse. In a
// chunk, one dispatch rotates every row of the chunk: row wid.z, at its own position, whose X
// starts x_stride() words after the previous row's (0 in a decode program).
@compute @workgroup_size(128)
fn rope_tail(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let cur = P.pos + wid.z;
    if (!guard_at(cur)) {
        return;
    }
    let n_head = arg(0u);
    let head_dim = arg(1u);
    let n_rot = arg(2u);
    let pairs = n_rot / 2u;
    let t = wid.x * 128u + lid;
    if (t >= n_head * pairs) {
        return;
    }
    let h = t / pairs;
    let k = t % pairs;
    let cs = rope_cos_sin(k, pairs, cur);
    let i = wid.z * x_stride() + h * head_dim + (head_dim - n_rot) + 2u * k;
    let x0 = X[i];
    let x1 = X[i + 1u];
    X[i] = fsub(fmul(x0, cs.x), fmul(x1, cs.y));
    X[i + 1u] = fadd(fmul(x0, cs.y), fmul(x1, cs.x));
}

// rope_tail_q8's Q8_0 quantization of X (quantize_q8_0's layout: n / 4 words of quants, then the
// scales).
@group(0) @binding(4) var<storage, read_write> XQ: array<u32>;

var<workgroup> rope_in: array<f32, 256>;

// RopeTail over all n_head rows of X, then the Q8_0 quantization of the result, for the Q8_0
// matvec that reads it next (the attention output, rotated back, before wo_a). Every rotated
// value as rope_tail computes it; the others pass through. One workgroup per 256 values, so the
// two values of a pair (even head_dim and n_rot) are in one workgroup. args: as rope_tail, then n.
@compute @workgroup_size(256)
fn rope_tail_q8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let head_dim = arg(1u);
    let n_rot = arg(2u);
    let n = arg(6u);
    let pairs = n_rot / 2u;
    let i = group_index(wid, nwg) * 256u + lid;
    var v = 0.0;
    if (i < n) {
        v = X[i];
    }
    // Every value is read before any is written.
    rope_in[lid] = v;
    workgroupBarrier();
    let tail = head_dim - n_rot;
    let d = i % head_dim;
    if (i < n && d >= tail) {
        let cs = rope_cos_sin((d - tail) / 2u, pairs, P.pos);
        let c = cs.x;
        let s = cs.y;
        let first = lid - (d - tail) % 2u;
        let x0 = rope_in[first];
        let x1 = rope_in[first + 1u];
        if ((d - tail) % 2u == 0u) {
            v = fsub(fmul(x0, c), fmul(x1, s));
        } else {
            v = fadd(fmul(x0, s), fmul(x1, c));
        }
        X[i] = v;
    }
    let q = q8_block(v, lid);
    if (i < n && lid % 4u == 0u) {
        XQ[i / 4u] = q.x;
    }
    if (i < n && lid % 32u == 0u) {
        XQ[n / 4u + i / 32u] = q.y;
    }
}
