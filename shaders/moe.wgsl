// Router and routed experts. Activations are quantized to Q8_K (256-blocks), the mid vector is
// re-quantized before the down projection, as ds4's CPU path does. Expert weights are
// IQ2_XXS (16), Q2_K (10) or Q4_K (12), per tensor. An expert tensor larger than a storage
// binding is split into expert ranges [e0, e1), one dispatch per range.
//
// Q8_K scratch layout (words), for nb blocks: d (f32) [0, nb), bsums (i32) [nb, 17nb),
// packed signed quants [17nb, 81nb).

@group(0) @binding(2) var<storage, read> GATE: array<u32>;
@group(0) @binding(3) var<storage, read> UP: array<u32>;
@group(0) @binding(4) var<storage, read> DOWN: array<u32>;
@group(0) @binding(5) var<storage, read_write> XQ: array<u32>;
@group(0) @binding(6) var<storage, read_write> MQ: array<u32>;
// The IQ2_XXS grid: 256 entries of 8 bytes.
@group(0) @binding(7) var<storage, read> GRID: array<u32>;
@group(0) @binding(8) var<storage, read_write> SELECTED: array<i32>;
@group(0) @binding(9) var<storage, read_write> WEIGHTS: array<f32>;
// quantize_q8_k's input, moe_gate_up's output (mid), moe_down's per-slot partial sums.
@group(0) @binding(10) var<storage, read_write> F0: array<f32>;
@group(0) @binding(11) var<storage, read_write> F1: array<f32>;
// Router inputs: bias (f32 vector) and hash table (I32).
@group(0) @binding(12) var<storage, read> BIAS: array<f32>;
@group(0) @binding(13) var<storage, read> HASH: array<i32>;

var<workgroup> probs: array<f32, 1024>;
var<workgroup> choice: array<f32, 1024>;

// args: n_expert (at most 1024), n_used (at most 16), scale, has_bias, has_hash. logits: F0;
// p = sqrt(softplus(logit)); experts from the hash table (by token) or the top n_used of
// p + bias, kept as the CPU's insertion does (larger first, lower expert on ties); weights
// p[sel] / max(sum, 2^-14) * scale.
@compute @workgroup_size(256)
fn router_select(@builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let n_used = arg(1u);
    for (var i = lid; i < n; i = i + 256u) {
        let x = F0[i];
        var sp: f32;
        if (x > 20.0) {
            sp = x;
        } else if (x < -20.0) {
            sp = ds4_exp(x);
        } else {
            sp = ds4_log1p(ds4_exp(x));
        }
        probs[i] = sqrt_rn(sp);
        if (arg(3u) != 0u) {
            choice[i] = fadd(probs[i], BIAS[i]);
        } else {
            choice[i] = probs[i];
        }
    }
    workgroupBarrier();
    if (lid != 0u) {
        return;
    }
    var sel: array<i32, 16>;
    if (arg(4u) != 0u) {
        for (var k = 0u; k < n_used; k = k + 1u) {
            sel[k] = HASH[P.token * n_used + k];
        }
    } else {
        for (var k = 0u; k < n_used; k = k + 1u) {
            sel[k] = -1;
        }
        for (var i = 0u; i < n; i = i + 1u) {
            let s = choice[i];
            for (var j = 0u; j < n_used; j = j + 1u) {
                if (sel[j] < 0 || s > choice[sel[j]]) {
                    for (var m = n_used - 1u; m > j; m = m - 1u) {
                        sel[m] = sel[m - 1u];
                    }
                    sel[j] = i32(i);
                    break;
                }
            }
        }
    }
    var sum = zero();
    var w: array<f32, 16>;
    for (var k = 0u; k < n_used; k = k + 1u) {
        w[k] = 0.0;
        if (sel[k] >= 0 && u32(sel[k]) < n) {
            w[k] = probs[sel[k]];
        }
        sum = fadd(sum, w[k]);
    }
    sum = max(sum, 6.103515625e-5);
    for (var k = 0u; k < n_used; k = k + 1u) {
        SELECTED[k] = sel[k];
        WEIGHTS[k] = fmul(fdiv(w[k], sum), argf(2u));
    }
}

