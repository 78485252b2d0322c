// RmsNorm in the canonical order: group w of a workgroup's 32-lane groups sums the chunks w,
// w + 8, ... (512 terms each, 4 per lane step) and the chunk sums add in order.
// mean = ss / n, scale = 1 / sqrt(mean + eps), out = (x * scale) * w. `OUT` may alias `X`.

@group(0) @binding(2) var<storage, read_write> X: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(4) var<storage, read> WV: array<f32>;
// The output's Q8_0 quantization (quantize_q8_0's layout: n / 4 words of quants, then the scales).
@group(0) @binding(5) var<storage, read_write> XQ: array<u32>;
// The RoPE table (rms_norm with RoPE, kv_finish) and the raw KV ring (kv_finish).
@group(0) @binding(6) var<storage, read> TABLE: array<f32>;
@group(0) @binding(7) var<storage, read_write> CACHE: array<f32>;
// The output's Q8_K quantization, for the routed experts (quantize_q8_k's layout, n / 256 blocks:
// quants, then d, then bsums).
@group(0) @binding(9) var<storage, read_write> XK: array<u32>;
// hc_pre_norm: the HC mix, scale and base (the Sinkhorn's inputs), the split it stores, and the
// weighted sum of the streams (the norm's input, stored too).
@group(0) @binding(10) var<storage, read> MIX: array<f32>;
@group(0) @binding(11) var<storage, read> HSCALE: array<f32>;
@group(0) @binding(12) var<storage, read> HBASE: array<f32>;
@group(0) @binding(13) var<storage, read_write> SPLIT: array<f32>;
@group(0) @binding(14) var<storage, read_write> CUR: array<f32>;
// kv_finish's row, its output and its norm's weight (rms_norm_kv: beside rms_norm's X, OUT, WV).
@group(0) @binding(15) var<storage, read> KX: array<f32>;
@group(0) @binding(16) var<storage, read_write> KOUT: array<f32>;
@group(0) @binding(17) var<storage, read> KWV: array<f32>;

// The row the norm reads (row_scale.wgsl and norm_slice read it only through this): X, in
// hc_pre_norm the weighted sum of the streams in X by the pre gates, in kv_finish KX.
var<private> from_streams: bool;
var<private> from_kv: bool;
fn row_x(i: u32) -> f32 {
    if (from_streams) {
        return stream_sum(i);
    }
    if (from_kv) {
        return KX[i];
    }
    return X[i];
}

// hc_pre_norm's pre gates, made by each of its workgroups; the first four in each invocation's
// registers.
var<workgroup> pre_gates: array<f32, 8>;
var<private> gates4: vec4<f32>;

// Value d of the weighted sum of the n_hc (arg 10, at most 8) streams of n (arg 0) values in X,
// as hc_weighted_sum computes it: stream h times pre[h], h ascending, from +0. The loop's fixed
// bound lets the compiler unroll it and issue every load before the adds.
fn stream_sum(d: u32) -> f32 {
    let n = arg(0u);
    let n_hc = arg(10u);
    if (n_hc == 4u && arg(14u) != 0u) {
        // Four streams (Flash): the four loads unconditional, so that the compiler can issue a
        // whole chunk's loads at once; the same products and adds in the same order.
        let x0 = X[d];
        let x1 = X[n + d];
        let x2 = X[2u * n + d];
        let x3 = X[3u * n + d];
        return fadd(fadd(fadd(fadd(zero(), fmul(x0, gates4.x)), fmul(x1, gates4.y)), fmul(x2, gates4.z)), fmul(x3, gates4.w));
    }
    var acc = zero();
    for (var h = 0u; h < 8u; h = h + 1u) {
        if (h < n_hc) {
            acc = fadd(acc, fmul(X[h * n + d], pre_gates[h]));
        }
    }
    return acc;
}

// The Sinkhorn's inputs (sinkhorn.wgsl).
// With arg 13 = n_chunks > 0, MIX holds each mix row's chunk sums (mat_vec_f16_chunks_norm),
// added here in chunk order from +0 as mat_vec_split adds its own.
fn sk_mix(i: u32) -> f32 {
    let nc = arg(13u);
    if (nc == 0u) {
        return MIX[i];
    }
    var t = zero();
    for (var c = 0u; c < nc; c = c + 1u) {
        t = fadd(t, MIX[i * nc + c]);
    }
    return t;
}
fn sk_scale(i: u32) -> f32 {
    return HSCALE[i];
}
fn sk_base(i: u32) -> f32 {
    return HBASE[i];
}

