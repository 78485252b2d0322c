// RopeTail: rotate the last n_rot dims of each head by a host-computed table of (cos, sin) per
// position and pair, the very values the CPU reference rotates by (backends/gpu_tables.rs).

@group(0) @binding(2) var<storage, read_write> X: array<f32>;
@group(0) @binding(3) var<storage, read> TABLE: array<f32>;

// args: n_head, head_dim, n_rot, pos_mode (0: pos, 1: pos + 1 - ratio), ratio, inverse.
@compute @workgroup_size(128)
fn rope_tail(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (!guard()) {
        return;
    }
    let n_head = arg(0u);
    let head_dim = arg(1u);
    let n_rot = arg(2u);
    let pairs = n_rot / 2u;
    let t = wid.x * 128u + lid;
    if (t >= n_head * pairs) {
        return;
    }
    let h = t / pairs;
    let k = t % pairs;
    var pos = P.pos;
    if (arg(3u) == 1u) {
        pos = select(0u, P.pos + 1u - arg(4u), P.pos + 1u >= arg(4u));
    }
    let c = TABLE[(pos * pairs + k) * 2u];
    var s = TABLE[(pos * pairs + k) * 2u + 1u];
    if (arg(5u) != 0u) {
        s = -s;
    }
    let i = h * head_dim + (head_dim - n_rot) + 2u * k;
    let x0 = X[i];
    let x1 = X[i + 1u];
    X[i] = fsub(fmul(x0, c), fmul(x1, s));
    X[i + 1u] = fadd(fmul(x0, s), fmul(x1, c));
}