// args: nb (blocks in the output layout). One workgroup per 256 values of F0 into XQ: max is the
// value of largest magnitude (the first one on ties), iscale = -127/max, q = round(iscale * x),
// d = 1/iscale; an all-zero block gets d = 0 and zero quants.
@compute @workgroup_size(256)
fn quantize_q8_k(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let nb = arg(0u);
    let b = wid.x;
    let k = q8k_block(F0[b * 256u + lid], lid);
    if (lid < 64u) {
        XQ[17u * nb + b * 64u + lid] = k.word;
    }
    if (lid < 16u) {
        XQ[nb + b * 16u + lid] = k.bsum;
    }
    if (lid == 0u) {
        XQ[b] = k.d;
    }
}

// Word i of weight tensor `t` (0: gate, 1: up, 2: down).
fn wword(t: u32, i: u32) -> u32 {
    if (t == 0u) {
        return GATE[i];
    }
    if (t == 1u) {
        return UP[i];
    }
    return DOWN[i];
}
// The f16 at byte i (even: it never straddles two words), one word load.
fn wu16(t: u32, i: u32) -> u32 {
    return (wword(t, i / 4u) >> ((i % 4u) * 8u)) & 0xffffu;
}
// Byte i of a vector of 4 words held in registers.
fn vbyte(v: vec4<u32>, i: u32) -> u32 {
    return (v[i / 4u] >> ((i % 4u) * 8u)) & 255u;
}
// A u32 that starts half a word into lo (its high half, then hi's low half) when `straddle`,
// else lo itself.
fn funnel16(lo: u32, hi: u32, straddle: bool) -> u32 {
    return select(lo, (lo >> 16u) | (hi << 16u), straddle);
}

// Q8_K block b of the activation (0: XQ, 1: MQ) with nb blocks: d, bsum j.
fn qd(a: u32, nb: u32, b: u32) -> f32 {
    if (a == 0u) {
        return bitcast<f32>(XQ[b]);
    }
    return bitcast<f32>(MQ[b]);
}
fn qbsum(a: u32, nb: u32, b: u32, j: u32) -> i32 {
    if (a == 0u) {
        return i32(XQ[nb + b * 16u + j]);
    }
    return i32(MQ[nb + b * 16u + j]);
}

// Q4_K 6-bit scale and min of sub-block j (0..8) from its 12 scale bytes (bytes 0..12 of sc).
fn q4k_scale_min(sc: vec4<u32>, j: u32) -> vec2<i32> {
    if (j < 4u) {
        return vec2<i32>(i32(vbyte(sc, j) & 63u), i32(vbyte(sc, j + 4u) & 63u));
    }
    let s = (vbyte(sc, j + 4u) & 15u) | ((vbyte(sc, j - 4u) >> 6u) << 4u);
    let m = (vbyte(sc, j + 4u) >> 4u) | ((vbyte(sc, j) >> 6u) << 4u);
    return vec2<i32>(i32(s), i32(m));
}

// Word k (4 quants) of Q8_K block (a, nb, b).
fn qword(a: u32, nb: u32, b: u32, k: u32) -> u32 {
    if (a == 0u) {
        return XQ[17u * nb + b * 64u + k];
    }
    return MQ[17u * nb + b * 64u + k];
}

// 0xff in each byte whose bit (of the low 4) is set.
fn byte_mask(bits: u32) -> u32 {
    return select(0u, 0xffu, (bits & 1u) != 0u) | select(0u, 0xff00u, (bits & 2u) != 0u)
        | select(0u, 0xff0000u, (bits & 4u) != 0u) | select(0u, 0xff000000u, (bits & 8u) != 0u);
}

