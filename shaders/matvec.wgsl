// MatVec and MatVecGrouped: dense F16 / F32 / Q8_0 weights, every row in the canonical order
// (src/numerics.rs): chunks of 512 terms (F16: 8 per lane step, F32: 4) or 32 blocks (Q8_0: one
// block per lane), each chunk reduced by the butterfly, chunk sums added in order from +0.
// 32 lanes per row, 8 rows per workgroup. A weight larger than a storage binding is split into
// row ranges, one dispatch each: `row0` is the chunk's first row.

@group(0) @binding(2) var<storage, read> W: array<u32>;
@group(0) @binding(3) var<storage, read_write> X: array<f32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;
// The row that row_scale (row_scale.wgsl) normalizes: X itself.
fn row_x(i: u32) -> f32 {
    return X[i];
}
// Q8_0 activation: packed signed bytes, then one f32 scale per 32 values from word `d_off`.
@group(0) @binding(5) var<storage, read_write> XQ: array<u32>;

// args: n, d_off. One 32-lane group per 32-block (`q8_block`). In a chunk, one dispatch
// quantizes every row of the chunk: row wid.z, whose X and XQ start x_stride() and out_stride()
// words after the previous row's (0 in a decode program).
@compute @workgroup_size(256)
fn quantize_q8_0(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    if (!guard_at(P.pos + wid.z)) {
        return;
    }
    let n = arg(0u);
    let d_off = arg(1u);
    let xo = wid.z * x_stride();
    let qo = wid.z * out_stride();
    let lane = lid % 32u;
    let b = group_index(wid, nwg) * 8u + lid / 32u;
    let valid = b * 32u < n;
    var v = 0.0;
    if (valid) {
        v = X[xo + b * 32u + lane];
    }
    let q = q8_block(v, lid);
    if (valid && lane % 4u == 0u) {
        XQ[qo + (b * 32u + lane) / 4u] = q.x;
    }
    if (valid && lane == 0u) {
        XQ[qo + d_off + b] = q.y;
    }
}

// The Q8_0 weight and activation again, as vectors of 4 words, for mat_vec_q8_0's 16-byte loads
// (the only entry point that uses these two; naga checks bindings per entry point). Quants are
// 32 bytes per block in both, so block b is vectors 2b and 2b + 1; the backend pads both buffers
// to whole vectors.
@group(0) @binding(2) var<storage, read> W4: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> XQ4: array<vec4<u32>>;

// One lane's block of a Q8_0 row: its quants and the word holding its f16 scale (shifted down).
struct Q8Block {
    w0: vec4<u32>,
    w1: vec4<u32>,
    s: u32,
}

// mat_vec_q8_0_pair's second matrix and output.
@group(0) @binding(6) var<storage, read> W4B: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read_write> OUT2: array<f32>;

// Block b of the row whose quants start at vector wq and scales at half hs. Past nb the row's
// last block is read instead (q8_chunk drops its term), so that the loads are unconditional and
// the compiler can issue a lane's 4 blocks at once.
fn q8_load(second: bool, wq: u32, hs: u32, b: u32, nb: u32) -> Q8Block {
    let bb = min(b, nb - 1u);
    let h = hs + bb;
    let sh = (h % 2u) * 16u;
    if (second) {
        return Q8Block(W4B[wq + 2u * bb], W4B[wq + 2u * bb + 1u], W4B[h / 8u][(h / 2u) % 4u] >> sh);
    }
    return Q8Block(W4[wq + 2u * bb], W4[wq + 2u * bb + 1u], W4[h / 8u][(h / 2u) % 4u] >> sh);
}

