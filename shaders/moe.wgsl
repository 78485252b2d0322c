// Router and routed experts. Activations are quantized to Q8_K (256-blocks), the mid vector is
// re-quantized before the down projection, as ds4's CPU path does. Expert weights are
// IQ2_XXS (16), Q2_K (10) or Q4_K (12), per tensor. An expert tensor larger than a storage
// binding is split into expert ranges [e0, e1), one dispatch per range.
//
// Expert weights are in the split layout (backends/gpu_tables.rs, repacked at upload per expert
// range): the quants of every block (64 bytes for IQ2_XXS and Q2_K, 128 for Q4_K; whole 16-byte
// vectors), then the rest of every block (IQ2_XXS: d; Q2_K: 16 scale bytes, d, dmin; Q4_K: d,
// dmin, 12 scale bytes). Block i of a range's nblk blocks is read as vectors.
//
// Q8_K scratch layout (words), for nb blocks: packed signed quants [0, 64nb) (block b's from
// word 64b: whole vectors), d (f32) [64nb, 65nb), bsums (i32) [65nb, 81nb).

@group(0) @binding(2) var<storage, read> GATE: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> UP: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> DOWN: array<vec4<u32>>;
// The Q8_K blocks as quantize_q8_k writes them (words) and as the experts read them (vectors:
// the input's, XQ4, and the mid vectors', MQ4). The backend pads both to whole vectors.
@group(0) @binding(5) var<storage, read_write> XQ: array<u32>;
@group(0) @binding(5) var<storage, read> XQ4: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read> MQ4: array<vec4<u32>>;
// The IQ2_XXS grid: 256 entries of 8 bytes.
@group(0) @binding(7) var<storage, read> GRID: array<vec2<u32>>;
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
// The top-k rounds' tree: each invocation's best candidate (value, expert), then pairs merged.
var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;
var<workgroup> sel_sh: array<i32, 16>;

const NO_EXPERT: u32 = 0xffffffffu;

// Whether candidate (v2, i2) beats (v, i): the larger value, the lower expert on ties; any
// candidate beats none.
fn beats(v2: f32, i2: u32, v: f32, i: u32) -> bool {
    return i2 != NO_EXPERT && (i == NO_EXPERT || v2 > v || (v2 == v && i2 < i));
}

// args: n_expert (at most 1024), n_used (at most 16), scale, has_bias, has_hash. logits: F0;
// p = sqrt(softplus(logit)); experts from the hash table (by token) or the top n_used of
// p + bias in the order the CPU's insertion keeps them (larger first, lower expert on ties):
// n_used rounds, each the best expert not yet taken, found by every invocation over its own
// experts (lid, lid + 256, ...) and a tree over the 256 (kernels/moe.cu: a warp argmax per
// round). Weights p[sel] / max(sum, 2^-14) * scale, by invocation 0.
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
    if (arg(4u) != 0u) {
        if (lid < n_used) {
            sel_sh[lid] = HASH[P.token * n_used + lid];
        }
    } else {
        // Bit j of `taken`: expert lid + 256 j is chosen (at most 4 per invocation).
        var taken = 0u;
        for (var k = 0u; k < n_used; k = k + 1u) {
            var v = 0.0;
            var idx = NO_EXPERT;
            for (var j = 0u; lid + 256u * j < n; j = j + 1u) {
                let i = lid + 256u * j;
                if ((taken & (1u << j)) == 0u && beats(choice[i], i, v, idx)) {
                    v = choice[i];
                    idx = i;
                }
            }
            best_v[lid] = v;
            best_i[lid] = idx;
            workgroupBarrier();
            for (var off = 128u; off > 0u; off = off / 2u) {
                if (lid < off && beats(best_v[lid + off], best_i[lid + off], best_v[lid], best_i[lid])) {
                    best_v[lid] = best_v[lid + off];
                    best_i[lid] = best_i[lid + off];
                }
                workgroupBarrier();
            }
            let win = best_i[0];
            if (win != NO_EXPERT && win % 256u == lid) {
                taken = taken | (1u << (win / 256u));
            }
            if (lid == 0u) {
                sel_sh[k] = select(-1, i32(win), win != NO_EXPERT);
            }
            // The next round's writes wait for every read of this one.
            workgroupBarrier();
        }
    }
    workgroupBarrier();
    if (lid != 0u) {
        return;
    }
    var sel: array<i32, 16>;
    for (var k = 0u; k < n_used; k = k + 1u) {
        sel[k] = sel_sh[k];
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
        XQ[b * 64u + lid] = k.word;
    }
    if (lid < 16u) {
        XQ[65u * nb + b * 16u + lid] = k.bsum;
    }
    if (lid == 0u) {
        XQ[64u * nb + b] = k.d;
    }
}

