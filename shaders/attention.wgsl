// Sink attention for one token in the canonical order: per head, softmax over {sink} U raw
// window rows U visible compressed rows (K == V), the sink in the denominator only. One
// workgroup of 256 per head.
//   s_r = dot(q, k_r) * kq_scale (the canonical f32 dot, 32 lanes per row)
//   w_r = exp(s_r - max(sink, s...))
//   rows in chunks of DS4_ATTN_ROW_CHUNK: inside a chunk the weights and each output dim add
//   sequentially from +0; denom = exp(sink - m) + chunk sums in order; out = (sum of chunk sums) * (1/denom).
// Parallel shape (kernels/attention.cu's): the first ATT_WCAP weights in workgroup memory (the
// rest in SCORES, scratch with `max_rows` floats per head); an invocation per chunk sums its
// weights, one adds the chunk sums in order; an invocation per (chunk, 4 dims) sums the chunk's
// rows for its dims (8 rows' loads in flight), batches of min(1024 / head_dim, 8) chunks at a time
// through workgroup memory, and the invocation that owns a dim adds them in chunk order. head_dim is a multiple of 4 and at most
// 1024 (plan.rs checks it).

@group(0) @binding(2) var<storage, read> Q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> RAW: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> COMP: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> SELECTED: array<i32>;
@group(0) @binding(6) var<storage, read> SINKS: array<f32>;
@group(0) @binding(7) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(8) var<storage, read_write> SCORES: array<f32>;
// Fused (plan.rs, attention_tail): the RoPE table, and the Q8_0 quantization of the output
// (quantize_q8_0's layout: n / 4 words of quants, then the scales).
@group(0) @binding(9) var<storage, read> TABLE: array<f32>;
@group(0) @binding(10) var<storage, read_write> XQ: array<u32>;

// 14 KiB of workgroup memory with lanes_shared.wgsl's 1 KiB (16 KiB is the portable limit).
const ATT_WCAP: u32 = 1536u;
// The scores, then the weights, of rows below ATT_WCAP.
var<workgroup> att_w: array<f32, 1536>;
// A batch of chunks' output sums, [chunk of the batch][dim].
var<workgroup> att_part: array<f32, 1024>;
// The max tree, chunk sums of the weights, the denominator.
var<workgroup> att_red: array<f32, 256>;
// The row offsets of a batch of chunks (at most 8).
var<workgroup> att_off: array<u32, 512>;

// Where row r's values start, in vec4 units: raw rows oldest first, then the visible compressed
// rows ascending; the top bit says COMP.
struct Rows {
    n_raw: u32,
    first: u32,
    raw_cap: u32,
    indexed: bool,
    hd4: u32,
}

fn row_off(rs: Rows, r: u32) -> u32 {
    if (r < rs.n_raw) {
        return ((rs.first + r) % rs.raw_cap) * rs.hd4;
    }
    var c = r - rs.n_raw;
    if (rs.indexed) {
        c = u32(max(SELECTED[c], 0));
    }
    return 0x80000000u | (c * rs.hd4);
}

fn kv4(off: u32, g: u32) -> vec4<f32> {
    if ((off & 0x80000000u) != 0u) {
        return COMP[(off & 0x7fffffffu) + g];
    }
    return RAW[off + g];
}

// Row r's score or weight: workgroup memory, or SCORES past ATT_WCAP rows.
fn w_get(sc: u32, r: u32) -> f32 {
    if (r < ATT_WCAP) {
        return att_w[r];
    }
    return SCORES[sc + r];
}

fn w_set(sc: u32, r: u32, v: f32) {
    if (r < ATT_WCAP) {
        att_w[r] = v;
    } else {
        SCORES[sc + r] = v;
    }
}

// acc + q.x * k.x + q.y * k.y + ..., in that order.
fn dot4_acc(acc: f32, q: vec4<f32>, k: vec4<f32>) -> f32 {
    var a = fadd(acc, fmul(q.x, k.x));
    a = fadd(a, fmul(q.y, k.y));
    a = fadd(a, fmul(q.z, k.z));
    return fadd(a, fmul(q.w, k.w));
}

fn o4(v: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(v) ^ vec4<u32>(Z));
}

// p + w * v, per component.
fn axpy4(p: vec4<f32>, w: f32, v: vec4<f32>) -> vec4<f32> {
    return o4(p + o4(vec4<f32>(w) * v));
}

