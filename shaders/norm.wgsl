// RmsNorm in the canonical order: one workgroup per row; group w of 32 lanes sums the chunks w,
// w + 8, ... (512 terms each, 4 per lane step) and the chunk sums add in order.
// mean = ss / n, scale = 1 / sqrt(mean + eps), out = (x * scale) * w. `OUT` may alias `X`.

@group(0) @binding(2) var<storage, read_write> X: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(4) var<storage, read> WV: array<f32>;

var<workgroup> chunk_sums: array<f32, 64>;
var<workgroup> scale_sh: f32;

// args: n, eps, has_weight.
@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let eps = argf(1u);
    let has_w = arg(2u) != 0u;
    let row = wid.x * n;
    let lane = lid % 32u;
    let n_chunks = (n + 511u) / 512u;
    for (var cb = 0u; cb < n_chunks; cb = cb + 8u) {
        let c = cb + lid / 32u;
        var acc = zero();
        for (var u = 0u; u < 4u; u = u + 1u) {
            let base = c * 512u + u * 128u + lane * 4u;
            for (var v = 0u; v < 4u; v = v + 1u) {
                let i = base + v;
                if (c < n_chunks && i < n) {
                    let x = X[row + i];
                    acc = fadd(acc, fmul(x, x));
                }
            }
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
    for (var i = lid; i < n; i = i + 256u) {
        let v = fmul(X[row + i], scale);
        if (has_w) {
            OUT[row + i] = fmul(v, WV[i]);
        } else {
            OUT[row + i] = v;
        }
    }
}