// The term of one 256-block (its first byte at `at`) of tensor t of type ty against activation
// block (a, nb, b): the integer sums (packed 4x8 dot products) are exact in any order; the float
// combination is ds4's.
fn block_term(t: u32, ty: u32, at: u32, a: u32, nb: u32, b: u32) -> f32 {
    let yd = qd(a, nb, b);
    if (ty == 16u) {
        // IQ2_XXS: f16 d, then per 32 values two u32: 4 grid indices, 4x7 sign bits + 4-bit scale.
        // Grid bytes are below 128, so a negated byte is the same bytes subtracted. Blocks are
        // 66 bytes, so a block's u32s start on a word or half a word past one: whole-word loads,
        // joined where they straddle (3 loads per 8 bytes instead of one per byte).
        let straddle = (at % 4u) == 0u;
        let w0 = (at + 2u) / 4u;
        var bsum = 0;
        for (var ib = 0u; ib < 8u; ib = ib + 1u) {
            let a0 = wword(t, w0 + 2u * ib);
            let a1 = wword(t, w0 + 2u * ib + 1u);
            let a2 = wword(t, w0 + 2u * ib + 2u);
            let aux0 = funnel16(a0, a1, straddle);
            let aux1 = funnel16(a1, a2, straddle);
            var sumi = 0;
            for (var l = 0u; l < 4u; l = l + 1u) {
                let gi = (aux0 >> (8u * l)) & 255u;
                var signs = (aux1 >> (7u * l)) & 127u;
                signs = signs | ((countOneBits(signs) & 1u) << 7u);
                let k = 8u * ib + 2u * l;
                let g0 = GRID[gi * 2u];
                let g1 = GRID[gi * 2u + 1u];
                let m0 = byte_mask(signs);
                let m1 = byte_mask(signs >> 4u);
                let q0 = qword(a, nb, b, k);
                let q1 = qword(a, nb, b, k + 1u);
                sumi = sumi + dot4I8Packed(g0 & ~m0, q0) - dot4I8Packed(g0 & m0, q0);
                sumi = sumi + dot4I8Packed(g1 & ~m1, q1) - dot4I8Packed(g1 & m1, q1);
            }
            bsum = bsum + sumi * i32(2u * (aux1 >> 28u) + 1u);
        }
        return fmul(fmul(h2f(wu16(t, at)), yd), f32(bsum));
    }
    let w = at / 4u;
    if (ty == 10u) {
        // Q2_K: scales[16], qs[64], f16 d, f16 dmin. Blocks are 84 bytes: word-aligned. Each
        // word of quants and scales is loaded once.
        let sc = vec4<u32>(wword(t, w), wword(t, w + 1u), wword(t, w + 2u), wword(t, w + 3u));
        var isum = 0;
        for (var half = 0u; half < 2u; half = half + 1u) {
            let q = w + 4u + 8u * half;
            let ql = vec4<u32>(wword(t, q), wword(t, q + 1u), wword(t, q + 2u), wword(t, q + 3u));
            let qh = vec4<u32>(wword(t, q + 4u), wword(t, q + 5u), wword(t, q + 6u), wword(t, q + 7u));
            for (var j = 0u; j < 4u; j = j + 1u) {
                let sh = 2u * j;
                let k = 32u * half + 8u * j;
                let wl = (ql >> vec4<u32>(sh)) & vec4<u32>(0x03030303u);
                let wh = (qh >> vec4<u32>(sh)) & vec4<u32>(0x03030303u);
                let lo = dot4I8Packed(wl.x, qword(a, nb, b, k)) + dot4I8Packed(wl.y, qword(a, nb, b, k + 1u))
                    + dot4I8Packed(wl.z, qword(a, nb, b, k + 2u)) + dot4I8Packed(wl.w, qword(a, nb, b, k + 3u));
                let hi = dot4I8Packed(wh.x, qword(a, nb, b, k + 4u)) + dot4I8Packed(wh.y, qword(a, nb, b, k + 5u))
                    + dot4I8Packed(wh.z, qword(a, nb, b, k + 6u)) + dot4I8Packed(wh.w, qword(a, nb, b, k + 7u));
                isum = isum + i32(vbyte(sc, 8u * half + 2u * j) & 15u) * lo
                    + i32(vbyte(sc, 8u * half + 2u * j + 1u) & 15u) * hi;
            }
        }
        var summs = 0;
        for (var k = 0u; k < 16u; k = k + 1u) {
            summs = summs + i32(vbyte(sc, k) >> 4u) * qbsum(a, nb, b, k);
        }
        let dd = wword(t, w + 20u);
        let dall = fmul(yd, h2f(dd & 0xffffu));
        let dmin = fmul(yd, h2f(dd >> 16u));
        return fsub(fmul(dall, f32(isum)), fmul(dmin, f32(summs)));
    }
    // Q4_K: f16 d, f16 dmin, scales[12], qs[128]. Blocks are 144 bytes: word-aligned.
    let dd = wword(t, w);
    let sc = vec4<u32>(wword(t, w + 1u), wword(t, w + 2u), wword(t, w + 3u), 0u);
    var isum = 0;
    var summs = 0;
    for (var c = 0u; c < 4u; c = c + 1u) {
        let sm1 = q4k_scale_min(sc, 2u * c);
        let sm2 = q4k_scale_min(sc, 2u * c + 1u);
        var lo = 0;
        var hi = 0;
        for (var m = 0u; m < 8u; m = m + 1u) {
            let q = wword(t, w + 4u + 8u * c + m);
            lo = lo + dot4I8Packed(q & 0x0f0f0f0fu, qword(a, nb, b, 16u * c + m));
            hi = hi + dot4I8Packed((q >> 4u) & 0x0f0f0f0fu, qword(a, nb, b, 16u * c + 8u + m));
        }
        isum = isum + sm1.x * lo + sm2.x * hi;
        summs = summs + sm1.y * (qbsum(a, nb, b, 4u * c) + qbsum(a, nb, b, 4u * c + 1u));
        summs = summs + sm2.y * (qbsum(a, nb, b, 4u * c + 2u) + qbsum(a, nb, b, 4u * c + 3u));
    }
    let d = fmul(yd, h2f(dd & 0xffffu));
    let dmin = fmul(yd, h2f(dd >> 16u));
    return fsub(fmul(d, f32(isum)), fmul(dmin, f32(summs)));
}