// The lane's partial sum of one chunk, from +0: (f16(d_w) * d_x) * isum for block b < nb, +0
// past nb (whose loads read block nb - 1, unconditional as q8_load's).
fn q8_chunk(k: Q8Block, xq: u32, xd: u32, b: u32, nb: u32) -> f32 {
    let bb = min(b, nb - 1u);
    let x0 = XQ4[xq + 2u * bb];
    let x1 = XQ4[xq + 2u * bb + 1u];
    let dx = bitcast<f32>(XQ4[(xd + bb) / 4u][(xd + bb) % 4u]);
    let isum = dot4i8(k.w0.x, x0.x) + dot4i8(k.w0.y, x0.y) + dot4i8(k.w0.z, x0.z) + dot4i8(k.w0.w, x0.w)
        + dot4i8(k.w1.x, x1.x) + dot4i8(k.w1.y, x1.y) + dot4i8(k.w1.z, x1.z) + dot4i8(k.w1.w, x1.w);
    let t = fadd(zero(), fmul(fmul(h2f(k.s & 0xffffu), dx), f32(isum)));
    return select(zero(), t, b < nb);
}

// The dot product of Q8_0 row rr (of `second`'s matrix: quants from vector wq, f16 scales from
// half hs) with the Q8_0 activation (quants from vector xq, scales from word xd): 32 lanes,
// a lane reads its block as two 16-byte vectors, and the weights of 4 chunks
// (kernels/matvec.cu: Q8_EARLY_CHUNKS) are all requested before the first sum, then the chunk
// sums add in order. Call in uniform control flow.
fn q8_row(second: bool, wq: u32, hs: u32, xq: u32, xd: u32, nb: u32, lid: u32) -> f32 {
    let lane = lid % 32u;
    var total = zero();
    for (var c = 0u; c < nb; c = c + 128u) {
        let k0 = q8_load(second, wq, hs, c + lane, nb);
        let k1 = q8_load(second, wq, hs, c + 32u + lane, nb);
        let k2 = q8_load(second, wq, hs, c + 64u + lane, nb);
        let k3 = q8_load(second, wq, hs, c + 96u + lane, nb);
        // Chunks past the row's end are skipped whole (a uniform condition).
        total = fadd(total, lane_sum(q8_chunk(k0, xq, xd, c + lane, nb), lid));
        if (c + 32u < nb) {
            total = fadd(total, lane_sum(q8_chunk(k1, xq, xd, c + 32u + lane, nb), lid));
        }
        if (c + 64u < nb) {
            total = fadd(total, lane_sum(q8_chunk(k2, xq, xd, c + 64u + lane, nb), lid));
        }
        if (c + 96u < nb) {
            total = fadd(total, lane_sum(q8_chunk(k3, xq, xd, c + 96u + lane, nb), lid));
        }
    }
    return total;
}

// args: in_dim, rows (in this chunk), rows_per_group, row0, d_off (XQ scales), ws_off (word of the
// chunk's f16 scales), per (rows per 32 lanes: 1, or 2 or 4 for rows of at most 2 or 1 chunks).
// Weights repacked at upload: each row's quants (8 words per block), then all f16 scales. Block
// term: (f16(d_w) * d_x) * isum. 32 lanes per row, 8 lane groups per workgroup. In a chunk, one
// dispatch computes every token row: row wid.z, whose XQ and OUT start x_stride() and
// out_stride() words after the previous row's (0 in a decode program); so do mat_vec_f16 and
// mat_vec_f32 (with X).
@compute @workgroup_size(256)
fn mat_vec_q8_0(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    if (!guard_at(P.pos + wid.z)) {
        return;
    }
    if (arg(6u) > 1u) {
        q8_short_rows(wid, nwg, lid, arg(6u));
        return;
    }
    let xo = wid.z * x_stride();
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let d_off = arg(4u);
    let ws_off = arg(5u);
    let r = group_index(wid, nwg) * 8u + lid / 32u;
    let rr = min(r, rows - 1u);
    let nb = in_dim / 32u;
    let g = (row0 + rr) / arg(2u);
    let total = q8_row(false, rr * nb * 2u, ws_off * 2u + rr * nb, xo / 4u + g * nb * 2u, xo + d_off + g * nb, nb, lid);
    if (r < rows && lid % 32u == 0u) {
        OUT[wid.z * out_stride() + row0 + r] = total;
    }
}

