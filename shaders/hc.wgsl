// Hyper-connections: the token embedding into the HC streams, the Sinkhorn split, the weighted
// sum of streams, the post mix, and the output head's weights. Each output sums at most n_hc
// terms, sequentially, in ds4's order (the canonical order for these ops).

@group(0) @binding(2) var<storage, read_write> B0: array<f32>;
@group(0) @binding(3) var<storage, read_write> B1: array<f32>;
@group(0) @binding(4) var<storage, read_write> B2: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;
// Small weight vectors (HC scale and base), as f32.
@group(0) @binding(6) var<storage, read> V0: array<f32>;
@group(0) @binding(7) var<storage, read> V1: array<f32>;
// The embedding table (F16 or F32), or the chunk of it holding tokens tok0..tok1.
@group(0) @binding(8) var<storage, read> TABLE: array<u32>;

// args: n_embd, n_hc, is_f16, tok0, tok1. out[h*n_embd + d] = table[token][d] for each stream.
@compute @workgroup_size(256)
fn embed_hc(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n_embd = arg(0u);
    let d = wid.x * 256u + lid;
    if (d >= n_embd || P.token < arg(3u) || P.token >= arg(4u)) {
        return;
    }
    let i = (P.token - arg(3u)) * n_embd + d;
    var v: f32;
    if (arg(2u) != 0u) {
        v = h2f((TABLE[i / 2u] >> ((i % 2u) * 16u)) & 0xffffu);
    } else {
        v = bitcast<f32>(TABLE[i]);
    }
    for (var h = 0u; h < arg(1u); h = h + 1u) {
        OUT[h * n_embd + d] = v;
    }
}

// args: n_hc (at most 8), iters, eps. split = [pre | post | comb] from mix (B0), scale (V0) and
// base (V1): sigmoid gates, then a softmax per dst row and Sinkhorn normalization, serially as
// the CPU reference does (24 values: one invocation is enough).
@compute @workgroup_size(1)
fn hc_split() {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let iters = arg(1u);
    let eps = argf(2u);
    for (var i = 0u; i < n; i = i + 1u) {
        OUT[i] = fadd(fdiv(1.0, fadd(1.0, ds4_exp(-fadd(fmul(B0[i], V0[0]), V1[i])))), eps);
        OUT[n + i] = fdiv(2.0, fadd(1.0, ds4_exp(-fadd(fmul(B0[n + i], V0[1]), V1[n + i]))));
    }
    // c[src + dst*n]
    var c: array<f32, 64>;
    for (var dst = 0u; dst < n; dst = dst + 1u) {
        var mx = -1.0e30;
        for (var src = 0u; src < n; src = src + 1u) {
            let k = 2u * n + src + dst * n;
            c[src + dst * n] = fadd(fmul(B0[k], V0[2]), V1[k]);
            mx = max(mx, c[src + dst * n]);
        }
        var sum = zero();
        for (var src = 0u; src < n; src = src + 1u) {
            c[src + dst * n] = ds4_exp(fsub(c[src + dst * n], mx));
            sum = fadd(sum, c[src + dst * n]);
        }
        let inv = fdiv(1.0, sum);
        for (var src = 0u; src < n; src = src + 1u) {
            c[src + dst * n] = fadd(fmul(c[src + dst * n], inv), eps);
        }
    }
    for (var it = 0u; it < iters; it = it + 1u) {
        if (it > 0u) {
            for (var dst = 0u; dst < n; dst = dst + 1u) {
                var sum = zero();
                for (var src = 0u; src < n; src = src + 1u) {
                    sum = fadd(sum, c[src + dst * n]);
                }
                let inv = fdiv(1.0, fadd(sum, eps));
                for (var src = 0u; src < n; src = src + 1u) {
                    c[src + dst * n] = fmul(c[src + dst * n], inv);
                }
            }
        }
        for (var src = 0u; src < n; src = src + 1u) {
            var sum = zero();
            for (var dst = 0u; dst < n; dst = dst + 1u) {
                sum = fadd(sum, c[src + dst * n]);
            }
            let inv = fdiv(1.0, fadd(sum, eps));
            for (var dst = 0u; dst < n; dst = dst + 1u) {
                c[src + dst * n] = fmul(c[src + dst * n], inv);
            }
        }
    }
    for (var k = 0u; k < n * n; k = k + 1u) {
        OUT[2u * n + k] = c[k];
    }
}

// args: n, n_hc. out[d] = sum_h weights[h] * hc[h*n + d] (hc: B0, weights: B1).
@compute @workgroup_size(256)
fn hc_weighted_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let d = group_index(wid, nwg) * 256u + lid;
    if (d >= n) {
        return;
    }
    var acc = zero();
    for (var h = 0u; h < arg(1u); h = h + 1u) {
        acc = fadd(acc, fmul(B0[h * n + d], B1[h]));
    }
    OUT[d] = acc;
}

// args: n, n_hc. out[dst][d] = post[dst]*block[d] + sum_src comb[dst + src*n_hc] * residual[src][d]
// (block: B0, residual: B1, split: B2).
@compute @workgroup_size(256)
fn hc_post(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let n_hc = arg(1u);
    let i = group_index(wid, nwg) * 256u + lid;
    if (i >= n * n_hc) {
        return;
    }
    let dst = i / n;
    let d = i % n;
    var acc = fmul(B0[d], B2[n_hc + dst]);
    for (var src = 0u; src < n_hc; src = src + 1u) {
        acc = fadd(acc, fmul(B2[2u * n_hc + dst + src * n_hc], B1[src * n + d]));
    }
    OUT[i] = acc;
}

// args: n, eps. w = sigmoid(pre*scale + base) + eps (pre: B0, scale: V0, base: V1).
@compute @workgroup_size(32)
fn hc_head_weights(@builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    if (lid < arg(0u)) {
        OUT[lid] = fadd(sigmoid(fadd(fmul(B0[lid], V0[0]), V1[lid])), argf(1u));
    }
}
