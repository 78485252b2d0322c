// lane_sum and lane_max through workgroup memory (any adapter). backends/wgpu prepends either
// this file or lanes_subgroup.wgsl to each shader file.

// The canonical butterfly over the 32 lanes of each group of 32 invocations (numerics::tree32):
// for o = 16, 8, 4, 2, 1 lane l becomes v[l] + v[l ^ o]. Every lane gets the sum. Workgroups are
// 256 invocations; call in uniform control flow.
var<workgroup> red: array<f32, 256>;

fn lane_sum(v: f32, lid: u32) -> f32 {
    return lane_sum_w(v, lid, 32u);
}

// lane_sum over groups of `width` lanes (a power of two, at most 32; uniform): the butterfly's
// steps o = width/2, ..., 1 (lanes_subgroup.wgsl says why that is lane_sum's result).
fn lane_sum_w(v: f32, lid: u32, width: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var off = width / 2u; off > 0u; off = off / 2u) {
        let t = fadd(red[lid], red[lid ^ off]);
        workgroupBarrier();
        red[lid] = t;
        workgroupBarrier();
    }
    let s = red[lid];
    workgroupBarrier();
    return s;
}

fn lane_max(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var off = 16u; off > 0u; off = off / 2u) {
        let t = max(red[lid], red[lid ^ off]);
        workgroupBarrier();
        red[lid] = t;
        workgroupBarrier();
    }
    let s = red[lid];
    workgroupBarrier();
    return s;
}