// One of the 4 chunks a lane group of q8_short_rows requests together: its block (of row
// r0 + s / (4 / per), chunk s % (4 / per)) and where that row's input is.
struct Q8Slot {
    k: Q8Block,
    xq: u32,
    xd: u32,
    b: u32,
}

fn q8_slot(s: u32, per: u32, r0: u32, xo: u32, nb: u32, lane: u32) -> Q8Slot {
    let cpr = 4u / per;
    let rr = min(r0 + s / cpr, arg(1u) - 1u);
    let g = (arg(3u) + rr) / arg(2u);
    let b = (s % cpr) * 32u + lane;
    let k = q8_load(false, rr * nb * 2u, arg(5u) * 2u + rr * nb, b, nb);
    return Q8Slot(k, xo / 4u + g * nb * 2u, xo + arg(4u) + g * nb, b);
}

// The slot's chunk sum (the butterfly of its lane terms). Call in uniform control flow.
fn q8_slot_sum(a: Q8Slot, nb: u32, lid: u32) -> f32 {
    return lane_sum(q8_chunk(a.k, a.xq, a.xd, a.b, nb), lid);
}

// mat_vec_q8_0 for short rows: `per` rows per lane group, 4 for rows of one chunk (q_b: 32
// blocks), 2 for rows of two. The group requests the 4 chunks of its rows at once, as q8_row
// requests a long row's first 4, so that it keeps as many bytes in flight; each row's sum is
// q8_row's (its chunk sums added in order from +0). Call in uniform control flow.
fn q8_short_rows(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, per: u32) {
    let xo = wid.z * x_stride();
    let rows = arg(1u);
    let nb = arg(0u) / 32u;
    let lane = lid % 32u;
    let r0 = (group_index(wid, nwg) * 8u + lid / 32u) * per;
    let a0 = q8_slot(0u, per, r0, xo, nb, lane);
    let a1 = q8_slot(1u, per, r0, xo, nb, lane);
    let a2 = q8_slot(2u, per, r0, xo, nb, lane);
    let a3 = q8_slot(3u, per, r0, xo, nb, lane);
    let s0 = q8_slot_sum(a0, nb, lid);
    let s1 = q8_slot_sum(a1, nb, lid);
    let s2 = q8_slot_sum(a2, nb, lid);
    let s3 = q8_slot_sum(a3, nb, lid);
    // Row j's total: its chunk sums from +0 (chunks past the row's end skipped, a uniform test).
    var o0 = fadd(zero(), s0);
    var o1: f32;
    if (per == 4u) {
        o1 = fadd(zero(), s1);
    } else {
        if (32u < nb) {
            o0 = fadd(o0, s1);
        }
        o1 = fadd(zero(), s2);
        if (32u < nb) {
            o1 = fadd(o1, s3);
        }
    }
    if (lane == 0u) {
        let out = wid.z * out_stride() + arg(3u) + r0;
        if (r0 < rows) {
            OUT[out] = o0;
        }
        if (r0 + 1u < rows) {
            OUT[out + 1u] = o1;
        }
        if (per == 4u && r0 + 2u < rows) {
            OUT[out + 2u] = fadd(zero(), s2);
        }
        if (per == 4u && r0 + 3u < rows) {
            OUT[out + 3u] = fadd(zero(), s3);
        }
    }
}