// Vector i of weight tensor `t` (0: gate, 1: up, 2: down), and word i.
fn wvec(t: u32, i: u32) -> vec4<u32> {
    if (t == 0u) {
        return GATE[i];
    }
    if (t == 1u) {
        return UP[i];
    }
    return DOWN[i];
}
fn wword(t: u32, i: u32) -> u32 {
    return wvec(t, i / 4u)[i % 4u];
}
// Byte i of a vector of 4 words held in registers.
fn vbyte(v: vec4<u32>, i: u32) -> u32 {
    return (v[i / 4u] >> ((i % 4u) * 8u)) & 255u;
}

// Vector i and word i of the Q8_K activation `a` (0: XQ4, the input's; 1: MQ4, the mid vectors').
fn avec(a: u32, i: u32) -> vec4<u32> {
    if (a == 0u) {
        return XQ4[i];
    }
    return MQ4[i];
}
fn aword(a: u32, i: u32) -> u32 {
    return avec(a, i / 4u)[i % 4u];
}
// Q8_K block b (of nb) of activation a: d, bsum j.
fn qd(a: u32, nb: u32, b: u32) -> f32 {
    return bitcast<f32>(aword(a, 64u * nb + b));
}
fn qbsum(a: u32, nb: u32, b: u32, j: u32) -> i32 {
    return i32(aword(a, 65u * nb + 16u * b + j));
}

// The IQ2_XXS grid in workgroup memory: its lookups are random, so they stay on the chip.
var<workgroup> grid_sh: array<vec2<u32>, 256>;

