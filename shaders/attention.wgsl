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

    for (var rb = 0u; rb < n_rows; rb = rb + 8u) {
        let r = min(rb + lid / 32u, n_rows - 1u);
        var total = zero();
        for (var c0 = 0u; c0 < hd; c0 = c0 + 512u) {
            var acc = zero();
            for (var u = 0u; u < 4u; u = u + 1u) {
                let base = c0 + u * 128u + lane * 4u;
                for (var v = 0u; v < 4u; v = v + 1u) {
                    let i = base + v;
                    if (i < hd) {
                        acc = fadd(acc, fmul(Q[h * hd + i], row_value(rs, r, hd, i)));
                    }
                }
            }
            total = fadd(total, lane_sum(acc, lid));
        }
        if (lane == 0u && rb + lid / 32u < n_rows) {
            SCORES[sc + r] = fmul(total, kq_scale);
        }
    }
    storageBarrier();
    let sink = SINKS[h];
    var m = sink;
    for (var r = lid; r < n_rows; r = r + 256u) {
        m = max(m, SCORES[sc + r]);
    }
    shared_max[lid] = m;
    workgroupBarrier();
    m = sink;
    for (var t = 0u; t < 256u; t = t + 1u) {
        m = max(m, shared_max[t]);
    }
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