// Two ungrouped Q8_0 matrices of the same input in one dispatch (q_a and kv, the shared expert's
// gate and up), each row as mat_vec_q8_0 computes it. args: in_dim, rows, d_off, ws_off, rows2,
// ws_off2. Rows [0, rows) are the first matrix's (W4 into OUT), then rows2 of the second (W4B
// into OUT2).
@compute @workgroup_size(256)
fn mat_vec_q8_0_pair(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let in_dim = arg(0u);
    let rows = arg(1u);
    let d_off = arg(2u);
    let rows2 = arg(4u);
    let r = group_index(wid, nwg) * 8u + lid / 32u;
    let rr = min(r, rows + rows2 - 1u);
    let nb = in_dim / 32u;
    let second = rr >= rows;
    var row = rr;
    var ws_off = arg(3u);
    if (second) {
        row = rr - rows;
        ws_off = arg(5u);
    }
    let total = q8_row(second, row * nb * 2u, ws_off * 2u + row * nb, 0u, d_off, nb, lid);
    if (r < rows + rows2 && lid % 32u == 0u) {
        if (second) {
            OUT2[row] = total;
        } else {
            OUT[row] = total;
        }
    }
}

// args: in_dim, rows, rows_per_group, row0. Lane l takes 8 consecutive halves per step.
@compute @workgroup_size(256)
fn mat_vec_f16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    if (!guard_at(P.pos + wid.z)) {
        return;
    }
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let lane = lid % 32u;
    let r = group_index(wid, nwg) * 8u + lid / 32u;
    let rr = min(r, rows - 1u);
    let xg = wid.z * x_stride() + ((row0 + rr) / arg(2u)) * in_dim;
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
        OUT[wid.z * out_stride() + row0 + r] = total;
    }
}

// args: in_dim, rows, rows_per_group, row0. Lane l takes 4 consecutive values per step.
@compute @workgroup_size(256)
fn mat_vec_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    if (!guard_at(P.pos + wid.z)) {
        return;
    }
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let lane = lid % 32u;
    let r = group_index(wid, nwg) * 8u + lid / 32u;
    let rr = min(r, rows - 1u);
    let xg = wid.z * x_stride() + ((row0 + rr) / arg(2u)) * in_dim;
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
        OUT[wid.z * out_stride() + row0 + r] = total;
    }
}

// The same three matvecs with one invocation per row (the `_rows` variants), for adapters that
// run invocations on CPU cores: each invocation keeps the 32 lane sums itself, in the same order.
// In a chunk these run once for all the chunk's rows (`chunk_rows`): each invocation computes its
// matrix row for token row 0, then 1, ..., so the weight row is read from memory once per chunk.
@compute @workgroup_size(64)
fn mat_vec_q8_0_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
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
    for (var t = 0u; t < chunk_rows(); t = t + 1u) {
        if (!guard_at(P.pos + t)) {
            continue;
        }
        let xo = t * x_stride();
        var total = zero();
        for (var c = 0u; c < nb; c = c + 32u) {
            var acc = zero32();
            for (var l = 0u; l < 32u && c + l < nb; l = l + 1u) {
                let b = c + l;
                var isum = 0;
                let wq = (r * nb + b) * 8u;
                let xq = xo + (g * nb + b) * 8u;
                for (var k = 0u; k < 8u; k = k + 1u) {
                    isum = isum + dot4i8(W[wq + k], XQ[xq + k]);
                }
                let hi = ws_off * 2u + r * nb + b;
                let ws = h2f((W[hi / 2u] >> ((hi % 2u) * 16u)) & 0xffffu);
                let dx = bitcast<f32>(XQ[xo + d_off + g * nb + b]);
                acc[l] = fadd(acc[l], fmul(fmul(ws, dx), f32(isum)));
            }
            total = fadd(total, tree32(&acc));
        }
        OUT[t * out_stride() + row0 + r] = total;
    }
}