fn block_bytes(ty: u32) -> u32 {
    if (ty == 16u) {
        return 66u;
    }
    if (ty == 10u) {
        return 84u;
    }
    return 144u;
}

// The canonical dot of a weight row (n_blocks 256-blocks from byte `at`) with activation (a, nb,
// first block b0) by `width` lanes (32, or the power of two >= n_blocks when that is smaller,
// so that 32 / width rows share 32 lanes): lane l takes block c + l of each 32-block chunk, the
// butterfly reduces the chunk (lane_sum_w: the same bits as 32 lanes of which the last hold
// +0), the chunk sums add in order. IQ2_XXS rows end with * 0.125.
fn row_dot(t: u32, ty: u32, at: u32, n_blocks: u32, a: u32, nb: u32, b0: u32, lid: u32, width: u32) -> f32 {
    let lane = lid % width;
    var total = zero();
    for (var c = 0u; c < n_blocks; c = c + 32u) {
        var acc = zero();
        let b = c + lane;
        if (b < n_blocks) {
            acc = fadd(acc, block_term(t, ty, at + b * block_bytes(ty), a, nb, b0 + b));
        }
        total = fadd(total, lane_sum_w(acc, lid, width));
    }
    if (ty == 16u) {
        total = fmul(0.125, total);
    }
    return total;
}

// args: gate_ty, up_ty, down_ty, in_dim, ff, out_dim, n_used, e0, e1, clamp, n_mid_blocks,
// width (lanes per row: 32, fewer for rows of fewer than 32 blocks).
// mid (F0)[slot][r] = silu(min(gate,c)) * clamp(up,+-c) * weight[slot], for the slots whose
// expert is in this dispatch's range; `width` lanes per (slot, row), 256 / width per workgroup.
@compute @workgroup_size(256)
fn moe_gate_up(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let in_dim = arg(3u);
    let ff = arg(4u);
    let n_used = arg(6u);
    let e0 = arg(7u);
    let e1 = arg(8u);
    let width = arg(11u);
    let item = group_index(wid, nwg) * (256u / width) + lid / width;
    let it = min(item, n_used * ff - 1u);
    let slot = it / ff;
    let r = it % ff;
    let e = u32(max(SELECTED[slot], 0));
    let mine = item < n_used * ff && e >= e0 && e < e1;
    let el = select(0u, e - e0, e >= e0 && e < e1);
    let nbx = in_dim / 256u;
    let g_at = (el * ff + r) * nbx * block_bytes(arg(0u));
    let u_at = (el * ff + r) * nbx * block_bytes(arg(1u));
    let g = row_dot(0u, arg(0u), g_at, nbx, 0u, nbx, 0u, lid, width);
    let u = row_dot(1u, arg(1u), u_at, nbx, 0u, nbx, 0u, lid, width);
    if (mine && lid % width == 0u) {
        F0[it] = fmul(swiglu_clamped(g, u, argf(9u)), WEIGHTS[slot]);
    }
}

