// KV cache and compressor ops: fp8 / FP4 round trips, the raw ring, the compressor window state
// and the compressed-row caches. Rows are f16-rounded on store, as ds4's CPU path does.

@group(0) @binding(2) var<storage, read_write> X: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<storage, read_write> S0: array<f32>;
@group(0) @binding(5) var<storage, read_write> S1: array<f32>;
// A small weight vector (the compressor's ape), as f32.
@group(0) @binding(6) var<storage, read> V0: array<f32>;

var<workgroup> vals: array<f32, 128>;

// One workgroup of 64 per 64 non-RoPE dims; power-of-two scale from the block's amax.
@compute @workgroup_size(64)
fn fp8_round_trip(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let i = wid.x * 64u + lid;
    let v = X[i];
    vals[lid] = abs(v);
    workgroupBarrier();
    var amax = 1.0e-4;
    for (var k = 0u; k < 64u; k = k + 1u) {
        amax = max(amax, vals[k]);
    }
    let scale = pow2_ceil(fdiv(amax, 448.0));
    X[i] = fmul(e4m3_round(clamp(fdiv(v, scale), -448.0, 448.0)), scale);
}

fn e2m1(i: u32) -> f32 {
    switch (i) {
        case 0u: { return 0.0; }
        case 1u: { return 0.5; }
        case 2u: { return 1.0; }
        case 3u: { return 1.5; }
        case 4u: { return 2.0; }
        case 5u: { return 3.0; }
        case 6u: { return 4.0; }
        default: { return 6.0; }
    }
}

// Nearest E2M1 value (ties to the even code), saturating at 6.
fn e2m1_round(x: f32) -> f32 {
    var sign = 1.0;
    if (x < 0.0) {
        sign = -1.0;
    }
    let ax = min(abs(x), 6.0);
    var best = 0u;
    var best_diff = ax;
    for (var i = 1u; i < 8u; i = i + 1u) {
        let d = abs(fsub(ax, e2m1(i)));
        if (d < best_diff || (d == best_diff && i % 2u == 0u && best % 2u != 0u)) {
            best = i;
            best_diff = d;
        }
    }
    return fmul(sign, e2m1(best));
}

// One workgroup of 128 per row: Hadamard-128 (strides 1..64), then FP4 E2M1 per 32.
@compute @workgroup_size(128)
fn indexer_qat(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let row = wid.x * 128u;
    vals[lid] = X[row + lid];
    workgroupBarrier();
    for (var stride = 1u; stride < 128u; stride = stride << 1u) {
        let off = lid & (2u * stride - 1u);
        var v: f32;
        if (off < stride) {
            v = fadd(vals[lid], vals[lid + stride]);
        } else {
            v = fsub(vals[lid - stride], vals[lid]);
        }
        workgroupBarrier();
        vals[lid] = v;
        workgroupBarrier();
    }
    let v = fmul(vals[lid], DS4_HADAMARD_SCALE);
    let amax = max(lane_max(abs(v), lid), bitcast<f32>(0x01c00000u));
    let scale = pow2_ceil(fdiv(amax, 6.0));
    X[row + lid] = fmul(e2m1_round(clamp(fdiv(v, scale), -6.0, 6.0)), scale);
}

// args: dim, raw_cap. The token's KV row (X), f16-rounded, into ring row pos % raw_cap of Y.
@compute @workgroup_size(256)
fn store_raw(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let i = wid.x * 256u + lid;
    let dim = arg(0u);
    if (i < dim) {
        Y[(P.pos % arg(1u)) * dim + i] = round_f16(X[i]);
    }
}

// args: dim, ratio. This token's compressed row (X), f16-rounded, as row (pos+1)/ratio - 1 of Y.
@compute @workgroup_size(256)
fn store_comp_row(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let i = wid.x * 256u + lid;
    let dim = arg(0u);
    let n = (P.pos + 1u) / arg(1u);
    if (i < dim && n > 0u) {
        Y[(n - 1u) * dim + i] = round_f16(X[i]);
    }
}

// args: width, ratio. Window state row (4 + pos%4 for ratio 4, else pos%ratio): state_kv (S0) =
// kv (X), state_score (S1) = score (Y) + ape[pos % ratio] (V0).
@compute @workgroup_size(256)
fn compressor_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let width = arg(0u);
    let ratio = arg(1u);
    let j = wid.x * 256u + lid;
    if (j >= width) {
        return;
    }
    let pos_mod = P.pos % ratio;
    let row = select(pos_mod, 4u + pos_mod, ratio == 4u);
    S0[row * width + j] = X[j];
    S1[row * width + j] = fadd(Y[j], V0[pos_mod * width + j]);
}

// args: head_dim, ratio. Softmax pool per dim over the window (kv: S0, score: S1, out: X); ratio
// 4 mixes rows 0..4 (first half) with rows 4..8 (second half), interleaved in the sums as ds4.
@compute @workgroup_size(256)
fn compressor_pool(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let head_dim = arg(0u);
    let ratio = arg(1u);
    let j = wid.x * 256u + lid;
    if (j >= head_dim) {
        return;
    }
    let width = select(head_dim, 2u * head_dim, ratio == 4u);
    var mx = -1.0e30;
    if (ratio == 4u) {
        for (var r = 0u; r < 4u; r = r + 1u) {
            mx = max(mx, S1[r * width + j]);
        }
        for (var r = 4u; r < 8u; r = r + 1u) {
            mx = max(mx, S1[r * width + head_dim + j]);
        }
    } else {
        for (var r = 0u; r < ratio; r = r + 1u) {
            mx = max(mx, S1[r * width + j]);
        }
    }
    if (mx <= fmul(-1.0e30, 0.5)) {
        X[j] = 0.0;
        return;
    }
    var denom = zero();
    var sum = zero();
    if (ratio == 4u) {
        for (var r = 0u; r < 4u; r = r + 1u) {
            let bp = r * width + j;
            let bc = (4u + r) * width + head_dim + j;
            let wp = ds4_exp(fsub(S1[bp], mx));
            let wc = ds4_exp(fsub(S1[bc], mx));
            denom = fadd(denom, fadd(wp, wc));
            sum = fadd(sum, fmul(wp, S0[bp]));
            sum = fadd(sum, fmul(wc, S0[bc]));
        }
    } else {
        for (var r = 0u; r < ratio; r = r + 1u) {
            let b = r * width + j;
            let w = ds4_exp(fsub(S1[b], mx));
            denom = fadd(denom, w);
            sum = fadd(sum, fmul(w, S0[b]));
        }
    }
    if (denom > 0.0) {
        X[j] = fdiv(sum, denom);
    } else {
        X[j] = 0.0;
    }
}

// args: n. Ratio 4: rows 4..8 become rows 0..4, for both state_kv (S0) and state_score (S1).
@compute @workgroup_size(256)
fn compressor_shift(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n = arg(0u);
    let i = group_index(wid, nwg) * 256u + lid;
    if (i < n) {
        S0[i] = S0[n + i];
        S1[i] = S1[n + i];
    }
}