// F16 or F32 weights (`is_f16` is the same for every invocation of a dispatch): the 32 lane sums
// of a 512-term chunk as the 32-lane kernels add them (F16: 8 consecutive halves per lane step,
// F32: 4 consecutive values).
fn mat_vec_dense_rows(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, is_f16: bool) {
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let r = group_index(wid, nwg) * 64u + lid;
    if (r >= rows) {
        return;
    }
    let wr = r * in_dim;
    for (var t = 0u; t < chunk_rows(); t = t + 1u) {
        if (!guard_at(P.pos + t)) {
            continue;
        }
        let xg = t * x_stride() + ((row0 + r) / arg(2u)) * in_dim;
        var total = zero();
        for (var c0 = 0u; c0 < in_dim; c0 = c0 + 512u) {
            var acc = zero32();
            if (is_f16) {
                for (var j = 0u; j < 512u && c0 + j < in_dim; j = j + 2u) {
                    // Two halves per word (in_dim is even, so a pair never straddles a chunk).
                    let w = W[(wr + c0 + j) / 2u];
                    let l = (j / 8u) % 32u;
                    acc[l] = fadd(acc[l], fmul(h2f(w & 0xffffu), X[xg + c0 + j]));
                    acc[l] = fadd(acc[l], fmul(h2f(w >> 16u), X[xg + c0 + j + 1u]));
                }
            } else {
                for (var j = 0u; j < 512u && c0 + j < in_dim; j = j + 1u) {
                    let l = (j / 4u) % 32u;
                    acc[l] = fadd(acc[l], fmul(bitcast<f32>(W[wr + c0 + j]), X[xg + c0 + j]));
                }
            }
            total = fadd(total, tree32(&acc));
        }
        OUT[t * out_stride() + row0 + r] = total;
    }
}

@compute @workgroup_size(64)
fn mat_vec_f16_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    mat_vec_dense_rows(wid, nwg, lid, true);
}

@compute @workgroup_size(64)
fn mat_vec_f32_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    mat_vec_dense_rows(wid, nwg, lid, false);
}

// Split-K for narrow matrices (few rows, long rows): one workgroup per row, subgroup s of its 8
// sums the chunks s, s + 8, ... into `part`, and invocation 0 adds the chunk sums in order from
// +0: the same bits as one 32-lane group doing the whole row (kernels/matvec.cu does the same
// split over blocks). Rows of at most 64 chunks. args: in_dim, rows, rows_per_group, row0.
var<workgroup> part: array<f32, 64>;

// acc plus the 8 terms w[k] * x[k] in order (w: 4 words of 2 halves; x: 8 values).
fn add8_f16(acc0: f32, w: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>) -> f32 {
    var acc = fadd(acc0, fmul(h2f(w.x & 0xffffu), x0.x));
    acc = fadd(acc, fmul(h2f(w.x >> 16u), x0.y));
    acc = fadd(acc, fmul(h2f(w.y & 0xffffu), x0.z));
    acc = fadd(acc, fmul(h2f(w.y >> 16u), x0.w));
    acc = fadd(acc, fmul(h2f(w.z & 0xffffu), x1.x));
    acc = fadd(acc, fmul(h2f(w.z >> 16u), x1.y));
    acc = fadd(acc, fmul(h2f(w.w & 0xffffu), x1.z));
    return fadd(acc, fmul(h2f(w.w >> 16u), x1.w));
}

// acc plus the 4 terms w[k] * x[k] in order.
fn add4_f32(acc0: f32, w: vec4<f32>, x: vec4<f32>) -> f32 {
    var acc = fadd(acc0, fmul(w.x, x.x));
    acc = fadd(acc, fmul(w.y, x.y));
    acc = fadd(acc, fmul(w.z, x.z));
    return fadd(acc, fmul(w.w, x.w));
}

// Input value i: x[i], or with `scaled` the RMS norm's output x[i] * xs (the same bits as the
// norm writes: mat_vec_f16_split_norm reads the norm's input).
fn xv(i: u32, xs: f32, scaled: bool) -> f32 {
    if (scaled) {
        return fmul(X[i], xs);
    }
    return X[i];
}
fn x4(i: u32, xs: f32, scaled: bool) -> vec4<f32> {
    return vec4<f32>(xv(i, xs, scaled), xv(i + 1u, xs, scaled), xv(i + 2u, xs, scaled), xv(i + 3u, xs, scaled));
}
// The split-K entry points' second matrix (two matrices of one input in one dispatch: the
// compressor's kv and score projections); `split_second` says which one this workgroup reads.
@group(0) @binding(9) var<storage, read> W2: array<u32>;
var<private> split_second: bool;