// Every invocation of a workgroup of `size` calls this first, in uniform control flow.
fn load_grid(lid: u32, size: u32) {
    for (var i = lid; i < 256u; i = i + size) {
        grid_sh[i] = GRID[i];
    }
    workgroupBarrier();
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

// Bit i (of the low 4) of x to bit 0 of byte i: the four shifted copies the product makes lie
// in disjoint bits, so nothing carries.
fn spread4(x: u32) -> u32 {
    return ((x & 15u) * 0x00204081u) & 0x01010101u;
}

// The 4 bytes of w, each negated (two's complement) where its bit of s (spread4) is set:
// (b ^ 0xff) + 1. Grid bytes are 8, 25 or 43, so no byte carries into the next.
fn negate_bytes(w: u32, s: u32) -> u32 {
    return (w ^ (s * 0xffu)) + s;
}

// IQ2_XXS: 8 values of grid entry gi with 7 sign bits (the 8th makes the count of negatives
// even) against two activation words: the signs applied to the grid bytes, one packed dot per
// 4 values (kernels/moe.cu's iq2_xxs_sub does the same).
fn iq2_group(gi: u32, signs7: u32, q0: u32, q1: u32) -> i32 {
    let signs = signs7 | ((countOneBits(signs7) & 1u) << 7u);
    let g = grid_sh[gi];
    return dot4I8Packed(negate_bytes(g.x, spread4(signs)), q0) + dot4I8Packed(negate_bytes(g.y, spread4(signs >> 4u)), q1);
}

// IQ2_XXS: one sub-block of 32 values (aux0: 4 grid indices; aux1: 4x7 sign bits and a 4-bit
// scale) against its 8 activation words (qa, qb), times the sub-block's scale.
fn iq2_sub(aux0: u32, aux1: u32, qa: vec4<u32>, qb: vec4<u32>) -> i32 {
    let s = iq2_group(aux0 & 255u, aux1 & 127u, qa.x, qa.y) + iq2_group((aux0 >> 8u) & 255u, (aux1 >> 7u) & 127u, qa.z, qa.w)
        + iq2_group((aux0 >> 16u) & 255u, (aux1 >> 14u) & 127u, qb.x, qb.y)
        + iq2_group(aux0 >> 24u, (aux1 >> 21u) & 127u, qb.z, qb.w);
    return s * i32(2u * (aux1 >> 28u) + 1u);
}

// block_term of an IQ2_XXS block: a vector holds two sub-blocks; d is the rest.
fn iq2_block_term(t: u32, bi: u32, nblk: u32, a: u32, nb: u32, b: u32) -> f32 {
    let yd = qd(a, nb, b);
    // The activation block's first vector.
    let ab = 16u * b;
    let w0 = wvec(t, 4u * bi);
    let w1 = wvec(t, 4u * bi + 1u);
    let w2 = wvec(t, 4u * bi + 2u);
    let w3 = wvec(t, 4u * bi + 3u);
    let dw = wword(t, 16u * nblk + bi / 2u) >> ((bi % 2u) * 16u);
    var bsum = iq2_sub(w0.x, w0.y, avec(a, ab), avec(a, ab + 1u));
    bsum = bsum + iq2_sub(w0.z, w0.w, avec(a, ab + 2u), avec(a, ab + 3u));
    bsum = bsum + iq2_sub(w1.x, w1.y, avec(a, ab + 4u), avec(a, ab + 5u));
    bsum = bsum + iq2_sub(w1.z, w1.w, avec(a, ab + 6u), avec(a, ab + 7u));
    bsum = bsum + iq2_sub(w2.x, w2.y, avec(a, ab + 8u), avec(a, ab + 9u));
    bsum = bsum + iq2_sub(w2.z, w2.w, avec(a, ab + 10u), avec(a, ab + 11u));
    bsum = bsum + iq2_sub(w3.x, w3.y, avec(a, ab + 12u), avec(a, ab + 13u));
    bsum = bsum + iq2_sub(w3.z, w3.w, avec(a, ab + 14u), avec(a, ab + 15u));
    return fmul(fmul(h2f(dw & 0xffffu), yd), f32(bsum));
}

// A Q2_K block: quants of half h (128 values) in vectors 2h (low 16 bytes) and 2h + 1; the rest
// is 16 scale bytes, then d and dmin (20 bytes: word-aligned).
struct Q2KBlock {
    q0: vec4<u32>,
    q1: vec4<u32>,
    q2: vec4<u32>,
    q3: vec4<u32>,
    sc: vec4<u32>,
    dd: u32,
}

fn q2k_load(t: u32, bi: u32, nblk: u32) -> Q2KBlock {
    let r = 16u * nblk + 5u * bi;
    return Q2KBlock(wvec(t, 4u * bi), wvec(t, 4u * bi + 1u), wvec(t, 4u * bi + 2u), wvec(t, 4u * bi + 3u),
                    vec4<u32>(wword(t, r), wword(t, r + 1u), wword(t, r + 2u), wword(t, r + 3u)), wword(t, r + 4u));
}

// The scaled integer sum of step (half, j) of block w: its 32 values against the activation's
// vectors x0 and x1 (16 values each).
fn q2k_step(w: Q2KBlock, half: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>) -> i32 {
    let ql = select(w.q0, w.q2, half == 1u);
    let qh = select(w.q1, w.q3, half == 1u);
    let sh = vec4<u32>(2u * j);
    let m = vec4<u32>(0x03030303u);
    let wl = (ql >> sh) & m;
    let wh = (qh >> sh) & m;
    let lo = dot4I8Packed(wl.x, x0.x) + dot4I8Packed(wl.y, x0.y) + dot4I8Packed(wl.z, x0.z) + dot4I8Packed(wl.w, x0.w);
    let hi = dot4I8Packed(wh.x, x1.x) + dot4I8Packed(wh.y, x1.y) + dot4I8Packed(wh.z, x1.z) + dot4I8Packed(wh.w, x1.w);
    let s = 8u * half + 2u * j;
    return i32(vbyte(w.sc, s) & 15u) * lo + i32(vbyte(w.sc, s + 1u) & 15u) * hi;
}

// Block w's term from its integer sums: (yd * d) * isum - (yd * dmin) * summs.
fn q2k_term(w: Q2KBlock, yd: f32, isum: i32, summs: i32) -> f32 {
    let dall = fmul(yd, h2f(w.dd & 0xffffu));
    let dmin = fmul(yd, h2f(w.dd >> 16u));
    return fsub(fmul(dall, f32(isum)), fmul(dmin, f32(summs)));
}

// The term of block bi (of the range's nblk) of tensor t of type ty against activation block
// (a, nb, b): the integer sums (packed 4x8 dot products) are exact in any order; the float
// combination is ds4's. Quants and activations are read as 16-byte vectors, the weight's all
// before the first sum.
fn block_term(t: u32, ty: u32, bi: u32, nblk: u32, a: u32, nb: u32, b: u32) -> f32 {
    if (ty == 16u) {
        return iq2_block_term(t, bi, nblk, a, nb, b);
    }
    let yd = qd(a, nb, b);
    // The activation block's first vector.
    let ab = 16u * b;
    if (ty == 10u) {
        let w = q2k_load(t, bi, nblk);
        var isum = 0;
        for (var half = 0u; half < 2u; half = half + 1u) {
            for (var j = 0u; j < 4u; j = j + 1u) {
                let k = ab + 8u * half + 2u * j;
                isum = isum + q2k_step(w, half, j, avec(a, k), avec(a, k + 1u));
            }
        }
        var summs = 0;
        for (var k = 0u; k < 16u; k = k + 1u) {
            summs = summs + i32(vbyte(w.sc, k) >> 4u) * qbsum(a, nb, b, k);
        }
        return q2k_term(w, yd, isum, summs);
    }
    // Q4_K: quants of sub-blocks 2c and 2c + 1 in vectors 2c and 2c + 1 (low and high nibbles);
    // the rest is d, dmin and 12 scale bytes (one vector).
    let rest = wvec(t, 8u * nblk + bi);
    let sc = vec4<u32>(rest.y, rest.z, rest.w, 0u);
    var isum = 0;
    var summs = 0;
    for (var c = 0u; c < 4u; c = c + 1u) {
        let sm1 = q4k_scale_min(sc, 2u * c);
        let sm2 = q4k_scale_min(sc, 2u * c + 1u);
        let qa = wvec(t, 8u * bi + 2u * c);
        let qb = wvec(t, 8u * bi + 2u * c + 1u);
        let k = ab + 4u * c;
        let x0 = avec(a, k);
        let x1 = avec(a, k + 1u);
        let x2 = avec(a, k + 2u);
        let x3 = avec(a, k + 3u);
        let m = vec4<u32>(0x0f0f0f0fu);
        let alo = qa & m;
        let blo = qb & m;
        let ahi = (qa >> vec4<u32>(4u)) & m;
        let bhi = (qb >> vec4<u32>(4u)) & m;
        let lo = dot4I8Packed(alo.x, x0.x) + dot4I8Packed(alo.y, x0.y) + dot4I8Packed(alo.z, x0.z)
            + dot4I8Packed(alo.w, x0.w) + dot4I8Packed(blo.x, x1.x) + dot4I8Packed(blo.y, x1.y)
            + dot4I8Packed(blo.z, x1.z) + dot4I8Packed(blo.w, x1.w);
        let hi = dot4I8Packed(ahi.x, x2.x) + dot4I8Packed(ahi.y, x2.y) + dot4I8Packed(ahi.z, x2.z)
            + dot4I8Packed(ahi.w, x2.w) + dot4I8Packed(bhi.x, x3.x) + dot4I8Packed(bhi.y, x3.y)
            + dot4I8Packed(bhi.z, x3.z) + dot4I8Packed(bhi.w, x3.w);
        isum = isum + sm1.x * lo + sm2.x * hi;
        summs = summs + sm1.y * (qbsum(a, nb, b, 4u * c) + qbsum(a, nb, b, 4u * c + 1u));
        summs = summs + sm2.y * (qbsum(a, nb, b, 4u * c + 2u) + qbsum(a, nb, b, 4u * c + 3u));
    }
    let d = fmul(yd, h2f(rest.x & 0xffffu));
    let dmin = fmul(yd, h2f(rest.x >> 16u));
    return fsub(fmul(d, f32(isum)), fmul(dmin, f32(summs)));
}

// The canonical dot of weight row (n_blocks blocks from block bi0 of the range's nblk) with
// activation (a, nb, first block b0) by `width` lanes (32, or the power of two >= n_blocks when
// that is smaller, so that 32 / width rows share 32 lanes): lane l takes block c + l of each
// 32-block chunk, the butterfly reduces the chunk (lane_sum_w: the same bits as 32 lanes of which
// the last hold +0), the chunk sums add in order. IQ2_XXS rows end with * 0.125.
fn row_dot(t: u32, ty: u32, bi0: u32, nblk: u32, n_blocks: u32, a: u32, nb: u32, b0: u32, lid: u32, width: u32) -> f32 {
    let lane = lid % width;
    var total = zero();
    for (var c = 0u; c < n_blocks; c = c + 32u) {
        var acc = zero();
        let b = c + lane;
        if (b < n_blocks) {
            acc = fadd(acc, block_term(t, ty, bi0 + b, nblk, a, nb, b0 + b));
        }
        total = fadd(total, lane_sum_w(acc, lid, width));
    }
    if (ty == 16u) {
        total = fmul(0.125, total);
    }
    return total;
}

// row_dot of the gate row (GATE) and the up row (UP) at the same place, side by side: each as
// row_dot computes it, both blocks' loads in flight together. With `iq2` (a constant of the
// entry point: both tensors IQ2_XXS) only the IQ2_XXS terms are compiled in, which leaves the
// k-quant paths' registers out.
fn gate_up_dot(g_ty: u32, u_ty: u32, bi0: u32, nblk: u32, n_blocks: u32, lid: u32, width: u32, iq2: bool) -> vec2<f32> {
    let lane = lid % width;
    var tg = zero();
    var tu = zero();
    for (var c = 0u; c < n_blocks; c = c + 32u) {
        var ag = zero();
        var au = zero();
        let b = c + lane;
        if (b < n_blocks && iq2) {
            ag = fadd(ag, iq2_block_term(0u, bi0 + b, nblk, 0u, n_blocks, b));
            au = fadd(au, iq2_block_term(1u, bi0 + b, nblk, 0u, n_blocks, b));
        } else if (b < n_blocks) {
            ag = fadd(ag, block_term(0u, g_ty, bi0 + b, nblk, 0u, n_blocks, b));
            au = fadd(au, block_term(1u, u_ty, bi0 + b, nblk, 0u, n_blocks, b));
        }
        tg = fadd(tg, lane_sum_w(ag, lid, width));
        tu = fadd(tu, lane_sum_w(au, lid, width));
    }
    if (g_ty == 16u) {
        tg = fmul(0.125, tg);
    }
    if (u_ty == 16u) {
        tu = fmul(0.125, tu);
    }
    return vec2<f32>(tg, tu);
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
    gate_up_rows(wid, nwg, lid, false);
}

// moe_gate_up for IQ2_XXS gate and up tensors (Flash's), with only their terms compiled in.
@compute @workgroup_size(256)
fn moe_gate_up_iq2_xxs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    gate_up_rows(wid, nwg, lid, true);
}

