// sinkhorn_lanes' exchange through subgroup shuffles (subgroups of exactly 32, lid % 32 the
// lane): the first 32 invocations run it alone, with no barrier. backends/wgpu appends this file
// or sinkhorn_shared.wgsl after sinkhorn.wgsl.

var<private> sk_v: f32;

fn sk_share(v: f32, lid: u32) {
    sk_v = v;
}

fn sk_at(i: u32) -> f32 {
    return subgroupShuffle(sk_v, i);
}

// The lane's combine element (lanes lid < n*n <= 32; others return 0). Any control flow.
fn sinkhorn_comb(lid: u32, n: u32, iters: u32, eps: f32) -> f32 {
    var c = 0.0;
    if (lid < 32u) {
        c = sinkhorn_lanes(lid, n, iters, eps);
    }
    return c;
}