// This lane's 4 values of q from dim i (0 past head_dim).
fn q_part(q0: u32, i: u32, hd: u32) -> vec4<f32> {
    if (i < hd) {
        return Q[q0 + i / 4u];
    }
    return vec4<f32>(zero());
}

// One part (dims i .. i + 3) of four rows' k, loaded unconditionally (dims clamped inside the
// head; quad_dot drops what lies past head_dim).
struct Quad {
    k0: vec4<f32>,
    k1: vec4<f32>,
    k2: vec4<f32>,
    k3: vec4<f32>,
}

fn load_quad(off: vec4<u32>, i: u32, hd: u32) -> Quad {
    let g = min(i, hd - 4u) / 4u;
    return Quad(kv4(off.x, g), kv4(off.y, g), kv4(off.z, g), kv4(off.w, g));
}

// The four rows' dot sums acc plus their 4 terms from dim i on (none past head_dim).
fn quad_dot(acc: vec4<f32>, q: vec4<f32>, k: Quad, i: u32, hd: u32) -> vec4<f32> {
    if (i >= hd) {
        return acc;
    }
    return vec4<f32>(dot4_acc(acc.x, q, k.k0), dot4_acc(acc.y, q, k.k1), dot4_acc(acc.z, q, k.k2), dot4_acc(acc.w, q, k.k3));
}

// A round of the scores' loads: this lane's 4 parts of its group's 4 rows.
struct Round {
    a: Quad,
    b: Quad,
    c: Quad,
    d: Quad,
}

fn round_offs(rs: Rows, rb: u32, lid: u32, n_rows: u32) -> vec4<u32> {
    let r0 = rb + lid / 32u;
    let last = n_rows - 1u;
    return vec4<u32>(row_off(rs, min(r0, last)), row_off(rs, min(r0 + 8u, last)), row_off(rs, min(r0 + 16u, last)),
                     row_off(rs, min(r0 + 24u, last)));
}

fn load_round(rs: Rows, rb: u32, lid: u32, n_rows: u32, i0: u32, hd: u32) -> Round {
    let off = round_offs(rs, rb, lid, n_rows);
    return Round(load_quad(off, i0, hd), load_quad(off, i0 + 128u, hd), load_quad(off, i0 + 256u, hd),
                 load_quad(off, i0 + 384u, hd));
}

// p plus rows r0 + j .. r0 + j + 7 (those below nr) of a chunk, weighted, for dims 4g .. 4g + 3:
// the eight loads first, then the sums in row order.
fn rows8(p0: vec4<f32>, sc: u32, r0: u32, j: u32, nr: u32, ob: u32, g: u32) -> vec4<f32> {
    let last = nr - 1u;
    let v0 = kv4(att_off[ob + j], g);
    let v1 = kv4(att_off[ob + min(j + 1u, last)], g);
    let v2 = kv4(att_off[ob + min(j + 2u, last)], g);
    let v3 = kv4(att_off[ob + min(j + 3u, last)], g);
    let v4 = kv4(att_off[ob + min(j + 4u, last)], g);
    let v5 = kv4(att_off[ob + min(j + 5u, last)], g);
    let v6 = kv4(att_off[ob + min(j + 6u, last)], g);
    let v7 = kv4(att_off[ob + min(j + 7u, last)], g);
    var p = axpy4(p0, w_get(sc, r0 + j), v0);
    if (j + 1u < nr) {
        p = axpy4(p, w_get(sc, r0 + j + 1u), v1);
    }
    if (j + 2u < nr) {
        p = axpy4(p, w_get(sc, r0 + j + 2u), v2);
    }
    if (j + 3u < nr) {
        p = axpy4(p, w_get(sc, r0 + j + 3u), v3);
    }
    if (j + 4u < nr) {
        p = axpy4(p, w_get(sc, r0 + j + 4u), v4);
    }
    if (j + 5u < nr) {
        p = axpy4(p, w_get(sc, r0 + j + 5u), v5);
    }
    if (j + 6u < nr) {
        p = axpy4(p, w_get(sc, r0 + j + 6u), v6);
    }
    if (j + 7u < nr) {
        p = axpy4(p, w_get(sc, r0 + j + 7u), v7);
    }
    return p;
}

// acc plus dim d's sums of a batch's nb chunks, in chunk order (d past head_dim: unchanged).
fn add_batch(acc: f32, d: u32, hd: u32, nb: u32) -> f32 {
    var a = acc;
    if (d < hd) {
        for (var t = 0u; t < nb; t = t + 1u) {
            a = fadd(a, att_part[t * hd + d]);
        }
    }
    return a;
}