fn ws(i: u32) -> u32 {
    if (split_second) {
        return W2[i];
    }
    return W[i];
}
fn w4(i: u32) -> vec4<u32> {
    return vec4<u32>(ws(i), ws(i + 1u), ws(i + 2u), ws(i + 3u));
}

// What lane `lane` reads of a whole F16 chunk that starts at term c0: 16 weights (two vectors
// of 4 words of 2 halves) and their 16 inputs as `xv` reads them.
struct F16Terms {
    a: vec4<u32>,
    b: vec4<u32>,
    p0: vec4<f32>,
    p1: vec4<f32>,
    q0: vec4<f32>,
    q1: vec4<f32>,
}

fn load_f16(wr: u32, xg: u32, c0: u32, lane: u32, xs: f32, scaled: bool) -> F16Terms {
    let i0 = c0 + lane * 8u;
    return F16Terms(w4((wr + i0) / 2u), w4((wr + i0 + 256u) / 2u), x4(xg + i0, xs, scaled),
                    x4(xg + i0 + 4u, xs, scaled), x4(xg + i0 + 256u, xs, scaled), x4(xg + i0 + 260u, xs, scaled));
}

// Their 16 products added in order from +0.
fn f16_terms(t: F16Terms) -> f32 {
    return add8_f16(add8_f16(zero(), t.a, t.p0, t.p1), t.b, t.q0, t.q1);
}

// The 16 terms lane `lane` adds of the F16 chunk that starts at term c0 (8 consecutive per step;
// row wr and vector xg are term offsets); the input as `xv` reads it.
fn chunk_f16(wr: u32, xg: u32, c0: u32, in_dim: u32, lane: u32, xs: f32, scaled: bool) -> f32 {
    var acc = zero();
    if (c0 + 512u <= in_dim) {
        // A whole chunk: every load first, then the adds in order.
        return f16_terms(load_f16(wr, xg, c0, lane, xs, scaled));
    }
    for (var u = 0u; u < 2u; u = u + 1u) {
        let base = c0 + u * 256u + lane * 8u;
        for (var v = 0u; v < 8u; v = v + 2u) {
            let i = base + v;
            if (i < in_dim) {
                let w = ws((wr + i) / 2u);
                acc = fadd(acc, fmul(h2f(w & 0xffffu), xv(xg + i, xs, scaled)));
                acc = fadd(acc, fmul(h2f(w >> 16u), xv(xg + i + 1u, xs, scaled)));
            }
        }
    }
    return acc;
}

// The 16 terms lane `lane` adds of the F32 chunk that starts at term c0 (4 consecutive per step).
fn chunk_f32(wr: u32, xg: u32, c0: u32, in_dim: u32, lane: u32) -> f32 {
    var acc = zero();
    if (c0 + 512u <= in_dim) {
        let i0 = c0 + lane * 4u;
        let w0 = bitcast<vec4<f32>>(w4(wr + i0));
        let w1 = bitcast<vec4<f32>>(w4(wr + i0 + 128u));
        let w2 = bitcast<vec4<f32>>(w4(wr + i0 + 256u));
        let w3 = bitcast<vec4<f32>>(w4(wr + i0 + 384u));
        let y0 = x4(xg + i0, 0.0, false);
        let y1 = x4(xg + i0 + 128u, 0.0, false);
        let y2 = x4(xg + i0 + 256u, 0.0, false);
        let y3 = x4(xg + i0 + 384u, 0.0, false);
        return add4_f32(add4_f32(add4_f32(add4_f32(acc, w0, y0), w1, y1), w2, y2), w3, y3);
    }
    for (var u = 0u; u < 4u; u = u + 1u) {
        let base = c0 + u * 128u + lane * 4u;
        for (var v = 0u; v < 4u; v = v + 1u) {
            let i = base + v;
            if (i < in_dim) {
                acc = fadd(acc, fmul(bitcast<f32>(ws(wr + i)), X[xg + i]));
            }
        }
    }
    return acc;
}