// moe_gate_up's work (`iq2`: gate_up_dot's). Call in uniform control flow.
fn gate_up_rows(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, iq2: bool) {
    load_grid(lid, 256u);
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
    let nblk = (e1 - e0) * ff * nbx;
    let gu = gate_up_dot(arg(0u), arg(1u), (el * ff + r) * nbx, nblk, nbx, lid, width, iq2);
    if (mine && lid % width == 0u) {
        F0[it] = fmul(swiglu_clamped(gu.x, gu.y, argf(9u)), WEIGHTS[slot]);
    }
}

// The first of the `n` consecutive rows (of one slot: out_dim a multiple of n) that this lane
// group of a down dispatch computes (`width` = arg 12 lanes per group): its index in the
// partial sums, whether it is this dispatch's (in range, its expert in [e0, e1)), its first
// weight block, the range's blocks, and the slot's first activation block.
struct DownRows {
    it: u32,
    mine: bool,
    bi0: u32,
    nblk: u32,
    nbm: u32,
    b0: u32,
}

fn down_rows(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, n: u32) -> DownRows {
    let out_dim = arg(5u);
    let total = arg(6u) * out_dim;
    let e0 = arg(7u);
    let e1 = arg(8u);
    let width = arg(12u);
    let first = n * (group_index(wid, nwg) * (256u / width) + lid / width);
    let it = min(first, total - n);
    let slot = it / out_dim;
    let e = u32(max(SELECTED[slot], 0));
    let el = select(0u, e - e0, e >= e0 && e < e1);
    let nbm = arg(4u) / 256u;
    return DownRows(it, first < total && e >= e0 && e < e1, (el * out_dim + it % out_dim) * nbm,
                    (e1 - e0) * out_dim * nbm, nbm, slot * nbm);
}

