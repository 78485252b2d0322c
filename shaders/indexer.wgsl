// The indexer: score every visible compressed row, then pick the top_k rows (ties to the lower
// row), written in ascending row order.

@group(0) @binding(2) var<storage, read_write> Q: array<f32>;
@group(0) @binding(3) var<storage, read_write> WTS: array<f32>;
@group(0) @binding(4) var<storage, read_write> CACHE: array<f32>;
@group(0) @binding(5) var<storage, read_write> SCORES: array<f32>;
@group(0) @binding(6) var<storage, read_write> SEL: array<i32>;
// One flag per row of capacity (scratch).
@group(0) @binding(7) var<storage, read_write> TAKEN: array<u32>;

var<workgroup> term: array<f32, 128>;

fn comp_rows(ratio: u32, cap: u32) -> u32 {
    return min((P.pos + 1u) / ratio, cap);
}

// args: n_head (at most 128), head_dim, scale, ratio, cap. One workgroup per row of capacity;
// group w of 32 lanes takes heads w, w + 8, ...: dot(q_h, k) in the canonical f32 order; then one
// invocation adds the head terms max(dot, 0) * (w_h * scale) sequentially.
@compute @workgroup_size(256)
fn indexer_scores(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n_head = arg(0u);
    let hd = arg(1u);
    let scale = argf(2u);
    let c = group_index(wid, nwg);
    if (c >= comp_rows(arg(3u), arg(4u))) {
        return;
    }
    let lane = lid % 32u;
    for (var hb = 0u; hb < n_head; hb = hb + 8u) {
        let h = min(hb + lid / 32u, n_head - 1u);
        var total = zero();
        for (var c0 = 0u; c0 < hd; c0 = c0 + 512u) {
            var acc = zero();
            for (var u = 0u; u < 4u; u = u + 1u) {
                let base = c0 + u * 128u + lane * 4u;
                for (var v = 0u; v < 4u; v = v + 1u) {
                    let i = base + v;
                    if (i < hd) {
                        acc = fadd(acc, fmul(CACHE[c * hd + i], Q[h * hd + i]));
                    }
                }
            }
            total = fadd(total, lane_sum(acc, lid));
        }
        if (lane == 0u && hb + lid / 32u < n_head) {
            term[h] = fmul(max(total, 0.0), fmul(WTS[h], scale));
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        var t = zero();
        for (var h = 0u; h < n_head; h = h + 1u) {
            t = fadd(t, term[h]);
        }
        SCORES[c] = t;
    }
}

var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;

// args: top_k, ratio, cap. One workgroup: top_k rounds of a workgroup argmax over the rows not
// taken yet (largest score above -1e30, lower row on ties; none: row 0, as ds4), then the taken
// rows in ascending order, the rest of the output 0.
@compute @workgroup_size(256)
fn indexer_top_k(@builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let top_k = arg(0u);
    let n = comp_rows(arg(1u), arg(2u));
    for (var c = lid; c < n; c = c + 256u) {
        TAKEN[c] = 0u;
    }
    storageBarrier();
    let k = min(top_k, n);
    for (var pick = 0u; pick < k; pick = pick + 1u) {
        var v = -1.0e30;
        var idx = 0xffffffffu;
        for (var c = lid; c < n; c = c + 256u) {
            if (TAKEN[c] == 0u && SCORES[c] > v) {
                v = SCORES[c];
                idx = c;
            }
        }
        best_v[lid] = v;
        best_i[lid] = idx;
        workgroupBarrier();
        if (lid == 0u) {
            var bv = best_v[0];
            var bi = best_i[0];
            for (var t = 1u; t < 256u; t = t + 1u) {
                if (best_i[t] != 0xffffffffu && (bi == 0xffffffffu || best_v[t] > bv || (best_v[t] == bv && best_i[t] < bi))) {
                    bv = best_v[t];
                    bi = best_i[t];
                }
            }
            if (bi == 0xffffffffu) {
                bi = 0u;
            }
            TAKEN[bi] = 1u;
        }
        storageBarrier();
    }
    if (lid == 0u) {
        var m = 0u;
        for (var c = 0u; c < n; c = c + 1u) {
            if (TAKEN[c] != 0u) {
                SEL[m] = i32(c);
                m = m + 1u;
            }
        }
        for (; m < top_k; m = m + 1u) {
            SEL[m] = 0;
        }
    }
}
