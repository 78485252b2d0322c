// The HC split's Sinkhorn, shared by hc.wgsl (hc_split, hc_split_weighted_sum) and norm.wgsl
// (hc_pre_norm); backends/wgpu prepends it to both. Each of them defines where the inputs are:
// sk_mix(i), sk_scale(i), sk_base(i).

// The combine matrix while Sinkhorn runs: invocation k holds element k = src + dst*n. Two
// buffers of 64, used in turn (`cm_at`: the one the last `share` wrote).
var<workgroup> cm: array<f32, 128>;
var<private> cm_at: u32;
// The split [pre | post | comb] once Sinkhorn is done (n_hc at most 8: 2n + n*n <= 80 values).
var<workgroup> sp: array<f32, 80>;

// Element k of the combine matrix after every live invocation wrote its own, in the buffer the
// previous call did not write: every read of that buffer came before the previous call's
// barrier, so one barrier (between the write and the reads) is enough.
fn share(k: u32, v: f32, live: bool) {
    cm_at = 64u - cm_at;
    if (live) {
        cm[cm_at + k] = v;
    }
    workgroupBarrier();
}

// The split = [pre | post | comb] into `sp`, from mix, scale and base: sigmoid
// gates, then a softmax per dst row and Sinkhorn normalization. Invocation k < n*n holds element
// k = src + dst*n; each row or column sum reads its n elements from workgroup memory and adds
// them in the serial reference's order (src, or dst, ascending), so every invocation computes
// exactly what the serial CPU reference does (kernels/hc.cu does the same on the lanes of a
// warp). Workgroups of at least 64; every invocation reaches every barrier.
fn sinkhorn(lid: u32, n: u32, iters: u32, eps: f32) {
    if (lid < n) {
        sp[lid] = hc_pre_gate(lid, eps);
    } else if (lid < 2u * n) {
        sp[lid] = hc_post_gate(lid);
    }
    let live = lid < n * n;
    let k = min(lid, n * n - 1u);
    let src = k % n;
    let dst = k / n;
    let row = dst * n;
    // Softmax over src for each dst row, then + eps.
    var c = fadd(fmul(sk_mix(2u * n + k), sk_scale(2u)), sk_base(2u * n + k));
    share(lid, c, live);
    var mx = -1.0e30;
    for (var s = 0u; s < n; s = s + 1u) {
        mx = max(mx, cm[cm_at + row + s]);
    }
    c = ds4_exp(fsub(c, mx));
    share(lid, c, live);
    var sum = zero();
    for (var s = 0u; s < n; s = s + 1u) {
        sum = fadd(sum, cm[cm_at + row + s]);
    }
    c = fadd(fmul(c, fdiv(1.0, sum)), eps);
    for (var it = 0u; it < iters; it = it + 1u) {
        if (it > 0u) {
            // This dst row, over src.
            share(lid, c, live);
            var t = zero();
            for (var s = 0u; s < n; s = s + 1u) {
                t = fadd(t, cm[cm_at + row + s]);
            }
            c = fmul(c, fdiv(1.0, fadd(t, eps)));
        }
        // This src column, over dst.
        share(lid, c, live);
        var t = zero();
        for (var d = 0u; d < n; d = d + 1u) {
            t = fadd(t, cm[cm_at + src + d * n]);
        }
        c = fmul(c, fdiv(1.0, fadd(t, eps)));
    }
    if (live) {
        sp[2u * n + k] = c;
    }
    workgroupBarrier();
}

// Pre gate h: sigmoid(mix * scale + base) + eps, in ds4's form. The weighted sum of the streams
// needs only these, not the Sinkhorn.
fn hc_pre_gate(h: u32, eps: f32) -> f32 {
    return fadd(fdiv(1.0, fadd(1.0, ds4_exp(-fadd(fmul(sk_mix(h), sk_scale(0u)), sk_base(h))))), eps);
}

// The combine matrix's element of this lane after `sinkhorn`'s softmax and normalization, on
// 32 lanes (n*n <= 32): lane k holds element k = src + dst*n (lanes past n*n a copy of the last)
// and reads the others through `sk_share` / `sk_at` (sinkhorn_subgroup.wgsl: a subgroup shuffle,
// no barrier; sinkhorn_shared.wgsl: workgroup memory, one barrier per share). Every sum adds the
// same values in the same order as `sinkhorn` (src, or dst, ascending), so the bits are its.
fn sinkhorn_lanes(lid: u32, n: u32, iters: u32, eps: f32) -> f32 {
    let k = min(lid % 32u, n * n - 1u);
    let src = k % n;
    let row = (k / n) * n;
    var c = fadd(fmul(sk_mix(2u * n + k), sk_scale(2u)), sk_base(2u * n + k));
    sk_share(c, lid);
    var mx = -1.0e30;
    for (var s = 0u; s < n; s = s + 1u) {
        mx = max(mx, sk_at(row + s));
    }
    c = ds4_exp(fsub(c, mx));
    sk_share(c, lid);
    var sum = zero();
    for (var s = 0u; s < n; s = s + 1u) {
        sum = fadd(sum, sk_at(row + s));
    }
    c = fadd(fmul(c, fdiv(1.0, sum)), eps);
    for (var it = 0u; it < iters; it = it + 1u) {
        if (it > 0u) {
            // This dst row, over src.
            sk_share(c, lid);
            var t = zero();
            for (var s = 0u; s < n; s = s + 1u) {
                t = fadd(t, sk_at(row + s));
            }
            c = fmul(c, fdiv(1.0, fadd(t, eps)));
        }
        // This src column, over dst.
        sk_share(c, lid);
        var t = zero();
        for (var d = 0u; d < n; d = d + 1u) {
            t = fadd(t, sk_at(src + d * n));
        }
        c = fmul(c, fdiv(1.0, fadd(t, eps)));
    }
    return c;
}

// Post gate j: 2 * sigmoid(mix * scale + base), as `sinkhorn` makes it.
fn hc_post_gate(j: u32) -> f32 {
    return fdiv(2.0, fadd(1.0, ds4_exp(-fadd(fmul(sk_mix(j), sk_scale(1u)), sk_base(j)))));
}