// HcSplit, HcWeightedSum and the RmsNorm (with weight) of the weighted sum in one dispatch: the
// HC pre-mix's tail, as kernels/fused.cu's hc_pre does it. The weighted sum needs only the pre
// gates, which each workgroup makes itself (n_hc invocations); the Sinkhorn runs once, in the
// last workgroup, which stores the whole split (SPLIT) for the HcPost. Workgroups 0 .. slices
// are rms_norm's (args 0..9 are rms_norm's, without RoPE), each reading the weighted sum
// wherever rms_norm reads its row (every value computed by the same operations, so the same
// bits) and storing its slice of it (CUR). args 10..14: n_hc (at most 8), iters, eps of the HC,
// the mix's chunks per row (0: MIX holds the mix itself), and whether four streams take
// stream_sum's unconditional loads.
// The Sinkhorn's workgroup runs it on 32 lanes where n_hc * n_hc <= 32, else on all 256.
@compute @workgroup_size(256)
fn hc_pre_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n_hc = arg(10u);
    let eps = argf(12u);
    let g = group_index(wid, nwg);
    if (g == arg(5u) && n_hc * n_hc > 32u) {
        sinkhorn(lid, n_hc, arg(11u), eps);
        for (var j = lid; j < 2u * n_hc + n_hc * n_hc; j = j + 256u) {
            SPLIT[j] = sp[j];
        }
        return;
    }
    if (g == arg(5u)) {
        // As hc_split_weighted_sum_lanes: the gates, and the combine matrix on 32 lanes (no
        // barrier where the adapter has subgroups). Same bits as `sinkhorn`.
        if (lid < n_hc) {
            SPLIT[lid] = hc_pre_gate(lid, eps);
        } else if (lid < 2u * n_hc) {
            SPLIT[lid] = hc_post_gate(lid);
        }
        let c = sinkhorn_comb(lid, n_hc, arg(11u), eps);
        if (lid < n_hc * n_hc) {
            SPLIT[2u * n_hc + lid] = c;
        }
        return;
    }
    if (lid < n_hc) {
        pre_gates[lid] = hc_pre_gate(lid, eps);
    }
    workgroupBarrier();
    gates4 = vec4<f32>(pre_gates[0], pre_gates[1], pre_gates[2], pre_gates[3]);
    from_streams = true;
    let begin = g * arg(4u);
    let end = min(begin + arg(4u), arg(0u));
    for (var i = begin + lid; i < end; i = i + 256u) {
        CUR[i] = stream_sum(i);
    }
    norm_slice(g, lid, 0u, 0u);
}

// args: n, eps, has_weight, slices, per, rows * slices, q8, q8k (both: one row only; q8k: slices of
// whole 256-blocks), rope, n_rot. With rope, each row is a head whose last n_rot values are then
// rotated at the current position as rope_tail does (the query heads' norm and RoPE). Workgroup g
// normalizes row g / slices and writes its outputs [slice * per, slice * per + per); each
// workgroup of a row sums the whole row.
@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    // In a chunk, one dispatch normalizes every row of the chunk: row wid.z, whose X and OUT rows
    // start x_stride() and out_stride() words after the previous row's (0 in a decode program;
    // only without q8, q8k and rope, which write one row).
    if (!guard_at(P.pos + wid.z)) {
        return;
    }
    norm_slice(group_index(wid, nwg), lid, wid.z * x_stride(), wid.z * out_stride());
}

