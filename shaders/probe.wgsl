// The fma probe (backends/wgpu `probe_fma`): V holds n triples (a, b, c), then gets fma(a, b, c)
// for each. Built like every other shader of the adapter, so it shows whether that build's fma()
// rounds once; the inputs come from memory, so the compiler cannot fold them.
@group(0) @binding(2) var<storage, read_write> V: array<f32>;

@compute @workgroup_size(64)
fn fma_probe(@builtin(local_invocation_index) lid: u32) {
    let n = arrayLength(&V) / 4u;
    if (lid < n) {
        V[3u * n + lid] = o(fma(V[3u * lid], V[3u * lid + 1u], V[3u * lid + 2u]));
    }
}