// args: head_dim, window, raw_cap, ratio (0: no compressed rows), comp_cap, top_k, max_rows,
// kq_scale, has_selected; then tail (0 or 1), n_rot, n: with tail, the head's output is rotated
// back on its last n_rot dims at the current position and quantized to Q8_0 into XQ, every value
// as rope_tail_q8 computes it (the n = n_head * head_dim outputs are its input).
@compute @workgroup_size(256)
fn attention(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let h = wid.x;
    let hd = arg(0u);
    let hd4 = hd / 4u;
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
    let rs = Rows(n_raw, P.pos + 1u - n_raw, raw_cap, indexed, hd4);
    let sc = h * max_rows;
    let lane = lid % 32u;
    let q0 = h * hd4;

    // Scores: per 512-dim chunk of the dot, q's 16 values of this lane in registers; 32 rows per
    // round, 4 per group of 32 lanes (rows g, g + 8, g + 16, g + 24): every load of the four rows
    // first, then the sums. A row's chunk sums add in order (lane 0 of the same group each time).
    for (var c0 = 0u; c0 < hd; c0 = c0 + 512u) {
        let i0 = c0 + lane * 4u;
        let qa = q_part(q0, i0, hd);
        let qb = q_part(q0, i0 + 128u, hd);
        let qc = q_part(q0, i0 + 256u, hd);
        let qd = q_part(q0, i0 + 384u, hd);
        var cur = load_round(rs, 0u, lid, n_rows, i0, hd);
        for (var rb = 0u; rb < n_rows; rb = rb + 32u) {
            let r0 = rb + lid / 32u;
            // The next round's loads (rows past the last: the last again, unused) before this
            // round's sums, so that a round's L2 latency hides behind the one before.
            let nxt = load_round(rs, rb + 32u, lid, n_rows, i0, hd);
            var acc = vec4<f32>(zero());
            acc = quad_dot(acc, qa, cur.a, i0, hd);
            acc = quad_dot(acc, qb, cur.b, i0 + 128u, hd);
            acc = quad_dot(acc, qc, cur.c, i0 + 256u, hd);
            acc = quad_dot(acc, qd, cur.d, i0 + 384u, hd);
            cur = nxt;
            var total = vec4<f32>(lane_sum(acc.x, lid), zero(), zero(), zero());
            if (rb + 8u < n_rows) {
                total.y = lane_sum(acc.y, lid);
            }
            if (rb + 16u < n_rows) {
                total.z = lane_sum(acc.z, lid);
            }
            if (rb + 24u < n_rows) {
                total.w = lane_sum(acc.w, lid);
            }
            for (var k = 0u; k < 4u; k = k + 1u) {
                let r = r0 + 8u * k;
                if (lane == 0u && r < n_rows) {
                    var prev = zero();
                    if (c0 > 0u) {
                        prev = w_get(sc, r);
                    }
                    w_set(sc, r, fadd(prev, total[k]));
                }
            }
        }
    }
    workgroupBarrier();
    storageBarrier();
    // The scores, and the largest of them and the sink by a tree (max is exact in any order).
    let sink = SINKS[h];
    var m = sink;
    for (var r = lid; r < n_rows; r = r + 256u) {
        let s = fmul(w_get(sc, r), kq_scale);
        w_set(sc, r, s);
        m = max(m, s);
    }
    att_red[lid] = m;
    workgroupBarrier();
    for (var off = 128u; off > 0u; off = off / 2u) {
        if (lid < off) {
            att_red[lid] = max(att_red[lid], att_red[lid + off]);
        }
        workgroupBarrier();
    }
    m = att_red[0];
    workgroupBarrier();
    for (var r = lid; r < n_rows; r = r + 256u) {
        w_set(sc, r, ds4_exp(fsub(w_get(sc, r), m)));
    }
    workgroupBarrier();
    storageBarrier();
    // The denominator: an invocation per chunk sums its weights, then lid 0 adds the sums in order.
    let n_chunks = (n_rows + DS4_ATTN_ROW_CHUNK - 1u) / DS4_ATTN_ROW_CHUNK;
    var denom = ds4_exp(fsub(sink, m));
    for (var cb = 0u; cb < n_chunks; cb = cb + 256u) {
        let c = cb + lid;
        if (c < n_chunks) {
            var t = zero();
            for (var r = c * DS4_ATTN_ROW_CHUNK; r < min(c * DS4_ATTN_ROW_CHUNK + DS4_ATTN_ROW_CHUNK, n_rows); r = r + 1u) {
                t = fadd(t, w_get(sc, r));
            }
            att_red[lid] = t;
        }
        workgroupBarrier();
        if (lid == 0u) {
            for (var j = 0u; j < min(256u, n_chunks - cb); j = j + 1u) {
                denom = fadd(denom, att_red[j]);
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        att_red[0] = denom;
    }
    let inv = fdiv(1.0, workgroupUniformLoad(&att_red[0]));
    // The output: batches of `slots` chunks; invocation (slot, g) sums its chunk's rows for dims
    // 4g .. 4g + 3 (eight rows' loads, then their sums), the owner of dim d adds the batch's sums
    // in chunk order.
    let slots = min(1024u / hd, 8u);
    let s = lid / hd4;
    let g = lid % hd4;
    var acc = vec4<f32>(zero());
    for (var cb = 0u; cb < n_chunks; cb = cb + slots) {
        for (var t = lid; t < slots * DS4_ATTN_ROW_CHUNK; t = t + 256u) {
            let r = (cb + t / DS4_ATTN_ROW_CHUNK) * DS4_ATTN_ROW_CHUNK + t % DS4_ATTN_ROW_CHUNK;
            if (r < n_rows) {
                att_off[t] = row_off(rs, r);
            }
        }
        workgroupBarrier();
        let c = cb + s;
        if (s < slots && c < n_chunks) {
            let r0 = c * DS4_ATTN_ROW_CHUNK;
            let nr = min(DS4_ATTN_ROW_CHUNK, n_rows - r0);
            let ob = s * DS4_ATTN_ROW_CHUNK;
            var p = vec4<f32>(zero());
            for (var j = 0u; j < nr; j = j + 8u) {
                p = rows8(p, sc, r0, j, nr, ob, g);
            }
            let at = s * hd + 4u * g;
            att_part[at] = p.x;
            att_part[at + 1u] = p.y;
            att_part[at + 2u] = p.z;
            att_part[at + 3u] = p.w;
        }
        workgroupBarrier();
        let nb = min(slots, n_chunks - cb);
        acc.x = add_batch(acc.x, lid, hd, nb);
        acc.y = add_batch(acc.y, lid + 256u, hd, nb);
        acc.z = add_batch(acc.z, lid + 512u, hd, nb);
        acc.w = add_batch(acc.w, lid + 768u, hd, nb);
        workgroupBarrier();
    }
    let o0 = h * hd;
    if (arg(9u) == 0u) {
        if (lid < hd) {
            OUT[o0 + lid] = fmul(acc.x, inv);
        }
        if (lid + 256u < hd) {
            OUT[o0 + lid + 256u] = fmul(acc.y, inv);
        }
        if (lid + 512u < hd) {
            OUT[o0 + lid + 512u] = fmul(acc.z, inv);
        }
        if (lid + 768u < hd) {
            OUT[o0 + lid + 768u] = fmul(acc.w, inv);
        }
        return;
    }
    // The tail: the head's outputs in workgroup memory, the RoPE's pairs read from there.
    for (var k = 0u; k < 4u; k = k + 1u) {
        let d = lid + 256u * k;
        if (d < hd) {
            att_part[d] = fmul(acc[k], inv);
        }
    }
    workgroupBarrier();
    let n_rot = arg(10u);
    let n = arg(11u);
    let tail = hd - n_rot;
    let pairs = n_rot / 2u;
    for (var k = 0u; k < 4u; k = k + 1u) {
        let d = lid + 256u * k;
        if (256u * k >= hd) {
            break;
        }
        var v = 0.0;
        if (d < hd) {
            v = att_part[d];
            if (d >= tail) {
                let t = (P.pos * pairs + (d - tail) / 2u) * 2u;
                let c = TABLE[t];
                let s = -TABLE[t + 1u];
                let first = d - (d - tail) % 2u;
                let x0 = att_part[first];
                let x1 = att_part[first + 1u];
                if ((d - tail) % 2u == 0u) {
                    v = fsub(fmul(x0, c), fmul(x1, s));
                } else {
                    v = fadd(fmul(x0, s), fmul(x1, c));
                }
            }
            OUT[o0 + d] = v;
        }
        let q = q8_block(v, lid);
        let i = o0 + d;
        if (d < hd && lid % 4u == 0u) {
            XQ[i / 4u] = q.x;
        }
        if (d < hd && lid % 32u == 0u) {
            XQ[n / 4u + i / 32u] = q.y;
        }
    }
}
