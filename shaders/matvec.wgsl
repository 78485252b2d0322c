// MatVec and MatVecGrouped: dense F16 / F32 / Q8_0 weights, every row in the canonical order
// (src/numerics.rs): chunks of 512 terms (F16: 8 per lane step, F32: 4) or 32 blocks (Q8_0: one
// block per lane), each chunk reduced by the butterfly, chunk sums added in order from +0.
// 32 lanes per row, 8 rows per workgroup. A weight larger than a storage binding is split into
// row ranges, one dispatch each: `row0` is the chunk's first row.

@group(0) @binding(2) var<storage, read> W: array<u32>;
@group(0) @binding(3) var<storage, read_write> X: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;
// Q8_0 activation: packed signed bytes, then one f32 scale per 32 values from word `d_off`.
@group(0) @binding(5) var<storage, read_write> XQ: array<u32>;

var<workgroup> qbyte: array<i32, 256>;

// args: n, d_off. One 32-lane group per 32-block: d = amax/127, q = round-half-even(x * (1/d)).
@compute @workgroup_size(256)
fn quantize_q8_0(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let d_off = arg(1u);
    let lane = lid % 32u;
    let b = group_index(wid, nwg) * 8u + lid / 32u;
    let valid = b * 32u < n;
    var v = 0.0;
    if (valid) {
        v = X[b * 32u + lane];
    }
    let amax = lane_max(abs(v), lid);
    let d = fdiv(amax, 127.0);
    var id = 0.0;
    if (d != 0.0) {
        id = fdiv(1.0, d);
    }
    qbyte[lid] = clamp(i32(round(fmul(v, id))), -128, 127);
    workgroupBarrier();
    if (valid && lane % 4u == 0u) {
        let w = (u32(qbyte[lid]) & 255u) | ((u32(qbyte[lid + 1u]) & 255u) << 8u)
            | ((u32(qbyte[lid + 2u]) & 255u) << 16u) | ((u32(qbyte[lid + 3u]) & 255u) << 24u);
        XQ[(b * 32u + lane) / 4u] = w;
    }
    if (valid && lane == 0u) {
        XQ[d_off + b] = bitcast<u32>(d);
    }
}

// args: in_dim, rows (in this chunk), rows_per_group, row0, d_off (XQ scales), ws_off (word of the
// chunk's f16 scales). Weights repacked at upload: each row's quants (8 words per block), then
// all f16 scales. Block term: (f16(d_w) * d_x) * isum.
@compute @workgroup_size(256)
fn mat_vec_q8_0(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let d_off = arg(4u);
    let ws_off = arg(5u);
    let lane = lid % 32u;
    let r = group_index(wid, nwg) * 8u + lid / 32u;
    let rr = min(r, rows - 1u);
    let nb = in_dim / 32u;
    let g = (row0 + rr) / arg(2u);
    var total = zero();
    for (var c = 0u; c < nb; c = c + 32u) {
        var acc = zero();
        let b = c + lane;
        if (b < nb) {
            var isum = 0;
            let wq = (rr * nb + b) * 8u;
            let xq = (g * nb + b) * 8u;
            for (var k = 0u; k < 8u; k = k + 1u) {
                isum = isum + dot4i8(W[wq + k], XQ[xq + k]);
            }
            let hi = ws_off * 2u + rr * nb + b;
            let ws = h2f((W[hi / 2u] >> ((hi % 2u) * 16u)) & 0xffffu);
            let dx = bitcast<f32>(XQ[d_off + g * nb + b]);
            acc = fadd(acc, fmul(fmul(ws, dx), f32(isum)));
        }
        total = fadd(total, lane_sum(acc, lid));
    }
    if (r < rows && lane == 0u) {
        OUT[row0 + r] = total;
    }
}

// args: in_dim, rows, rows_per_group, row0. Lane l takes 8 consecutive halves per step.
@compute @workgroup_size(256)
fn mat_vec_f16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let lane = lid % 32u;
    let r = group_index(wid, nwg) * 8u + lid / 32u;
    let rr = min(r, rows - 1u);
    let xg = ((row0 + rr) / arg(2u)) * in_dim;
    let wr = rr * in_dim;
    var total = zero();
    for (var c0 = 0u; c0 < in_dim; c0 = c0 + 512u) {
        var acc = zero();
        for (var u = 0u; u < 2u; u = u + 1u) {
            let base = c0 + u * 256u + lane * 8u;
            // Four words of two halves each (rows start on a word: in_dim is even).
            for (var v = 0u; v < 8u; v = v + 2u) {
                let i = base + v;
                if (i < in_dim) {
                    let w = W[(wr + i) / 2u];
                    acc = fadd(acc, fmul(h2f(w & 0xffffu), X[xg + i]));
                    acc = fadd(acc, fmul(h2f(w >> 16u), X[xg + i + 1u]));
                }
            }
        }
        total = fadd(total, lane_sum(acc, lid));
    }
    if (r < rows && lane == 0u) {
        OUT[row0 + r] = total;
    }
}