// args as moe_gate_up, then width for the down rows (arg 12). partial (F1)[slot][r] = down_e(row
// r) . midq[slot], for the slots whose expert is in range; `width` lanes per (slot, row).
@compute @workgroup_size(256)
fn moe_down(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    load_grid(lid, 256u);
    let d = down_rows(wid, nwg, lid, 1u);
    let v = row_dot(2u, arg(2u), d.bi0, d.nblk, d.nbm, 1u, arg(10u), d.b0, lid, arg(12u));
    if (d.mine && lid % arg(12u) == 0u) {
        F1[d.it] = v;
    }
}

// block_term of two Q2_K blocks (bi0, bi1: the same block of two rows) against one activation
// block, which is read once for both: each row's term as block_term computes it.
fn q2k_block_terms2(t: u32, bi0: u32, bi1: u32, nblk: u32, a: u32, nb: u32, b: u32) -> vec2<f32> {
    let yd = qd(a, nb, b);
    let ab = 16u * b;
    let w0 = q2k_load(t, bi0, nblk);
    let w1 = q2k_load(t, bi1, nblk);
    var isum0 = 0;
    var isum1 = 0;
    for (var half = 0u; half < 2u; half = half + 1u) {
        for (var j = 0u; j < 4u; j = j + 1u) {
            let k = ab + 8u * half + 2u * j;
            let x0 = avec(a, k);
            let x1 = avec(a, k + 1u);
            isum0 = isum0 + q2k_step(w0, half, j, x0, x1);
            isum1 = isum1 + q2k_step(w1, half, j, x0, x1);
        }
    }
    var summs0 = 0;
    var summs1 = 0;
    for (var k = 0u; k < 16u; k = k + 1u) {
        let bs = qbsum(a, nb, b, k);
        summs0 = summs0 + i32(vbyte(w0.sc, k) >> 4u) * bs;
        summs1 = summs1 + i32(vbyte(w1.sc, k) >> 4u) * bs;
    }
    return vec2<f32>(q2k_term(w0, yd, isum0, summs0), q2k_term(w1, yd, isum1, summs1));
}