// rms_norm's work for workgroup `group` (uniform) of the dispatch, its row read at word xo of X
// (through row_x) and written at word oo of OUT. Call in uniform control flow.
fn norm_slice(group: u32, lid: u32, xo: u32, oo: u32) {
    let n = arg(0u);
    let eps = argf(1u);
    let has_w = arg(2u) != 0u;
    let slices = arg(3u);
    let per = arg(4u);
    // A 2D grid may hold more workgroups than rows * slices: the extra ones write nothing.
    let live = group < arg(5u);
    let g = min(group, arg(5u) - 1u);
    let row = (g / slices) * n;
    let begin = (g % slices) * per;
    var end = min(begin + per, n);
    if (!live) {
        end = begin;
    }
    let scale = row_scale(xo + row, n, eps, lid);
    let q8 = arg(6u) != 0u;
    let q8k = arg(7u) != 0u;
    let rope = arg(8u) != 0u;
    // Every invocation has read x for the sum and the scale before any output is written below.
    // Steps of 256 outputs, the same count in every invocation (q8_block has barriers); with q8,
    // each 32-lane group quantizes the block of 32 it wrote (rows of whole blocks).
    for (var i0 = begin; i0 < end; i0 = i0 + 256u) {
        let i = i0 + lid;
        var v = 0.0;
        if (i < end) {
            v = fmul(row_x(xo + row + i), scale);
            if (has_w) {
                v = fmul(v, WV[i]);
            }
        }
        if (rope) {
            // A pair's two values are in one step of 256 (even n_rot and n).
            rope_v[lid] = v;
            workgroupBarrier();
            let tail = n - arg(9u);
            if (i < end && i >= tail) {
                let pairs = arg(9u) / 2u;
                let k = (i - tail) / 2u;
                let c = TABLE[(P.pos * pairs + k) * 2u];
                let s = TABLE[(P.pos * pairs + k) * 2u + 1u];
                let first = lid - (i - tail) % 2u;
                let x0 = rope_v[first];
                let x1 = rope_v[first + 1u];
                if ((i - tail) % 2u == 0u) {
                    v = fsub(fmul(x0, c), fmul(x1, s));
                } else {
                    v = fadd(fmul(x0, s), fmul(x1, c));
                }
            }
            workgroupBarrier();
        }
        if (i < end) {
            OUT[oo + row + i] = v;
        }
        if (q8) {
            let q = q8_block(v, lid);
            if (i < end && lid % 4u == 0u) {
                XQ[i / 4u] = q.x;
            }
            if (i < end && lid % 32u == 0u) {
                XQ[n / 4u + i / 32u] = q.y;
            }
        }
        if (q8k) {
            // Steps of 256 are whole blocks here.
            let k = q8k_block(v, lid);
            let nb = n / 256u;
            let b = i0 / 256u;
            if (lid < 64u) {
                XK[b * 64u + lid] = k.word;
            }
            if (lid < 16u) {
                XK[65u * nb + b * 16u + lid] = k.bsum;
            }
            if (lid == 0u) {
                XK[64u * nb + b] = k.d;
            }
        }
    }
}

// RmsNorm of the KV row (with weight), then what follows it in ds4's attention: RoPE on its last
// n_rot dims at the current position, the fp8 round trip of the other dims (64 per block), and
// the row's f16 copy into ring row pos % raw_cap (CACHE). Each value as rms_norm, rope_tail,
// fp8_round_trip and store_raw compute it; the RoPE and fp8 parts touch different dims, so
// their order does not matter. One workgroup. args: n, eps, n_rot, raw_cap. Its row, output and
// weight are KX, KOUT and KWV.
var<workgroup> kv_row: array<f32, 1024>;
// rms_norm's outputs of one step, for the RoPE of their pairs.
var<workgroup> rope_v: array<f32, 256>;

@compute @workgroup_size(256)
fn kv_finish(@builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    kv_finish_row(lid, arg(0u), argf(1u), arg(2u), arg(3u));
}

// rms_norm's entry (args 0..9) with one more workgroup, whose index is arg 10, that runs
// kv_finish with args 11..14: the query heads' norm and RoPE beside the KV row's (plan.rs,
// kv_beside_norm), which read and write other buffers.
@compute @workgroup_size(256)
fn rms_norm_kv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let g = group_index(wid, nwg);
    if (g == arg(10u)) {
        kv_finish_row(lid, arg(11u), argf(12u), arg(13u), arg(14u));
        return;
    }
    norm_slice(g, lid, 0u, 0u);
}

// Call in uniform control flow.
fn kv_finish_row(lid: u32, n: u32, eps: f32, n_rot: u32, raw_cap: u32) {
    from_kv = true;
    let scale = row_scale(0u, n, eps, lid);
    for (var i = lid; i < n; i = i + 256u) {
        kv_row[i] = fmul(fmul(KX[i], scale), KWV[i]);
    }
    workgroupBarrier();
    let tail = n - n_rot;
    let pairs = n_rot / 2u;
    let ring = (P.pos % raw_cap) * n;
    for (var i = lid; i < n; i = i + 256u) {
        var v: f32;
        if (i < tail) {
            let b0 = i / 64u * 64u;
            var amax = 1.0e-4;
            for (var k = 0u; k < 64u; k = k + 1u) {
                amax = max(amax, abs(kv_row[b0 + k]));
            }
            let s8 = pow2_ceil(fdiv(amax, 448.0));
            v = fmul(e4m3_round(clamp(fdiv(kv_row[i], s8), -448.0, 448.0)), s8);
        } else {
            let k = (i - tail) / 2u;
            let c = TABLE[(P.pos * pairs + k) * 2u];
            let s = TABLE[(P.pos * pairs + k) * 2u + 1u];
            let x0 = kv_row[tail + 2u * k];
            let x1 = kv_row[tail + 2u * k + 1u];
            if ((i - tail) % 2u == 0u) {
                v = fsub(fmul(x0, c), fmul(x1, s));
            } else {
                v = fadd(fmul(x0, s), fmul(x1, c));
            }
        }
        KOUT[i] = v;
        CACHE[ring + i] = round_f16(v);
    }
}