// args: in_dim, rows, rows_per_group, row0. Lane l takes 4 consecutive values per step.
@compute @workgroup_size(256)
fn mat_vec_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let lane = lid % 32u;
    let r = group_index(wid, nwg) * 8u + lid / 32u;
    let rr = min(r, rows - 1u);
    let xg = ((row0 + rr) / arg(2u)) * in_dim;
    let wr = rr * in_dim;
    var total = zero();
    for (var c0 = 0u; c0 < in_dim; c0 = c0 + 512u) {
        var acc = zero();
        for (var u = 0u; u < 4u; u = u + 1u) {
            let base = c0 + u * 128u + lane * 4u;
            for (var v = 0u; v < 4u; v = v + 1u) {
                let i = base + v;
                if (i < in_dim) {
                    acc = fadd(acc, fmul(bitcast<f32>(W[wr + i]), X[xg + i]));
                }
            }
        }
        total = fadd(total, lane_sum(acc, lid));
    }
    if (r < rows && lane == 0u) {
        OUT[row0 + r] = total;
    }
}

// The same three matvecs with one invocation per row (the `_rows` variants), for adapters that
// run invocations on CPU cores: each invocation keeps the 32 lane sums itself, in the same order.
@compute @workgroup_size(64)
fn mat_vec_q8_0_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let d_off = arg(4u);
    let ws_off = arg(5u);
    let r = group_index(wid, nwg) * 64u + lid;
    if (r >= rows) {
        return;
    }
    let nb = in_dim / 32u;
    let g = (row0 + r) / arg(2u);
    var total = zero();
    for (var c = 0u; c < nb; c = c + 32u) {
        var acc = zero32();
        for (var l = 0u; l < 32u && c + l < nb; l = l + 1u) {
            let b = c + l;
            var isum = 0;
            let wq = (r * nb + b) * 8u;
            let xq = (g * nb + b) * 8u;
            for (var k = 0u; k < 8u; k = k + 1u) {
                isum = isum + dot4i8(W[wq + k], XQ[xq + k]);
            }
            let hi = ws_off * 2u + r * nb + b;
            let ws = h2f((W[hi / 2u] >> ((hi % 2u) * 16u)) & 0xffffu);
            let dx = bitcast<f32>(XQ[d_off + g * nb + b]);
            acc[l] = fadd(acc[l], fmul(fmul(ws, dx), f32(isum)));
        }
        total = fadd(total, tree32(&acc));
    }
    OUT[row0 + r] = total;
}

@compute @workgroup_size(64)
fn mat_vec_f16_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let r = group_index(wid, nwg) * 64u + lid;
    if (r >= rows) {
        return;
    }
    let xg = ((row0 + r) / arg(2u)) * in_dim;
    let wr = r * in_dim;
    var total = zero();
    for (var c0 = 0u; c0 < in_dim; c0 = c0 + 512u) {
        var acc = zero32();
        for (var j = 0u; j < 512u && c0 + j < in_dim; j = j + 2u) {
            // Two halves per word (in_dim is even, so a pair never straddles a chunk).
            let w = W[(wr + c0 + j) / 2u];
            let l = (j / 8u) % 32u;
            acc[l] = fadd(acc[l], fmul(h2f(w & 0xffffu), X[xg + c0 + j]));
            acc[l] = fadd(acc[l], fmul(h2f(w >> 16u), X[xg + c0 + j + 1u]));
        }
        total = fadd(total, tree32(&acc));
    }
    OUT[row0 + r] = total;
}

@compute @workgroup_size(64)
fn mat_vec_f32_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let r = group_index(wid, nwg) * 64u + lid;
    if (r >= rows) {
        return;
    }
    let xg = ((row0 + r) / arg(2u)) * in_dim;
    let wr = r * in_dim;
    var total = zero();
    for (var c0 = 0u; c0 < in_dim; c0 = c0 + 512u) {
        var acc = zero32();
        for (var j = 0u; j < 512u && c0 + j < in_dim; j = j + 1u) {
            let l = (j / 4u) % 32u;
            acc[l] = fadd(acc[l], fmul(bitcast<f32>(W[wr + c0 + j]), X[xg + c0 + j]));
        }
        total = fadd(total, tree32(&acc));
    }
    OUT[row0 + r] = total;
}