// moe_down for Q2_K down tensors, two rows of one slot per `width` lanes (out_dim even): the two
// rows' blocks against one read of the slot's activation block; each row's sum as row_dot adds
// it. args as moe_down.
@compute @workgroup_size(256)
fn moe_down_q2_k_pairs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let d = down_rows(wid, nwg, lid, 2u);
    let width = arg(12u);
    let nbm = d.nbm;
    let lane = lid % width;
    var t0 = zero();
    var t1 = zero();
    for (var c = 0u; c < nbm; c = c + 32u) {
        var a0 = zero();
        var a1 = zero();
        let b = c + lane;
        if (b < nbm) {
            let terms = q2k_block_terms2(2u, d.bi0 + b, d.bi0 + nbm + b, d.nblk, 1u, arg(10u), d.b0 + b);
            a0 = fadd(a0, terms.x);
            a1 = fadd(a1, terms.y);
        }
        t0 = fadd(t0, lane_sum_w(a0, lid, width));
        t1 = fadd(t1, lane_sum_w(a1, lid, width));
    }
    if (d.mine && lane == 0u) {
        F1[d.it] = t0;
        F1[d.it + 1u] = t1;
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
fn row_dot_serial(t: u32, ty: u32, bi0: u32, nblk: u32, n_blocks: u32, a: u32, nb: u32, b0: u32) -> f32 {
    var total = zero();
    for (var c = 0u; c < n_blocks; c = c + 32u) {
        var acc = zero32();
        for (var l = 0u; l < 32u && c + l < n_blocks; l = l + 1u) {
            let b = c + l;
            acc[l] = fadd(acc[l], block_term(t, ty, bi0 + b, nblk, a, nb, b0 + b));
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
    load_grid(lid, 64u);
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
    let nblk = (arg(8u) - arg(7u)) * ff * nbx;
    let g = row_dot_serial(0u, arg(0u), (el * ff + r) * nbx, nblk, nbx, 0u, nbx, 0u);
    let u = row_dot_serial(1u, arg(1u), (el * ff + r) * nbx, nblk, nbx, 0u, nbx, 0u);
    F0[it] = fmul(swiglu_clamped(g, u, argf(9u)), WEIGHTS[slot]);
}

// moe_down with one invocation per (slot, row).
@compute @workgroup_size(64)
fn moe_down_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    load_grid(lid, 64u);
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
    let nblk = (arg(8u) - arg(7u)) * out_dim * nbm;
    let bi0 = ((e - arg(7u)) * out_dim + r) * nbm;
    F1[it] = row_dot_serial(2u, arg(2u), bi0, nblk, nbm, 1u, arg(10u), slot * nbm);
}
