// The indexer: score every visible compressed row, then pick the top_k rows (ties to the lower
// row), written in ascending row order.

@group(0) @binding(2) var<storage, read_write> Q: array<f32>;
@group(0) @binding(3) var<storage, read_write> WTS: array<f32>;
@group(0) @binding(4) var<storage, read_write> CACHE: array<f32>;
@group(0) @binding(5) var<storage, read_write> SCORES: array<f32>;
@group(0) @binding(6) var<storage, read_write> SEL: array<i32>;

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

// The order-preserving key of a score: larger scores, larger keys; 0 for a row that is never
// picked (at or below -1e30, or NaN). -0 takes +0's key (as integers: a compiler may not keep a
// float -0 apart), as the float comparison ranks them equal.
fn top_k_key(s: f32) -> u32 {
    if (!(s > -1.0e30)) {
        return 0u;
    }
    var u = bitcast<u32>(s);
    if (u == 0x80000000u) {
        u = 0u;
    }
    if ((u & 0x80000000u) != 0u) {
        return ~u;
    }
    return u | 0x80000000u;
}

var<workgroup> hist: array<atomic<u32>, 256>;
var<workgroup> pickable: atomic<u32>;
var<workgroup> pick_info: array<u32, 3>;

// args: top_k, ratio, cap. One workgroup. The canonical pick (the CPU's top_k_ascending) takes
// k = min(top_k, rows) times the best untaken row above -1e30, ties to the lower row, row 0 when
// none is left; written in ascending row order, the rest of the output 0. The same set without k
// rounds: a radix select (four 8-bit passes over the keys) finds the key T of the last row taken
// from the pickable rows and how many rows of key T are taken (the lowest ones); a prefix count
// then writes the set in row order (kernels/indexer.cu does the same).
@compute @workgroup_size(256)
fn indexer_top_k(@builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let top_k = arg(0u);
    let n = comp_rows(arg(1u), arg(2u));
    let k = min(top_k, n);
    if (lid == 0u) {
        atomicStore(&pickable, 0u);
    }
    workgroupBarrier();
    var mine = 0u;
    for (var c = lid; c < n; c = c + 256u) {
        if (top_k_key(SCORES[c]) != 0u) {
            mine = mine + 1u;
        }
    }
    atomicAdd(&pickable, mine);
    workgroupBarrier();
    if (lid == 0u) {
        pick_info[0] = atomicLoad(&pickable);
    }
    let n_pick = workgroupUniformLoad(&pick_info[0]);
    let want = min(k, n_pick);
    var prefix = 0u;
    var mask = 0u;
    var need = want;
    if (want > 0u) {
        for (var step = 0u; step < 4u; step = step + 1u) {
            let shift = 24u - 8u * step;
            atomicStore(&hist[lid], 0u);
            workgroupBarrier();
            for (var c = lid; c < n; c = c + 256u) {
                let key = top_k_key(SCORES[c]);
                if (key != 0u && (key & mask) == prefix) {
                    atomicAdd(&hist[(key >> shift) & 255u], 1u);
                }
            }
            workgroupBarrier();
            if (lid == 0u) {
                // The digit holding the need-th largest key among those matching the prefix.
                var above = 0u;
                var d = 255u;
                loop {
                    let h = atomicLoad(&hist[d]);
                    if (above + h >= need) {
                        break;
                    }
                    above = above + h;
                    d = d - 1u;
                }
                pick_info[1] = d;
                pick_info[2] = need - above;
            }
            let digit = workgroupUniformLoad(&pick_info[1]);
            need = workgroupUniformLoad(&pick_info[2]);
            prefix = prefix | (digit << shift);
            mask = mask | (255u << shift);
        }
    }
    // Rows with a key above T, and the first `need` rows of key T, in row order; row 0 as well
    // when fewer than k rows are pickable.
    let fallback = n_pick < k;
    var written = 0u;
    var ties_seen = 0u;
    for (var base = 0u; base < n; base = base + 256u) {
        let c = base + lid;
        var key = 0u;
        if (c < n) {
            key = top_k_key(SCORES[c]);
        }
        let tie = want > 0u && key != 0u && key == prefix;
        let tc = scan_before(select(0u, 1u, tie), lid);
        let sel = (want > 0u && key != 0u && (key > prefix || (tie && ties_seen + tc.x < need))) || (fallback && c == 0u);
        let sc = scan_before(select(0u, 1u, sel), lid);
        if (sel) {
            SEL[written + sc.x] = i32(c);
        }
        written = written + sc.y;
        ties_seen = ties_seen + tc.y;
    }
    for (var i = written + lid; i < top_k; i = i + 256u) {
        SEL[i] = 0;
    }
}
