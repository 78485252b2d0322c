// Token sampling on the device: the definition is in src/sample.rs (module docs); these entries
// pick the token `sample::pick` picks for the same draw, bit for bit, so only its 4-byte id goes
// back to the host (kernels/sample.cu is the CUDA version). Dispatched after a token, not part of
// it; workgroups of 256; the sliced entries take SMP_SLICE logits per workgroup.
//
// Greedy: sample_argmax_part (each workgroup's best), then sample_argmax_final. Otherwise:
// sample_hist and sample_pick four times (a radix select, 8 bits a pass, of the K-th largest order
// key among the finite logits, as sample.cu), sample_gather (the keys above it, and the keys equal
// to it when all of those are taken, in any order), then sample_final on one workgroup: the lowest
// ids equal to it when only some are taken, the sort by (logit descending, id ascending), the
// weights, the sequential sums, the cut as min(a, b + 1) and the draw.
// The logits are read as bits; every float operation on a value that could be subnormal goes
// through softfloat.wgsl (the host keeps subnormals, NVIDIA's driver flushes them).

struct SampleParams {
    n: u32,
    // DeviceSample::candidates().
    k: u32,
    // f32 bits: the temperature, top-p, min-p and the uniform draw.
    temperature: u32,
    top_p: u32,
    min_p: u32,
    r: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(2) var<storage, read> LOGITS: array<u32>;
// The selection's state (ST_*), the gathered candidates, the argmax partials.
@group(0) @binding(3) var<storage, read_write> ST: array<u32>;
// The radix histogram (256 bins), then the gather's slot counter.
@group(0) @binding(4) var<storage, read_write> HIST: array<atomic<u32>>;
@group(0) @binding(5) var<uniform> SP: SampleParams;

// SMP_SLICE, SMP_CAP (sample::CANDIDATE_CAP), ST_OUT (the id), ST_CAND (the candidates as
// (key, id) pairs) and ST_PART (a (key, id) per workgroup of sample_argmax_part) come from
// backends/wgpu, prepended; the words before ST_CAND are cleared before each non-greedy draw.
const ST_THRESH: u32 = 0u;
const ST_MASK: u32 = 1u;
const ST_REMAIN: u32 = 2u;
const ST_K: u32 = 3u;
const ST_PASS: u32 = 4u;
const ST_NEQ: u32 = 5u;
const HIST_SLOT: u32 = 256u;
const SMP_NONE: u32 = 0xffffffffu;

fn smp_finite(b: u32) -> bool {
    return (b & 0x7f800000u) != 0x7f800000u;
}

// A float's position in f32::total_cmp order, as an unsigned key.
fn smp_key(b: u32) -> u32 {
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

// The argmax's key: the order of `>`, NaN below everything (never taken: nothing is taken unless
// above -inf's key), -0 equal to +0.
fn smp_argmax_key(b: u32) -> u32 {
    if (sf_is_nan(b)) {
        return 0u;
    }
    return sf_order(b);
}

var<workgroup> smp_bk: array<u32, 256>;
var<workgroup> smp_bi: array<u32, 256>;

fn smp_better(k1: u32, i1: u32, k2: u32, i2: u32) -> bool {
    return k1 > k2 || (k1 == k2 && i1 < i2);
}

// The largest key of logits first, first + 256, ... below end, and its lowest id (SMP_NONE when
// none is above -inf).
fn smp_scan_best(first: u32, end: u32) -> vec2<u32> {
    var bk = sf_order(0xff800000u);
    var bi = SMP_NONE;
    for (var i = first; i < end; i = i + 256u) {
        let k = smp_argmax_key(LOGITS[i]);
        if (k > bk) {
            bk = k;
            bi = i;
        }
    }
    return vec2<u32>(bk, bi);
}

// The best (key, id) of the workgroup, by smp_better (any order gives the same). Uniform control flow.
fn smp_reduce_best(v: vec2<u32>, lid: u32) -> vec2<u32> {
    smp_bk[lid] = v.x;
    smp_bi[lid] = v.y;
    workgroupBarrier();
    for (var off = 128u; off > 0u; off = off / 2u) {
        if (lid < off && smp_better(smp_bk[lid + off], smp_bi[lid + off], smp_bk[lid], smp_bi[lid])) {
            smp_bk[lid] = smp_bk[lid + off];
            smp_bi[lid] = smp_bi[lid + off];
        }
        workgroupBarrier();
    }
    let r = vec2<u32>(smp_bk[0], smp_bi[0]);
    workgroupBarrier();
    return r;
}

fn smp_argmax_id(best: vec2<u32>) -> u32 {
    return select(best.y, 0u, best.y == SMP_NONE);
}

@compute @workgroup_size(256)
fn sample_argmax_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wid.x * SMP_SLICE;
    let best = smp_reduce_best(smp_scan_best(base + lid, min(base + SMP_SLICE, SP.n)), lid);
    if (lid == 0u) {
        ST[ST_PART + 2u * wid.x] = best.x;
        ST[ST_PART + 2u * wid.x + 1u] = best.y;
    }
}

@compute @workgroup_size(256)
fn sample_argmax_final(@builtin(local_invocation_index) lid: u32) {
    let groups = (SP.n + SMP_SLICE - 1u) / SMP_SLICE;
    var bk = sf_order(0xff800000u);
    var bi = SMP_NONE;
    for (var g = lid; g < groups; g = g + 256u) {
        let k = ST[ST_PART + 2u * g];
        let i = ST[ST_PART + 2u * g + 1u];
        if (smp_better(k, i, bk, bi)) {
            bk = k;
            bi = i;
        }
    }
    let best = smp_reduce_best(vec2<u32>(bk, bi), lid);
    if (lid == 0u) {
        ST[ST_OUT] = smp_argmax_id(best);
    }
}

var<workgroup> smp_lh: array<atomic<u32>, 256>;

// One pass of the radix select: the histogram of digit ST_PASS (from the top) of the finite keys
// that match the digits found so far.
@compute @workgroup_size(256)
fn sample_hist(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let npass = ST[ST_PASS];
    let shift = 24u - 8u * npass;
    let thresh = ST[ST_THRESH];
    let mask = ST[ST_MASK];
    // Nothing finite (K is known after the first pass): nothing to count.
    let live = npass == 0u || ST[ST_K] != 0u;
    atomicStore(&smp_lh[lid], 0u);
    workgroupBarrier();
    let base = wid.x * SMP_SLICE;
    let end = min(base + SMP_SLICE, SP.n);
    for (var i = base + lid; i < end; i = i + 256u) {
        let b = LOGITS[i];
        let key = smp_key(b);
        if (live && smp_finite(b) && (key & mask) == thresh) {
            atomicAdd(&smp_lh[(key >> shift) & 255u], 1u);
        }
    }
    workgroupBarrier();
    let c = atomicLoad(&smp_lh[lid]);
    if (c != 0u) {
        atomicAdd(&HIST[lid], c);
    }
}

var<workgroup> smp_h: array<u32, 256>;

// The digit of this pass (sample.cu's), then the histogram cleared for the next.
@compute @workgroup_size(256)
fn sample_pick(@builtin(local_invocation_index) lid: u32) {
    smp_h[lid] = atomicLoad(&HIST[lid]);
    workgroupBarrier();
    if (lid == 0u) {
        let npass = ST[ST_PASS];
        let shift = 24u - 8u * npass;
        if (npass == 0u) {
            // The first pass counts every finite logit: K is known now.
            var finite = 0u;
            for (var d = 0u; d < 256u; d = d + 1u) {
                finite = finite + smp_h[d];
            }
            let k = min(SP.k, finite);
            ST[ST_K] = k;
            ST[ST_REMAIN] = k;
        }
        let want = ST[ST_REMAIN];
        var above = 0u;
        var d = 255u;
        loop {
            if (d == 0u || above + smp_h[d] >= want) {
                break;
            }
            above = above + smp_h[d];
            d = d - 1u;
        }
        ST[ST_THRESH] = ST[ST_THRESH] | (d << shift);
        ST[ST_MASK] = ST[ST_MASK] | (255u << shift);
        ST[ST_REMAIN] = want - above;
        ST[ST_NEQ] = smp_h[d];
        ST[ST_PASS] = npass + 1u;
    }
    atomicStore(&HIST[lid], 0u);
}

// The candidates above the threshold key, and those equal to it when every one is taken.
@compute @workgroup_size(256)
fn sample_gather(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let thresh = ST[ST_THRESH];
    let all_eq = ST[ST_NEQ] == ST[ST_REMAIN];
    if (ST[ST_K] == 0u) {
        return;
    }
    let base = wid.x * SMP_SLICE;
    let end = min(base + SMP_SLICE, SP.n);
    for (var i = base + lid; i < end; i = i + 256u) {
        let b = LOGITS[i];
        let key = smp_key(b);
        if (smp_finite(b) && (key > thresh || (all_eq && key == thresh))) {
            let slot = atomicAdd(&HIST[HIST_SLOT], 1u);
            if (slot < SMP_CAP) {
                ST[ST_CAND + 2u * slot] = key;
                ST[ST_CAND + 2u * slot + 1u] = i;
            }
        }
    }
}

// Keys, then the weights' bits; ids; the prefix sums of the weights.
var<workgroup> smp_ck: array<u32, 1024>;
var<workgroup> smp_ci: array<u32, 1024>;
var<workgroup> smp_pf: array<f32, 1024>;
var<workgroup> smp_u: array<u32, 4>;
var<workgroup> smp_cut: atomic<u32>;

@compute @workgroup_size(256)
fn sample_final(@builtin(local_invocation_index) lid: u32) {
    Z = P.zero;
    if (lid == 0u) {
        smp_u[0] = ST[ST_K];
        smp_u[1] = ST[ST_REMAIN];
        smp_u[2] = ST[ST_NEQ];
        smp_u[3] = ST[ST_THRESH];
    }
    let k = workgroupUniformLoad(&smp_u[0]);
    let need_eq = workgroupUniformLoad(&smp_u[1]);
    let n_eq = workgroupUniformLoad(&smp_u[2]);
    let thresh = workgroupUniformLoad(&smp_u[3]);
    let n = SP.n;
    if (k == 0u) {
        // No finite logit: the argmax of them all.
        var best = vec2<u32>(sf_order(0xff800000u), SMP_NONE);
        for (var base = 0u; base < n; base = base + SMP_SLICE) {
            let b = smp_scan_best(base + lid, min(base + SMP_SLICE, n));
            if (smp_better(b.x, b.y, best.x, best.y)) {
                best = b;
            }
        }
        best = smp_reduce_best(best, lid);
        if (lid == 0u) {
            ST[ST_OUT] = smp_argmax_id(best);
        }
        return;
    }
    let got = select(k - need_eq, k, n_eq == need_eq);
    for (var c = lid; c < got; c = c + 256u) {
        smp_ck[c] = ST[ST_CAND + 2u * c];
        smp_ci[c] = ST[ST_CAND + 2u * c + 1u];
    }
    if (n_eq != need_eq) {
        // Only some keys equal to the threshold are candidates: the lowest ids. Each invocation
        // counts them in its own range of ids, then writes its own from its rank on.
        let span = (n + 255u) / 256u;
        let first = min(lid * span, n);
        let end = min(first + span, n);
        var mine = 0u;
        for (var i = first; i < end; i = i + 1u) {
            let b = LOGITS[i];
            if (smp_finite(b) && smp_key(b) == thresh) {
                mine = mine + 1u;
            }
        }
        var rank = scan_before(mine, lid).x;
        for (var i = first; i < end && rank < need_eq; i = i + 1u) {
            let b = LOGITS[i];
            if (smp_finite(b) && smp_key(b) == thresh) {
                smp_ck[got + rank] = thresh;
                smp_ci[got + rank] = i;
                rank = rank + 1u;
            }
        }
    }
    // Bitonic sort, descending by (key, !id), over the next power of two >= k; padding last.
    var width = 1u;
    while (width < k) {
        width = width * 2u;
    }
    for (var c = k + lid; c < width; c = c + 256u) {
        smp_ck[c] = 0u;
        smp_ci[c] = SMP_NONE;
    }
    workgroupBarrier();
    for (var size = 2u; size <= width; size = size * 2u) {
        for (var stride = size / 2u; stride > 0u; stride = stride / 2u) {
            for (var i = lid; i < width; i = i + 256u) {
                let j = i ^ stride;
                if (j > i) {
                    let xk = smp_ck[i];
                    let xi = smp_ci[i];
                    let yk = smp_ck[j];
                    let yi = smp_ci[j];
                    let x_before_y = xk > yk || (xk == yk && xi < yi);
                    let y_before_x = yk > xk || (yk == xk && yi < xi);
                    if (select(x_before_y, y_before_x, (i & size) == 0u)) {
                        smp_ck[i] = yk;
                        smp_ci[i] = yi;
                        smp_ck[j] = xk;
                        smp_ci[j] = xi;
                    }
                }
            }
            workgroupBarrier();
        }
    }
    // Weights exp((l - l_0) / T), one per invocation, into smp_ck.
    let l0 = LOGITS[smp_ci[0]];
    for (var c = lid; c < k; c = c + 256u) {
        let x = sf_div(sf_sub(LOGITS[smp_ci[c]], l0), SP.temperature);
        smp_ck[c] = bitcast<u32>(ds4_exp(bitcast<f32>(x)));
    }
    workgroupBarrier();
    if (lid == 0u) {
        var s = zero();
        for (var c = 0u; c < k; c = c + 1u) {
            s = fadd(s, bitcast<f32>(smp_ck[c]));
            smp_pf[c] = s;
        }
        atomicStore(&smp_cut, k);
    }
    workgroupBarrier();
    // The cut: the first c > 0 under min-p, or just after the first c whose prefix reaches top-p.
    let sum = bitcast<u32>(smp_pf[k - 1u]);
    let min_prob = sf_mul(sf_div(smp_ck[0], sum), SP.min_p);
    var cut = k;
    for (var c = lid; c < k; c = c + 256u) {
        if (c > 0u && sf_lt(sf_div(smp_ck[c], sum), min_prob)) {
            cut = min(cut, c);
        }
        if (sf_ge(sf_div(bitcast<u32>(smp_pf[c]), sum), SP.top_p)) {
            cut = min(cut, c + 1u);
        }
    }
    atomicMin(&smp_cut, cut);
    workgroupBarrier();
    if (lid == 0u) {
        let kept = atomicLoad(&smp_cut);
        var r = sf_mul(SP.r, bitcast<u32>(smp_pf[kept - 1u]));
        var pick = kept - 1u;
        for (var c = 0u; c < kept; c = c + 1u) {
            r = sf_sub(r, smp_ck[c]);
            if (sf_le0(r)) {
                pick = c;
                break;
            }
        }
        ST[ST_OUT] = smp_ci[pick];
    }
}
