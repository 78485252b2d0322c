// Hyper-connections: the token embedding into the HC streams, the Sinkhorn split, the weighted
// sum of streams, the post mix, and the output head's weights. Each output sums at most n_hc
// terms, sequentially, in ds4's order (the canonical order for these ops).

@group(0) @binding(2) var<storage, read_write> B0: array<f32>;
@group(0) @binding(3) var<storage, read_write> B1: array<f32>;
@group(0) @binding(4) var<storage, read_write> B2: array<f32>;
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;
// hc_post_add's second block and the sum it stores.
@group(0) @binding(9) var<storage, read_write> B3: array<f32>;
@group(0) @binding(10) var<storage, read_write> SUM: array<f32>;
// hc_post_add_moe: the routed experts' slot outputs (slot s at s * n), as moe_sum reads them.
@group(0) @binding(11) var<storage, read> SLOTS: array<f32>;
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

// The Sinkhorn's inputs (sinkhorn.wgsl): mix (B0), scale (V0), base (V1).
fn sk_mix(i: u32) -> f32 {
    return B0[i];
}
fn sk_scale(i: u32) -> f32 {
    return V0[i];
}
fn sk_base(i: u32) -> f32 {
    return V1[i];
}

// args: n_hc (at most 8), iters, eps. split (OUT) = `sinkhorn`'s [pre | post | comb].
@compute @workgroup_size(64)
fn hc_split(@builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    sinkhorn(lid, n, arg(1u), argf(2u));
    for (var j = lid; j < 2u * n + n * n; j = j + 64u) {
        OUT[j] = sp[j];
    }
}

// HcSplit and the HcWeightedSum of its pre weights in one dispatch. args: n_hc, iters, eps, len.
// Every workgroup runs the same Sinkhorn (same bits in each); workgroup 0 stores the split (OUT)
// for the HcPost that reads it. out (B2)[d] = sum_h pre[h] * hc (B1)[h*len + d], as hc_weighted_sum.
@compute @workgroup_size(256)
fn hc_split_weighted_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let len = arg(3u);
    sinkhorn(lid, n, arg(1u), argf(2u));
    let g = group_index(wid, nwg);
    if (g == 0u) {
        for (var j = lid; j < 2u * n + n * n; j = j + 256u) {
            OUT[j] = sp[j];
        }
    }
    let d = g * 256u + lid;
    if (d >= len) {
        return;
    }
    var acc = zero();
    for (var h = 0u; h < n; h = h + 1u) {
        acc = fadd(acc, fmul(B1[h * len + d], sp[h]));
    }
    B2[d] = acc;
}

// hc_split_weighted_sum with the Sinkhorn off the sum's path (the default): the sum needs only
// the pre gates, which invocations h < n make (one barrier); only workgroup 0 runs the Sinkhorn,
// on 32 lanes (`sinkhorn_lanes`: a subgroup without barriers where the adapter has them), and
// stores the split. n*n > 32 falls back to `sinkhorn` on the whole workgroup. Same values, same
// operations in the same order as hc_split_weighted_sum. args: n_hc, iters, eps, len.
@compute @workgroup_size(256)
fn hc_split_weighted_sum_lanes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                               @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let iters = arg(1u);
    let eps = argf(2u);
    let len = arg(3u);
    let g = group_index(wid, nwg);
    if (g == 0u && n * n > 32u) {
        sinkhorn(lid, n, iters, eps);
        for (var j = lid; j < 2u * n + n * n; j = j + 256u) {
            OUT[j] = sp[j];
        }
    } else {
        if (lid < n) {
            sp[lid] = hc_pre_gate(lid, eps);
        }
        workgroupBarrier();
        if (g == 0u) {
            let c = sinkhorn_comb(lid, n, iters, eps);
            if (lid < n) {
                OUT[lid] = sp[lid];
            } else if (lid < 2u * n) {
                OUT[lid] = hc_post_gate(lid);
            }
            if (lid < n * n) {
                OUT[2u * n + lid] = c;
            }
        }
    }
    let d = g * 256u + lid;
    if (d >= len) {
        return;
    }
    var acc = zero();
    for (var h = 0u; h < n; h = h + 1u) {
        acc = fadd(acc, fmul(B1[h * len + d], sp[h]));
    }
    B2[d] = acc;
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

// args: n, n_hc, with_ss. out[dst][d] = post[dst]*block[d] + sum_src comb[dst + src*n_hc] *
// residual[src][d] (block: B0, residual: B1, split: B2). The HC posts' invocations hold 4 outputs
// each, laid out as the RMS norm sums them (`post_at`); with_ss != 0 also stores their sums of
// squares (`store_sum_sq`).
@compute @workgroup_size(256)
fn hc_post(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let n_hc = arg(1u);
    let g = group_index(wid, nwg);
    let i0 = post_at(g, lid);
    var v = vec4<f32>();
    for (var k = 0u; k < 4u; k = k + 1u) {
        let i = i0 + k;
        if (i < n * n_hc) {
            v[k] = post_mix(B0[i % n], i, n, n_hc);
            OUT[i] = v[k];
        }
    }
    store_sum_sq(g, lid, v, n * n_hc, arg(2u) != 0u);
}

