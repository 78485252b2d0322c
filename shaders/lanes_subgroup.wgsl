// lane_sum and lane_max with subgroup shuffles, for adapters whose subgroups are exactly 32
// invocations (NVIDIA): the 32 lanes of a row are one subgroup, and the butterfly is CUDA's
// warp_sum. backends/wgpu prepends either this file or lanes_shared.wgsl to each shader file.

// The canonical butterfly (numerics::tree32): for o = 16, 8, 4, 2, 1 lane l becomes
// v[l] + v[l ^ o]. Every lane gets the sum.
fn lane_sum(v: f32, lid: u32) -> f32 {
    return lane_sum_w(v, lid, 32u);
}

// lane_sum over groups of `width` lanes (a power of two, at most 32; uniform): the butterfly's
// steps o = width/2, ..., 1. Where only the first `width` lanes of a canonical 32-lane group hold
// terms and the rest hold +0 (never -0: a lane's sum starts from +0), the skipped steps add +0 to
// every live lane and leave its bits: the same sum as lane_sum, for 32 / width rows at once.
fn lane_sum_w(v: f32, lid: u32, width: u32) -> f32 {
    var s = v;
    for (var off = width / 2u; off > 0u; off = off / 2u) {
        s = fadd(s, subgroupShuffleXor(s, off));
    }
    return s;
}

fn lane_max(v: f32, lid: u32) -> f32 {
    var s = v;
    for (var off = 16u; off > 0u; off = off / 2u) {
        s = max(s, subgroupShuffleXor(s, off));
    }
    return s;
}