// Chunk c's sum from its group's lane sums, kept (c < n_chunks) for the ordered total. Call in
// uniform control flow.
fn keep_part(acc: f32, c: u32, n_chunks: u32, lid: u32) {
    let s = lane_sum(acc, lid);
    if (c < n_chunks && lid % 32u == 0u) {
        part[c] = s;
    }
}

// One row per workgroup, chunk c on lane group c % 8, the chunk sums added in chunk order by
// invocation 0. F16 or F32 weights (`is_f16` is the same for every invocation of a dispatch);
// F16 inputs as `xv` reads them. With rows2 = arg(5) > 0 (ungrouped matrices only), workgroups
// rows .. rows + rows2 compute the rows of the second matrix (W2) into OUT2.
fn mat_vec_split(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, is_f16: bool, xs: f32, scaled: bool) {
    let in_dim = arg(0u);
    let rows = arg(1u);
    let row0 = arg(3u);
    let rows2 = arg(5u);
    let lane = lid % 32u;
    let r = group_index(wid, nwg);
    split_second = r >= rows;
    var rr = min(r, rows - 1u);
    var xg = ((row0 + rr) / arg(2u)) * in_dim;
    if (split_second) {
        rr = min(r - rows, rows2 - 1u);
        xg = 0u;
    }
    let wr = rr * in_dim;
    let n_chunks = (in_dim + 511u) / 512u;
    if (is_f16 && n_chunks > 8u && in_dim % 512u == 0u) {
        // Long F16 rows of whole chunks (the HC mixes: 32 chunks on Flash): rounds of 4 chunks
        // per group (g, g + 8, g + 16, g + 24), all four loaded before the first butterfly, as
        // row_scale does. Past the last chunk a group reloads the last one and keeps nothing.
        let last = n_chunks - 1u;
        for (var cb = 0u; cb < n_chunks; cb = cb + 32u) {
            let c = cb + lid / 32u;
            let t0 = load_f16(wr, xg, min(c, last) * 512u, lane, xs, scaled);
            let t1 = load_f16(wr, xg, min(c + 8u, last) * 512u, lane, xs, scaled);
            let t2 = load_f16(wr, xg, min(c + 16u, last) * 512u, lane, xs, scaled);
            let t3 = load_f16(wr, xg, min(c + 24u, last) * 512u, lane, xs, scaled);
            keep_part(f16_terms(t0), c, n_chunks, lid);
            if (cb + 8u < n_chunks) {
                keep_part(f16_terms(t1), c + 8u, n_chunks, lid);
            }
            if (cb + 16u < n_chunks) {
                keep_part(f16_terms(t2), c + 16u, n_chunks, lid);
            }
            if (cb + 24u < n_chunks) {
                keep_part(f16_terms(t3), c + 24u, n_chunks, lid);
            }
        }
    } else {
        for (var cb = 0u; cb < n_chunks; cb = cb + 8u) {
            let c = cb + lid / 32u;
            var acc = zero();
            if (c < n_chunks) {
                if (is_f16) {
                    acc = chunk_f16(wr, xg, c * 512u, in_dim, lane, xs, scaled);
                } else {
                    acc = chunk_f32(wr, xg, c * 512u, in_dim, lane);
                }
            }
            keep_part(acc, c, n_chunks, lid);
        }
    }
    workgroupBarrier();
    if (r < rows + rows2 && lid == 0u) {
        var total = zero();
        for (var c = 0u; c < n_chunks; c = c + 1u) {
            total = fadd(total, part[c]);
        }
        if (split_second) {
            OUT2[rr] = total;
        } else {
            OUT[row0 + r] = total;
        }
    }
}