// args as moe_gate_up, then width for the down rows (arg 12). partial (F1)[slot][r] = down_e(row
// r) . midq[slot], for the slots whose expert is in range; `width` lanes per (slot, row).
@compute @workgroup_size(256)
fn moe_down(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let ff = arg(4u);
    let out_dim = arg(5u);
    let n_used = arg(6u);
    let e0 = arg(7u);
    let e1 = arg(8u);
    let width = arg(12u);
    let item = group_index(wid, nwg) * (256u / width) + lid / width;
    let it = min(item, n_used * out_dim - 1u);
    let slot = it / out_dim;
    let r = it % out_dim;
    let e = u32(max(SELECTED[slot], 0));
    let mine = item < n_used * out_dim && e >= e0 && e < e1;
    let el = select(0u, e - e0, e >= e0 && e < e1);
    let nbm = ff / 256u;
    let at = (el * out_dim + r) * nbm * block_bytes(arg(2u));
    let v = row_dot(2u, arg(2u), at, nbm, 1u, arg(10u), slot * nbm, lid, width);
    if (mine && lid % width == 0u) {
        F1[it] = v;
    }
}

// args: out_dim, n_used. out (F0)[r] = sum over slots, in order from +0, of partial (F1)[slot][r].
@compute @workgroup_size(256)
fn moe_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let out_dim = arg(0u);
    let r = group_index(wid, nwg) * 256u + lid;
    if (r >= out_dim) {
        return;
    }
    var acc = zero();
    for (var s = 0u; s < arg(1u); s = s + 1u) {
        acc = fadd(acc, F1[s * out_dim + r]);
    }
    F0[r] = acc;
}

// row_dot by one invocation holding the 32 lane sums (the `_rows` variants below).
fn row_dot_serial(t: u32, ty: u32, at: u32, n_blocks: u32, a: u32, nb: u32, b0: u32) -> f32 {
    var total = zero();
    for (var c = 0u; c < n_blocks; c = c + 32u) {
        var acc = zero32();
        for (var l = 0u; l < 32u && c + l < n_blocks; l = l + 1u) {
            let b = c + l;
            acc[l] = fadd(acc[l], block_term(t, ty, at + b * block_bytes(ty), a, nb, b0 + b));
        }
        total = fadd(total, tree32(&acc));
    }
    if (ty == 16u) {
        total = fmul(0.125, total);
    }
    return total;
}

// moe_gate_up with one invocation per (slot, row), for adapters that run on CPU cores.
@compute @workgroup_size(64)
fn moe_gate_up_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let in_dim = arg(3u);
    let ff = arg(4u);
    let n_used = arg(6u);
    let it = group_index(wid, nwg) * 64u + lid;
    if (it >= n_used * ff) {
        return;
    }
    let slot = it / ff;
    let r = it % ff;
    let e = u32(max(SELECTED[slot], 0));
    if (e < arg(7u) || e >= arg(8u)) {
        return;
    }
    let el = e - arg(7u);
    let nbx = in_dim / 256u;
    let g = row_dot_serial(0u, arg(0u), (el * ff + r) * nbx * block_bytes(arg(0u)), nbx, 0u, nbx, 0u);
    let u = row_dot_serial(1u, arg(1u), (el * ff + r) * nbx * block_bytes(arg(1u)), nbx, 0u, nbx, 0u);
    F0[it] = fmul(swiglu_clamped(g, u, argf(9u)), WEIGHTS[slot]);
}

// moe_down with one invocation per (slot, row).
@compute @workgroup_size(64)
fn moe_down_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let ff = arg(4u);
    let out_dim = arg(5u);
    let n_used = arg(6u);
    let it = group_index(wid, nwg) * 64u + lid;
    if (it >= n_used * out_dim) {
        return;
    }
    let slot = it / out_dim;
    let r = it % out_dim;
    let e = u32(max(SELECTED[slot], 0));
    if (e < arg(7u) || e >= arg(8u)) {
        return;
    }
    let nbm = ff / 256u;
    let at = ((e - arg(7u)) * out_dim + r) * nbm * block_bytes(arg(2u));
    F1[it] = row_dot_serial(2u, arg(2u), at, nbm, 1u, arg(10u), slot * nbm);
}
