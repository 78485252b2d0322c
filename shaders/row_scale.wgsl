// The RMS norm's scale of a row, in the canonical order: 32-lane group w of a workgroup sums the
// chunks w, w + 8, ... (512 terms each, 4 per lane step) and the chunk sums add in order. Shared
// by norm.wgsl and matvec.wgsl (backends/wgpu prepends it to both), each of which defines
// `row_x(i)`, the row's value i (X[i], or in norm.wgsl's hc_pre_norm a value it computes).

var<workgroup> chunk_sums: array<f32, 64>;
var<workgroup> scale_sh: f32;

// The 16 values lane `lane` squares of a whole chunk (4 consecutive per step), from x[i] on
// (i: the chunk's first value plus 4 * lane).
struct Values16 {
    a: vec4<f32>,
    b: vec4<f32>,
    c: vec4<f32>,
    d: vec4<f32>,
}

fn load16(i: u32) -> Values16 {
    return Values16(vec4<f32>(row_x(i), row_x(i + 1u), row_x(i + 2u), row_x(i + 3u)),
                    vec4<f32>(row_x(i + 128u), row_x(i + 129u), row_x(i + 130u), row_x(i + 131u)),
                    vec4<f32>(row_x(i + 256u), row_x(i + 257u), row_x(i + 258u), row_x(i + 259u)),
                    vec4<f32>(row_x(i + 384u), row_x(i + 385u), row_x(i + 386u), row_x(i + 387u)));
}

// Their squares added in order from +0.
fn squares16(v: Values16) -> f32 {
    var acc = zero();
    acc = fadd(fadd(fadd(fadd(acc, fmul(v.a.x, v.a.x)), fmul(v.a.y, v.a.y)), fmul(v.a.z, v.a.z)), fmul(v.a.w, v.a.w));
    acc = fadd(fadd(fadd(fadd(acc, fmul(v.b.x, v.b.x)), fmul(v.b.y, v.b.y)), fmul(v.b.z, v.b.z)), fmul(v.b.w, v.b.w));
    acc = fadd(fadd(fadd(fadd(acc, fmul(v.c.x, v.c.x)), fmul(v.c.y, v.c.y)), fmul(v.c.z, v.c.z)), fmul(v.c.w, v.c.w));
    return fadd(fadd(fadd(fadd(acc, fmul(v.d.x, v.d.x)), fmul(v.d.y, v.d.y)), fmul(v.d.z, v.d.z)), fmul(v.d.w, v.d.w));
}

// The 16 squares lane `lane` adds of the chunk that starts at x[c0] (4 consecutive per step).
fn chunk_squares(row: u32, c0: u32, n: u32, lane: u32) -> f32 {
    var acc = zero();
    if (c0 + 512u <= n) {
        // A whole chunk: every load first, then the adds in order.
        return squares16(load16(row + c0 + lane * 4u));
    }
    for (var u = 0u; u < 4u; u = u + 1u) {
        let base = c0 + u * 128u + lane * 4u;
        for (var v = 0u; v < 4u; v = v + 1u) {
            let i = base + v;
            if (i < n) {
                let x = row_x(row + i);
                acc = fadd(acc, fmul(x, x));
            }
        }
    }
    return acc;
}

// Chunk c's sum of squares from its group's lane sums, kept (c < n_chunks) for the ordered total.
// Call in uniform control flow.
fn keep_chunk_sum(acc: f32, c: u32, n_chunks: u32, lid: u32) {
    let s = lane_sum(acc, lid);
    if (c < n_chunks && lid % 32u == 0u) {
        chunk_sums[c] = s;
    }
}

// 1 / sqrt(mean + eps) of n values whose squares add to ss.
fn scale_of_sum(ss: f32, n: u32, eps: f32) -> f32 {
    return fdiv(1.0, sqrt_rn(fadd(fdiv(ss, f32(n)), eps)));
}

// 1 / sqrt(mean + eps) of row `row` (its first value's index) of n values: 32-lane group w sums
// the chunks w, w + 8, ... and the chunk sums add in order. Every invocation reads its part of
// the row before the scale is returned (workgroups of 256, uniform control flow).
fn row_scale(row: u32, n: u32, eps: f32, lid: u32) -> f32 {
    let lane = lid % 32u;
    let n_chunks = (n + 511u) / 512u;
    if (n_chunks > 8u && n % 512u == 0u) {
        // Long rows of whole chunks (the HC streams, 32 chunks on Flash): rounds of 4 chunks per
        // group (g, g + 8, g + 16, g + 24), all four loaded before the first butterfly instead of
        // one chunk's latency after another. Past the last chunk a group reloads the last one
        // (in bounds) and keeps nothing.
        let last = n_chunks - 1u;
        for (var cb = 0u; cb < n_chunks; cb = cb + 32u) {
            let c = cb + lid / 32u;
            let v0 = load16(row + min(c, last) * 512u + lane * 4u);
            let v1 = load16(row + min(c + 8u, last) * 512u + lane * 4u);
            let v2 = load16(row + min(c + 16u, last) * 512u + lane * 4u);
            let v3 = load16(row + min(c + 24u, last) * 512u + lane * 4u);
            keep_chunk_sum(squares16(v0), c, n_chunks, lid);
            if (cb + 8u < n_chunks) {
                keep_chunk_sum(squares16(v1), c + 8u, n_chunks, lid);
            }
            if (cb + 16u < n_chunks) {
                keep_chunk_sum(squares16(v2), c + 16u, n_chunks, lid);
            }
            if (cb + 24u < n_chunks) {
                keep_chunk_sum(squares16(v3), c + 24u, n_chunks, lid);
            }
        }
    } else {
        for (var cb = 0u; cb < n_chunks; cb = cb + 8u) {
            let c = cb + lid / 32u;
            var acc = zero();
            if (c < n_chunks) {
                acc = chunk_squares(row, c * 512u, n, lane);
            }
            keep_chunk_sum(acc, c, n_chunks, lid);
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        var ss = zero();
        for (var c = 0u; c < n_chunks; c = c + 1u) {
            ss = fadd(ss, chunk_sums[c]);
        }
        scale_sh = scale_of_sum(ss, n, eps);
    }
    workgroupBarrier();
    return scale_sh;
}