@compute @workgroup_size(256)
fn mat_vec_f16_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    mat_vec_split(wid, nwg, lid, true, 0.0, false);
}

@compute @workgroup_size(256)
fn mat_vec_f32_split(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    mat_vec_split(wid, nwg, lid, false, 0.0, false);
}

// mat_vec_f16_split_norm's copy of the norm's output.
@group(0) @binding(8) var<storage, read_write> NORM_OUT: array<f32>;
// The row's 512-chunk sums of squares, where the HC post that wrote the row stored them
// (hc.wgsl's store_sum_sq: the sums row_scale would compute).
@group(0) @binding(10) var<storage, read> SS: array<f32>;

// RmsNorm without weight of one row (X) and the split-K F16 matvec of its output in one dispatch
// (the HC mix projections): every workgroup computes the row's scale as rms_norm does
// (row_scale, or with arg 6 != 0 from the chunk sums in SS, added in chunk order as row_scale
// adds its own), reads x * scale wherever the matvec reads the norm's output, and writes its
// share of the norm's output (NORM_OUT) for any later reader. args: in_dim, rows,
// rows_per_group (rows), row0 (0), eps, 0, from_ss.
@compute @workgroup_size(256)
fn mat_vec_f16_split_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let scale = hc_mix_norm(group_index(wid, nwg), arg(1u), lid);
    mat_vec_split(wid, nwg, lid, true, scale, true);
}

// The HC mix's norm (no weight) of X for workgroup g of `groups`: the row's scale (row_scale, or
// with arg 6 != 0 from the chunk sums in SS, added in chunk order as row_scale adds its own), and
// the workgroup's share of the norm's output in NORM_OUT. args 0 and 4: n, eps. Call in uniform
// control flow.
fn hc_mix_norm(g: u32, groups: u32, lid: u32) -> f32 {
    let n = arg(0u);
    var scale: f32;
    if (arg(6u) != 0u) {
        var ss = zero();
        for (var c = 0u; c < (n + 511u) / 512u; c = c + 1u) {
            ss = fadd(ss, SS[c]);
        }
        scale = scale_of_sum(ss, n, argf(4u));
    } else {
        scale = row_scale(0u, n, argf(4u), lid);
    }
    let per = (n + groups - 1u) / groups;
    let begin = min(g * per, n);
    let end = min(begin + per, n);
    for (var i = begin + lid; i < end; i = i + 256u) {
        NORM_OUT[i] = fmul(X[i], scale);
    }
    return scale;
}

// mat_vec_f16_split_norm at one 512-chunk per 32-lane group (kernels/fused.cu hc_pre's shape:
// 8x more lane groups streaming the weights at once): lane group k of the dispatch computes chunk
// k % n_chunks of row k / n_chunks and stores that chunk's sum at OUT[k]. Its reader (hc_pre_norm)
// adds a row's chunk sums in chunk order from +0, as mat_vec_split's invocation 0 does: the same
// bits. The scale and NORM_OUT as mat_vec_f16_split_norm. args: in_dim (whole chunks), rows,
// workgroups, 0, eps, 0, from_ss.
@compute @workgroup_size(256)
fn mat_vec_f16_chunks_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let rows = arg(1u);
    let g = group_index(wid, nwg);
    let scale = hc_mix_norm(g, arg(2u), lid);
    split_second = false;
    let nc = n / 512u;
    let k = g * 8u + lid / 32u;
    let kk = min(k, rows * nc - 1u);
    let s = lane_sum(f16_terms(load_f16((kk / nc) * n, 0u, (kk % nc) * 512u, lid % 32u, scale, true)), lid);
    if (k < rows * nc && lid % 32u == 0u) {
        OUT[k] = s;
    }
}
