// sinkhorn_lanes' exchange through workgroup memory (any adapter): every invocation of the
// workgroup runs it (invocation lid as lane lid % 32), the first 32 write. Two buffers of 32 used
// in turn: every read of one comes before the barrier of the next share, so one barrier per share.

var<workgroup> sk_buf: array<f32, 64>;
var<private> sk_half: u32;

fn sk_share(v: f32, lid: u32) {
    sk_half = 32u - sk_half;
    if (lid < 32u) {
        sk_buf[sk_half + lid] = v;
    }
    workgroupBarrier();
}

fn sk_at(i: u32) -> f32 {
    return sk_buf[sk_half + i];
}

// The lane's combine element (lanes lid < n*n <= 32). Call in uniform control flow.
fn sinkhorn_comb(lid: u32, n: u32, iters: u32, eps: f32) -> f32 {
    return sinkhorn_lanes(lid, n, iters, eps);
}