// The HC posts' output chunks' sums of squares (SS[c] for the 512 outputs from c * 512), which
// the next HC mix reads instead of summing the streams again (matvec.wgsl's
// mat_vec_f16_split_norm).
@group(0) @binding(12) var<storage, read_write> SS: array<f32>;
var<workgroup> post_sq: array<f32, 1024>;

// The first of the 4 consecutive outputs invocation lid of HC post workgroup g computes: the
// workgroup holds the two 512-chunks from 2g * 512, each as row_scale.wgsl's 32-lane group reads
// a chunk (lane l the 4 values from l * 4 in each step of 128), step s of the chunk on the
// invocations of its s-th group of 32.
fn post_at(g: u32, lid: u32) -> u32 {
    return (2u * g + lid / 128u) * 512u + ((lid / 32u) % 4u) * 128u + (lid % 32u) * 4u;
}

// With `store`, each chunk's sum of squares of the outputs v (the 4 from post_at(g, lid), those
// past `total` not counted) in row_scale's order: a lane adds its 16 squares step by step from +0,
// the lanes add by lane_sum, so the sum the norm would compute from the stored outputs. Call in
// uniform control flow.
fn store_sum_sq(g: u32, lid: u32, v: vec4<f32>, total: u32, store: bool) {
    if (!store) {
        return;
    }
    let i0 = post_at(g, lid);
    for (var k = 0u; k < 4u; k = k + 1u) {
        post_sq[lid * 4u + k] = fmul(v[k], v[k]);
    }
    workgroupBarrier();
    let lane = lid % 32u;
    let first_group = (lid / 32u) % 4u == 0u;
    var acc = zero();
    if (first_group) {
        for (var s = 0u; s < 4u; s = s + 1u) {
            let t = lid + s * 32u;
            for (var k = 0u; k < 4u; k = k + 1u) {
                if (i0 + s * 128u + k < total) {
                    acc = fadd(acc, post_sq[t * 4u + k]);
                }
            }
        }
    }
    let sum = lane_sum(acc, lid);
    let c = 2u * g + lid / 128u;
    if (first_group && lane == 0u && c * 512u < total) {
        SS[c] = sum;
    }
}

// hc_post's output i (stream dst = i / n, dim d = i % n) for block value `block`:
// post[dst] * block + the residual streams weighted by comb, src ascending (residual: B1, split: B2).
fn post_mix(block: f32, i: u32, n: u32, n_hc: u32) -> f32 {
    let dst = i / n;
    let d = i % n;
    var acc = fmul(block, B2[n_hc + dst]);
    for (var src = 0u; src < n_hc; src = src + 1u) {
        acc = fadd(acc, fmul(B2[2u * n_hc + dst + src * n_hc], B1[src * n + d]));
    }
    return acc;
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

// Add and HcPost in one dispatch. args: n, n_hc, with_ss. The block is block (B0) + block_b
// (B3), as `add` computes it, also stored to SUM (by the dst 0 invocations); then hc_post's sum.
@compute @workgroup_size(256)
fn hc_post_add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let g = group_index(wid, nwg);
    let i0 = post_at(g, lid);
    var v = vec4<f32>();
    for (var k = 0u; k < 4u; k = k + 1u) {
        let i = i0 + k;
        if (i < n * arg(1u)) {
            v[k] = post_add(i, B0[i % n]);
        }
    }
    store_sum_sq(g, lid, v, n * arg(1u), arg(2u) != 0u);
}

// hc_post_add whose first block is the routed experts' output, summed here as moe_sum does it:
// the n_used slots' values added in slot order from +0 (args: n, n_hc, with_ss, n_used).
@compute @workgroup_size(256)
fn hc_post_add_moe(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let g = group_index(wid, nwg);
    let i0 = post_at(g, lid);
    var v = vec4<f32>();
    for (var k = 0u; k < 4u; k = k + 1u) {
        let i = i0 + k;
        if (i < n * arg(1u)) {
            var moe = zero();
            for (var s = 0u; s < arg(3u); s = s + 1u) {
                moe = fadd(moe, SLOTS[s * n + i % n]);
            }
            v[k] = post_add(i, moe);
        }
    }
    store_sum_sq(g, lid, v, n * arg(1u), arg(2u) != 0u);
}

// Output i (< n * n_hc) of hc_post_add and hc_post_add_moe, whose first block is `a` there:
// stored, and returned.
fn post_add(i: u32, a: f32) -> f32 {
    let n = arg(0u);
    let d = i % n;
    let block = fadd(a, B3[d]);
    if (i < n) {
        SUM[d] = block;
    }
    let v = post_mix(block, i, n, arg(1u));
    OUT[i] = v;
    return v;
}
