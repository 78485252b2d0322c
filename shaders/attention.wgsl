// Sink attention for one token in the canonical order: per head, softmax over {sink} U raw
// window rows U visible compressed rows (K == V), the sink in the denominator only. One
// workgroup per head; SCORES is scratch with `max_rows` floats per head.
//   s_r = dot(q, k_r) * kq_scale (the canonical f32 dot, 32 lanes per row)
//   w_r = exp(s_r - max(sink, s...))
//   rows in chunks of DS4_ATTN_ROW_CHUNK: inside a chunk the weights and each output dim add
//   sequentially from +0; denom = exp(sink - m) + chunk sums in order; out = (sum of chunk sums) * (1/denom).

@group(0) @binding(2) var<storage, read_write> Q: array<f32>;
@group(0) @binding(3) var<storage, read_write> RAW: array<f32>;
@group(0) @binding(4) var<storage, read_write> COMP: array<f32>;
@group(0) @binding(5) var<storage, read_write> SELECTED: array<i32>;
@group(0) @binding(6) var<storage, read> SINKS: array<f32>;
@group(0) @binding(7) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(8) var<storage, read_write> SCORES: array<f32>;

var<workgroup> shared_max: array<f32, 256>;
var<workgroup> denom_sh: f32;

// Where row r's values start: raw rows oldest first, then the visible compressed rows ascending.
struct Rows {
    n_raw: u32,
    first: u32,
    raw_cap: u32,
    indexed: bool,
}

fn row_value(rs: Rows, r: u32, hd: u32, i: u32) -> f32 {
    if (r < rs.n_raw) {
        return RAW[((rs.first + r) % rs.raw_cap) * hd + i];
    }
    var c = r - rs.n_raw;
    if (rs.indexed) {
        c = u32(max(SELECTED[c], 0));
    }
    return COMP[c * hd + i];
}

// The partial sums lane `lane` adds for rows rows.x .. rows.w (each clamped to the last row; the
// caller keeps only rows below n_rows) of the f32 chunk that starts at dim c0 (4 consecutive per
// step), each as the canonical dot adds them: every load of the four rows first, then the sums.
fn score_chunk(rs: Rows, h: u32, hd: u32, c0: u32, lane: u32, rows: vec4<u32>, n_rows: u32) -> vec4<f32> {
    let r = min(rows, vec4<u32>(n_rows - 1u));
    var acc = vec4<f32>(zero());
    for (var u = 0u; u < 4u; u = u + 1u) {
        let base = c0 + u * 128u + lane * 4u;
        for (var v = 0u; v < 4u; v = v + 1u) {
            let i = base + v;
            if (i < hd) {
                let q = Q[h * hd + i];
                let k0 = row_value(rs, r.x, hd, i);
                let k1 = row_value(rs, r.y, hd, i);
                let k2 = row_value(rs, r.z, hd, i);
                let k3 = row_value(rs, r.w, hd, i);
                acc.x = fadd(acc.x, fmul(q, k0));
                acc.y = fadd(acc.y, fmul(q, k1));
                acc.z = fadd(acc.z, fmul(q, k2));
                acc.w = fadd(acc.w, fmul(q, k3));
            }
        }
    }
    return acc;
}

// args: head_dim, window, raw_cap, ratio (0: no compressed rows), comp_cap, top_k, max_rows,
// kq_scale, has_selected.
@compute @workgroup_size(256)
fn attention(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let h = wid.x;
    let hd = arg(0u);
    let raw_cap = arg(2u);
    let ratio = arg(3u);
    let top_k = arg(5u);
    let max_rows = arg(6u);
    let kq_scale = argf(7u);
    let n_raw = min(min(P.pos + 1u, arg(1u)), raw_cap);
    var n_comp = 0u;
    if (ratio != 0u) {
        n_comp = min((P.pos + 1u) / ratio, arg(4u));
    }
    let indexed = arg(8u) != 0u && n_comp > top_k;
    let n_rows = n_raw + select(n_comp, top_k, indexed);
    let rs = Rows(n_raw, P.pos + 1u - n_raw, raw_cap, indexed);
    let sc = h * max_rows;
    let lane = lid % 32u;

    // 32 rows per round, 4 per 32-lane group (rows g, g + 8, g + 16, g + 24 of the round): the
    // four rows' loads are in flight together, then the four butterflies.
    for (var rb = 0u; rb < n_rows; rb = rb + 32u) {
        let r0 = rb + lid / 32u;
        var total = vec4<f32>(zero());
        for (var c0 = 0u; c0 < hd; c0 = c0 + 512u) {
            let acc = score_chunk(rs, h, hd, c0, lane, vec4<u32>(r0, r0 + 8u, r0 + 16u, r0 + 24u), n_rows);
            total.x = fadd(total.x, lane_sum(acc.x, lid));
            if (rb + 8u < n_rows) {
                total.y = fadd(total.y, lane_sum(acc.y, lid));
            }
            if (rb + 16u < n_rows) {
                total.z = fadd(total.z, lane_sum(acc.z, lid));
            }
            if (rb + 24u < n_rows) {
                total.w = fadd(total.w, lane_sum(acc.w, lid));
            }
        }
        for (var k = 0u; k < 4u; k = k + 1u) {
            if (lane == 0u && r0 + 8u * k < n_rows) {
                SCORES[sc + r0 + 8u * k] = fmul(total[k], kq_scale);
            }
        }
    }
    storageBarrier();
    let sink = SINKS[h];
    var m = sink;
    for (var r = lid; r < n_rows; r = r + 256u) {
        m = max(m, SCORES[sc + r]);
    }
    // The largest score by a tree (max is exact in any order).
    shared_max[lid] = m;
    workgroupBarrier();
    for (var off = 128u; off > 0u; off = off / 2u) {
        if (lid < off) {
            shared_max[lid] = max(shared_max[lid], shared_max[lid + off]);
        }
        workgroupBarrier();
    }
    m = shared_max[0];
    storageBarrier();
    for (var r = lid; r < n_rows; r = r + 256u) {
        SCORES[sc + r] = ds4_exp(fsub(SCORES[sc + r], m));
    }
    storageBarrier();
    if (lid == 0u) {
        var denom = ds4_exp(fsub(sink, m));
        for (var c = 0u; c < n_rows; c = c + DS4_ATTN_ROW_CHUNK) {
            var part = zero();
            for (var r = c; r < min(c + DS4_ATTN_ROW_CHUNK, n_rows); r = r + 1u) {
                part = fadd(part, SCORES[sc + r]);
            }
            denom = fadd(denom, part);
        }
        denom_sh = denom;
    }
    workgroupBarrier();
    let inv = fdiv(1.0, denom_sh);
    for (var i = lid; i < hd; i = i + 256u) {
        var acc = zero();
        for (var c = 0u; c < n_rows; c = c + DS4_ATTN_ROW_CHUNK) {
            var part = zero();
            for (var r = c; r < min(c + DS4_ATTN_ROW_CHUNK, n_rows); r = r + 1u) {
                part = fadd(part, fmul(SCORES[sc + r], row_value(rs, r, hd, i)));
            }
            acc = fadd(acc, part);
        }
        OUT[h * hd + i] = fmul(acc, inv);
    }
}
