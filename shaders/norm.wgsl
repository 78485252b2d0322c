// RmsNorm in the canonical order: group w of a workgroup's 32-lane groups sums the chunks w,
// w + 8, ... (512 terms each, 4 per lane step) and the chunk sums add in order.
// mean = ss / n, scale = 1 / sqrt(mean + eps), out = (x * scale) * w. `OUT` may alias `X`.

@group(0) @binding(2) var<storage, read_write> X: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(4) var<storage, read> WV: array<f32>;

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

// args: n, eps, has_weight, slices, per, rows * slices. Workgroup g normalizes row g / slices and writes its
// outputs [slice * per, slice * per + per); each workgroup of a row sums the whole row.
@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let eps = argf(1u);
    let has_w = arg(2u) != 0u;
    let slices = arg(3u);
    let per = arg(4u);
    // A 2D grid may hold more workgroups than rows * slices: the extra ones write nothing.
    let live = group_index(wid, nwg) < arg(5u);
    let g = min(group_index(wid, nwg), arg(5u) - 1u);
    let row = (g / slices) * n;
    let begin = (g % slices) * per;
    var end = min(begin + per, n);
    if (!live) {
        end = begin;
    }
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
    let scale = scale_sh;
    // Every invocation has read x for the sum and the scale before any output is written below.
    for (var i = begin + lid; i < end; i = i + 256u) {
        let v = fmul(X[row + i], scale);
        if (has_w) {
            OUT[row + i] = fmul(v, WV[i]);
        } else {
            OUT[row + i] = v;
        }
    }
}
