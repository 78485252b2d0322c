// The RMS norm's scale of a row, in the canonical order: 32-lane group w of a workgroup sums the
// chunks w, w + 8, ... (512 terms each, 4 per lane step) and the chunk sums add in order. Shared
// by norm.wgsl and matvec.wgsl (backends/wgpu prepends it to both), each of which declares the
// row's buffer as `X`.

var<workgroup> chunk_sums: array<f32, 64>;
var<workgroup> scale_sh: f32;

// The 16 squares lane `lane` adds of the chunk that starts at x[c0] (4 consecutive per step).
fn chunk_squares(row: u32, c0: u32, n: u32, lane: u32) -> f32 {
    var acc = zero();
    if (c0 + 512u <= n) {
        // A whole chunk: every load first, then the adds in order.
        let i = row + c0 + lane * 4u;
        let a = vec4<f32>(X[i], X[i + 1u], X[i + 2u], X[i + 3u]);
        let b = vec4<f32>(X[i + 128u], X[i + 129u], X[i + 130u], X[i + 131u]);
        let c = vec4<f32>(X[i + 256u], X[i + 257u], X[i + 258u], X[i + 259u]);
        let d = vec4<f32>(X[i + 384u], X[i + 385u], X[i + 386u], X[i + 387u]);
        acc = fadd(fadd(fadd(fadd(acc, fmul(a.x, a.x)), fmul(a.y, a.y)), fmul(a.z, a.z)), fmul(a.w, a.w));
        acc = fadd(fadd(fadd(fadd(acc, fmul(b.x, b.x)), fmul(b.y, b.y)), fmul(b.z, b.z)), fmul(b.w, b.w));
        acc = fadd(fadd(fadd(fadd(acc, fmul(c.x, c.x)), fmul(c.y, c.y)), fmul(c.z, c.z)), fmul(c.w, c.w));
        return fadd(fadd(fadd(fadd(acc, fmul(d.x, d.x)), fmul(d.y, d.y)), fmul(d.z, d.z)), fmul(d.w, d.w));
    }
    for (var u = 0u; u < 4u; u = u + 1u) {
        let base = c0 + u * 128u + lane * 4u;
        for (var v = 0u; v < 4u; v = v + 1u) {
            let i = base + v;
            if (i < n) {
                let x = X[row + i];
                acc = fadd(acc, fmul(x, x));
            }
        }
    }
    return acc;
}

// 1 / sqrt(mean + eps) of row `row` (its first value's index) of n values: 32-lane group w sums
// the chunks w, w + 8, ... and the chunk sums add in order. Every invocation reads its part of
// the row before the scale is returned (workgroups of 256, uniform control flow).
fn row_scale(row: u32, n: u32, eps: f32, lid: u32) -> f32 {
    let lane = lid % 32u;
    let n_chunks = (n + 511u) / 512u;
    for (var cb = 0u; cb < n_chunks; cb = cb + 8u) {
        let c = cb + lid / 32u;
        var acc = zero();
        if (c < n_chunks) {
            acc = chunk_squares(row, c * 512u, n, lane);
        }
        let s = lane_sum(acc, lid);
        if (c < n_chunks && lane == 0u) {
            chunk_sums[c] = s;
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        var ss = zero();
        for (var c = 0u; c < n_chunks; c = c + 1u) {
            ss = fadd(ss, chunk_sums[c]);
        }
        scale_sh = fdiv(1.0, sqrt_rn(fadd(fdiv(ss, f32(n)), eps)));
    }
    workgroupBarrier();
    return scale_sh;
}
