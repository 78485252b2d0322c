//! The wgpu backend: the recorded program as WGSL compute dispatches (`shaders/`), bit-identical
//! to the canonical CPU profile. Pipelines, bind groups and buffers are made once at compile();
//! each token is one `write_buffer` of the step parameters, one command buffer and one submit.
//! The command buffer is the same for every token, so the next one is encoded while the GPU
//! runs the current one; a step's submit waits for the call after it, so that a device sample
//! (shaders/sample.wgsl: only the 4-byte id comes back) goes in the same submit.
//! The adapter is the one named by `DS4_WGPU_ADAPTER` (a case-insensitive part of its name), else
//! the first discrete GPU, integrated GPU, other adapter, in that order.

use crate::backend::{Backend, BackendError, BackendOptions};

#[cfg(feature = "wgpu")]
pub mod plan;

/// The environment variable that picks an adapter by (part of) its name; `--adapter` sets it.
pub const ADAPTER_ENV: &str = "DS4_WGPU_ADAPTER";

#[cfg(feature = "wgpu")]
pub fn create(opts: BackendOptions) -> Result<Box<dyn Backend>, BackendError> {
    if opts.numerics != crate::numerics::Numerics::Canonical {
        return Err(BackendError::new("wgpu", "the wgpu backend implements only --numerics canonical"));
    }
    let name = std::env::var(ADAPTER_ENV).ok().filter(|s| !s.is_empty());
    // DS4_WGPU_SUBGROUPS=off keeps the butterfly in workgroup memory on any adapter.
    let subgroups = std::env::var("DS4_WGPU_SUBGROUPS").ok().map(|v| v != "off" && v != "0");
    let tuning = Tuning { subgroups, ..Tuning::default() };
    Ok(Box::new(imp::WgpuBackend::new(name.as_deref(), tuning)?))
}

#[cfg(not(feature = "wgpu"))]
pub fn create(_opts: BackendOptions) -> Result<Box<dyn Backend>, BackendError> {
    Err(BackendError::new("wgpu", "ds4 was built without the `wgpu` feature"))
}

/// How the shaders keep every f32 operation the correctly rounded one the CPU computes, on a
/// driver that would fuse a product into a sum or reassociate (shared/reference/wgsl-exactness.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exactness {
    /// WGSL through wgpu's compiler, every float result through the opaque identity (`o` in
    /// common.wgsl): any adapter.
    OpaqueIdentity,
    /// The same WGSL with `o` the plain identity, compiled to SPIR-V by naga, every float
    /// operation decorated `NoContraction` ([`no_contraction`]), passed through to a Vulkan 1.3
    /// driver. Same bits, fewer instructions: the identity is an extra integer operation per
    /// float result (flash-4l on the H200: 2.03 ms of device time a token with it, 1.88 with
    /// NoContraction instead).
    NoContraction,
}

/// The opaque identity's body in common.wgsl, which [`Exactness::NoContraction`] replaces.
pub const OPAQUE_BODY: &str = "return bitcast<f32>(bitcast<u32>(x) ^ Z);";

/// common.wgsl's residual by Dekker's product, which [`ShaderBuild::fused_fma`] replaces.
pub const RESIDUAL_DEKKER: &str = "return residual_dekker(a, x, y);";
/// The same residual by one fma().
pub const RESIDUAL_FMA: &str = "return residual_fma(a, x, y);";

/// One build of the shaders for an adapter: what [`shader_source`] puts together. Every build
/// computes the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShaderBuild {
    /// The 32-lane exchanges by subgroup shuffles, else through workgroup memory.
    pub subgroups: bool,
    pub exactness: Exactness,
    /// The correctly rounded division's and square root's residuals by fma() (`residual_fma` in
    /// common.wgsl), on adapters whose fma rounds once ([`fma_rounds_once`]); else by Dekker's
    /// product. WGSL (and Vulkan) allow an fma to round twice, so this is probed, not assumed.
    pub fused_fma: bool,
}

/// The fma probe's inputs (a, b, c): products of two values of 24 random bits at exponents from
/// -20 to 20 and c the product rounded and negated (the residuals' case: a fused fma gives the
/// product's rounding error, a split one 0); then a few with c random.
#[cfg(feature = "wgpu")]
pub fn fma_probe_inputs() -> Vec<[f32; 3]> {
    let mut next = xorshift64(0x853c_49e6_748f_ea9b);
    let mut value = || {
        let seed = next();
        let e = (seed % 41) as u32 + 107;
        let sign = ((seed >> 8) & 1) as u32;
        f32::from_bits(sign << 31 | e << 23 | (seed >> 32) as u32 & 0x7f_ffff)
    };
    let mut out = Vec::with_capacity(64);
    for i in 0..64 {
        let (a, b) = (value(), value());
        let c = if i < 48 { -(a * b) } else { value() };
        out.push([a, b, c]);
    }
    out
}

/// Marsaglia's xorshift (13, 7, 17) from `seed`: the probe's inputs and the shader tests' cases.
#[cfg(feature = "wgpu")]
fn xorshift64(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// Whether `outputs` are fma(a, b, c) rounded once for each of `inputs` (Rust's `mul_add` is
/// IEEE's fused multiply-add).
#[cfg(feature = "wgpu")]
pub fn fma_rounds_once(inputs: &[[f32; 3]], outputs: &[f32]) -> bool {
    inputs.len() == outputs.len()
        && inputs.iter().zip(outputs).all(|([a, b, c], o)| a.mul_add(*b, *c).to_bits() == o.to_bits())
}

/// The WGSL source of one shader file as compiled: the numerics constants, `common.wgsl`, the
/// lane reductions (subgroup shuffles or workgroup memory), `row_scale.wgsl` for the files that
/// normalize rows, `sinkhorn.wgsl` for the files that run the HC split, then the file.
#[cfg(feature = "wgpu")]
pub fn shader_source(file: &str, build: ShaderBuild) -> Option<String> {
    let ShaderBuild { subgroups, exactness, fused_fma } = build;
    let body = match file {
        "matvec" => include_str!("../../shaders/matvec.wgsl"),
        "norm" => include_str!("../../shaders/norm.wgsl"),
        "elementwise" => include_str!("../../shaders/elementwise.wgsl"),
        "rope" => include_str!("../../shaders/rope.wgsl"),
        "hc" => include_str!("../../shaders/hc.wgsl"),
        "kv" => include_str!("../../shaders/kv.wgsl"),
        "indexer" => include_str!("../../shaders/indexer.wgsl"),
        "attention" => include_str!("../../shaders/attention.wgsl"),
        "moe" => include_str!("../../shaders/moe.wgsl"),
        "sample" => {
            concat!(include_str!("../../shaders/softfloat.wgsl"), "\n", include_str!("../../shaders/sample.wgsl"))
        }
        "probe" => include_str!("../../shaders/probe.wgsl"),
        _ => return None,
    };
    let lanes = match subgroups {
        true => include_str!("../../shaders/lanes_subgroup.wgsl"),
        false => include_str!("../../shaders/lanes_shared.wgsl"),
    };
    // The RMS norm's row scale, for the norms and the matvec that normalizes its own input.
    let row_scale = match file {
        "norm" | "matvec" => include_str!("../../shaders/row_scale.wgsl"),
        _ => "",
    };
    // The HC split's Sinkhorn, for the HC ops and the norm that fuses them (hc_pre_norm).
    // With the exchange of `sinkhorn_lanes`: subgroup shuffles or workgroup memory, as the lanes.
    let sinkhorn = match (file, subgroups) {
        ("hc" | "norm", true) => {
            concat!(
                include_str!("../../shaders/sinkhorn.wgsl"),
                "\n",
                include_str!("../../shaders/sinkhorn_subgroup.wgsl")
            )
        }
        ("hc" | "norm", false) => {
            concat!(
                include_str!("../../shaders/sinkhorn.wgsl"),
                "\n",
                include_str!("../../shaders/sinkhorn_shared.wgsl")
            )
        }
        _ => "",
    };
    let mut common = match exactness {
        Exactness::OpaqueIdentity => include_str!("../../shaders/common.wgsl").to_string(),
        Exactness::NoContraction => include_str!("../../shaders/common.wgsl").replace(OPAQUE_BODY, "return x;"),
    };
    if fused_fma {
        common = common.replace(RESIDUAL_DEKKER, RESIDUAL_FMA);
    }
    let layout = if file == "sample" { sample_constants() } else { String::new() };
    Some(format!("{}{layout}{common}\n{lanes}\n{row_scale}\n{sinkhorn}\n{body}", wgsl_constants()))
}

/// Logits per workgroup of the device sampler's sliced dispatches (shaders/sample.wgsl).
pub const SAMPLE_SLICE: u32 = 2048;
/// Where the sampled id lies in the sampler's state buffer, in words.
pub const SAMPLE_ST_OUT: u32 = 6;
/// The words of the sampler's state that a non-greedy draw starts from zero.
pub const SAMPLE_ST_HEADER: u32 = 16;
/// Where the candidates start in the state buffer (after the header), two words each.
pub const SAMPLE_ST_CAND: u32 = SAMPLE_ST_HEADER;
/// Where the argmax partials start, two words per workgroup.
pub const SAMPLE_ST_PART: u32 = SAMPLE_ST_CAND + 2 * crate::sample::CANDIDATE_CAP as u32;

/// The device sampler's layout constants as WGSL, so the shader and the host cannot drift apart.
#[cfg(feature = "wgpu")]
fn sample_constants() -> String {
    format!(
        "const SMP_SLICE: u32 = {SAMPLE_SLICE}u;\nconst SMP_CAP: u32 = {}u;\nconst ST_OUT: u32 = {SAMPLE_ST_OUT}u;\n\
         const ST_CAND: u32 = {SAMPLE_ST_CAND}u;\nconst ST_PART: u32 = {SAMPLE_ST_PART}u;\n",
        crate::sample::CANDIDATE_CAP
    )
}

/// Every shader file.
pub const SHADER_FILES: [&str; 11] =
    ["matvec", "norm", "elementwise", "rope", "hc", "kv", "indexer", "attention", "moe", "sample", "probe"];

/// SPIR-V opcodes of the float arithmetic that [`no_contraction`] decorates: FNegate, FAdd,
/// FSub, FMul, FDiv, FRem, FMod and the vector and matrix products.
const FLOAT_ARITHMETIC: [u32; 14] = [127, 129, 131, 133, 136, 140, 141, 142, 143, 144, 145, 146, 147, 148];

/// SPIR-V opcodes of the module's preamble (capabilities, extensions, imports, memory model,
/// entry points, execution modes, debug names, decorations), which precede every type.
const PREAMBLE: [u32; 24] =
    [2, 3, 4, 5, 6, 7, 8, 10, 11, 14, 15, 16, 17, 71, 72, 73, 74, 75, 317, 330, 331, 332, 5632, 5633];

/// The SPIR-V `NoContraction` decoration: the driver may not fuse the operation with another.
const NO_CONTRACTION: u32 = 42;

/// Decorates the result of every float arithmetic instruction of a SPIR-V module `NoContraction`,
/// so that the driver neither fuses a product into a sum nor reassociates (measured exact on
/// NVIDIA's driver and lavapipe, shared/reference/wgsl-exactness.md). The decorations go at the
/// end of the annotations, before the first type. Returns how many instructions it decorated.
pub fn no_contraction(words: &mut Vec<u32>) -> Result<usize, String> {
    if words.len() < 5 || words[0] != 0x0723_0203 {
        return Err("not a SPIR-V module".into());
    }
    let mut at = 5;
    let mut body = None;
    let mut results = Vec::new();
    while at < words.len() {
        let (count, op) = ((words[at] >> 16) as usize, words[at] & 0xffff);
        if count == 0 || at + count > words.len() {
            return Err(format!("a malformed instruction at word {at}"));
        }
        if body.is_none() && !PREAMBLE.contains(&op) {
            body = Some(at);
        }
        if FLOAT_ARITHMETIC.contains(&op) {
            if count < 4 {
                return Err(format!("a float operation of {count} words at word {at}"));
            }
            results.push(words[at + 2]);
        }
        at += count;
    }
    let body = body.ok_or("a SPIR-V module without types")?;
    let decorations = results.iter().flat_map(|&id| [(3 << 16) | 71, id, NO_CONTRACTION]);
    words.splice(body..body, decorations);
    Ok(results.len())
}

/// The canonical profile's constants as WGSL `f32` literals that parse back to the same bits
/// (Rust's shortest round-trip form), so the shaders and `crate::numerics` cannot drift apart.
pub fn wgsl_constants() -> String {
    let mut s = String::from("// Generated from src/numerics.rs: the canonical profile's constants.\n");
    for (name, v) in crate::numerics::float_constants() {
        s += &format!("const {name}: f32 = {v:?}f;\n");
    }
    s += &format!("const DS4_ATTN_ROW_CHUNK: u32 = {}u;\n", crate::numerics::ATTN_ROW_CHUNK);
    s
}

#[cfg(feature = "wgpu")]
pub use imp::{WgpuBackend, WgpuExecutable};

/// Prompt tokens per prefill chunk by default. A chunk runs each op's decode dispatch once per
/// row (with that row's buffers and parameters) in one submit, so a larger chunk saves only
/// submits and waits, while its scratch and bind groups grow with it.
pub const DEFAULT_PREFILL_CHUNK: usize = 16;

/// Choices the backend makes from the adapter, which tests can force.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tuning {
    /// Lowers the largest storage binding (to test the splitting of large weights).
    pub max_binding: Option<u64>,
    /// One invocation per matrix row (true) or 32 lanes per row (false). Default: per row on
    /// adapters that run on CPU cores (lavapipe), 32 lanes on GPUs. Same bits either way.
    pub rows_per_invocation: Option<bool>,
    /// The 32-lane butterfly with subgroup shuffles. Default: where the adapter has subgroups of
    /// exactly 32 invocations (NVIDIA); elsewhere through workgroup memory. Same bits either way.
    pub subgroups: Option<bool>,
    /// Q2_K expert down rows two to a lane group (`moe_down_q2_k_pairs`) where out_dim is even,
    /// else one (`moe_down`). Default: pairs, unless `DS4_WGPU_MOE_DOWN=single`. Same bits either
    /// way.
    pub moe_down_pairs: Option<bool>,
    /// Shaders as SPIR-V with `NoContraction` ([`Exactness::NoContraction`]) instead of WGSL
    /// with the opaque identity. Default: SPIR-V on Vulkan 1.3 GPUs (not on CPU adapters such as
    /// lavapipe, whose compile takes 30x longer without the identity), unless
    /// `DS4_WGPU_SPIRV=off`. Same bits either way.
    pub spirv: Option<bool>,
    /// The division and square-root residuals by fma() where a probe finds that the adapter's
    /// fma rounds once ([`ShaderBuild::fused_fma`]); `Some(true)` makes a split fma an error,
    /// `Some(false)` keeps Dekker's product. Default: as the probe finds, unless
    /// `DS4_WGPU_FMA=off`. Same bits either way.
    pub fused_fma: Option<bool>,
}

#[cfg(feature = "wgpu")]
mod imp {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use super::plan::{self, Layout, Res, Scratch};
    use crate::backend::{Backend, BackendError, Executable};
    use crate::backends::gpu_tables;
    use crate::model::Model;
    use crate::quant::{self, GgmlType};
    use crate::recorder::{Buf, BufKind, DType, Program, StepParams};
    use crate::sample::DeviceSample;

    fn err(msg: impl Into<String>) -> BackendError {
        BackendError::new("wgpu", msg)
    }

    /// Argument words per dispatch, at the uniform offset alignment (256 bytes on every adapter).
    const ARGS_STRIDE: u64 = 256;

    pub struct WgpuBackend {
        device: wgpu::Device,
        queue: wgpu::Queue,
        info: wgpu::AdapterInfo,
        timestamps: bool,
        max_binding: u64,
        rows: bool,
        shaders: super::ShaderBuild,
        moe_down_pairs: bool,
        errors: Arc<Mutex<Vec<String>>>,
    }

    /// Whether the adapter is a Vulkan 1.3 device: SPIR-V 1.6, with the integer dot product and
    /// subgroup operations in core, as naga writes them for [`super::Exactness::NoContraction`].
    #[cfg(not(target_vendor = "apple"))]
    fn vulkan_1_3(adapter: &wgpu::Adapter) -> bool {
        // SAFETY: only reads the physical device's properties through the guard, which is
        // dropped before this returns; nothing is created or destroyed.
        let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() };
        // (1 << 22) | (3 << 12): VK_MAKE_API_VERSION(0, 1, 3, 0).
        hal.is_some_and(|a| a.physical_device_capabilities().properties().api_version >= (1 << 22) | (3 << 12))
    }

    #[cfg(target_vendor = "apple")]
    fn vulkan_1_3(_adapter: &wgpu::Adapter) -> bool {
        false
    }

    /// The first validation or device error wgpu reported into `errors` since the last check.
    fn first_error(errors: &Mutex<Vec<String>>) -> Result<(), BackendError> {
        let first = errors.lock().map_err(|_| err("the error log is poisoned"))?.drain(..).next();
        match first {
            Some(e) => Err(err(e)),
            None => Ok(()),
        }
    }

    /// The first `bytes` (a multiple of 4) of `staging`, mapped once `wait` (which polls the
    /// device until the copy into it is done) succeeds.
    fn read_mapped(
        staging: &wgpu::Buffer,
        bytes: u64,
        wait: impl FnOnce() -> Result<(), BackendError>,
    ) -> Result<Vec<u8>, BackendError> {
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, ..bytes, move |r| {
            let _ = tx.send(r);
        });
        wait()?;
        rx.recv()
            .map_err(|_| err("the read-back never completed"))?
            .map_err(|e| err(format!("cannot read a buffer back: {e}")))?;
        let out = staging.get_mapped_range(..bytes).map_err(|e| err(format!("cannot map: {e}")))?.to_vec();
        staging.unmap();
        Ok(out)
    }

    /// Runs the fma probe (shaders/probe.wgsl) in the build the shaders will have and says whether
    /// the adapter's fma() rounded once on every input ([`super::fma_rounds_once`]).
    fn probe_fma(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        build: super::ShaderBuild,
        errors: &Mutex<Vec<String>>,
    ) -> Result<bool, BackendError> {
        use wgpu::util::DeviceExt;
        let inputs = super::fma_probe_inputs();
        let n = inputs.len();
        let mut values: Vec<f32> = inputs.iter().flatten().copied().collect();
        values.resize(4 * n, 0.0);
        let shader = ShaderFile::new(device, "probe", build)?;
        let pipeline = shader.pipeline(device, "fma_probe")?;
        let v = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("fma probe"),
            contents: bytemuck::cast_slice(&values),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        });
        let staging = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("fma probe read-back"),
            size: 4 * n as u64,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("fma probe"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[wgpu::BindGroupEntry { binding: 2, resource: v.as_entire_binding() }],
        });
        let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("fma probe") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(1, 1, 1);
        }
        enc.copy_buffer_to_buffer(&v, 12 * n as u64, &staging, 0, 4 * n as u64);
        queue.submit([enc.finish()]);
        let wait = || {
            device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| err(format!("device lost: {e}")))?;
            first_error(errors)
        };
        let bytes = read_mapped(&staging, 4 * n as u64, wait).map_err(|e| err(format!("the fma probe: {}", e.msg)))?;
        let out: Vec<f32> = bytemuck::cast_slice(&bytes).to_vec();
        Ok(super::fma_rounds_once(&inputs, &out))
    }

    impl WgpuBackend {
        /// Opens the adapter whose name contains `want` (case-insensitive), else the best one.
        pub fn new(want: Option<&str>, tuning: super::Tuning) -> Result<Self, BackendError> {
            let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
            let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
            let names: Vec<String> =
                adapters.iter().map(|a| format!("{} ({:?})", a.get_info().name, a.get_info().backend)).collect();
            let rank = |t: wgpu::DeviceType| match t {
                wgpu::DeviceType::DiscreteGpu => 0,
                wgpu::DeviceType::IntegratedGpu => 1,
                wgpu::DeviceType::VirtualGpu => 2,
                wgpu::DeviceType::Cpu => 3,
                wgpu::DeviceType::Other => 4,
            };
            let adapter = match want {
                Some(w) => {
                    let w = w.to_lowercase();
                    adapters.into_iter().find(|a| a.get_info().name.to_lowercase().contains(&w)).ok_or_else(|| {
                        err(format!(
                            "no adapter whose name contains '{w}' (from {}); adapters found: {}",
                            super::ADAPTER_ENV,
                            if names.is_empty() { "none".to_string() } else { names.join(", ") }
                        ))
                    })?
                }
                None => adapters.into_iter().min_by_key(|a| rank(a.get_info().device_type)).ok_or_else(|| {
                    err("no adapter found (looked for Vulkan, Metal, DX12 and GL adapters); without a GPU, \
                         install Mesa's lavapipe (Debian/Ubuntu: mesa-vulkan-drivers libvulkan1)")
                })?,
            };
            let info = adapter.get_info();
            let limits = adapter.limits();
            let timestamps = adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
            let lanes32 = adapter.features().contains(wgpu::Features::SUBGROUP)
                && info.subgroup_min_size == 32
                && info.subgroup_max_size == 32;
            let subgroups = match tuning.subgroups {
                Some(true) if !lanes32 => {
                    return Err(err(format!("{} has no subgroups of exactly 32 invocations", info.name)))
                }
                Some(s) => s,
                None => lanes32,
            };
            let spirv_ok = info.backend == wgpu::Backend::Vulkan
                && adapter.features().contains(wgpu::Features::PASSTHROUGH_SHADERS)
                && vulkan_1_3(&adapter);
            let spirv = match tuning.spirv {
                Some(true) if !spirv_ok => {
                    return Err(err(format!("{} is not a Vulkan 1.3 adapter that takes SPIR-V", info.name)))
                }
                Some(s) => s,
                // Not on CPU adapters: without the identity in the way, lavapipe's LLVM spends
                // ~50 s optimizing the tiny model's shaders (1.7 s with it).
                None => {
                    spirv_ok
                        && info.device_type != wgpu::DeviceType::Cpu
                        && std::env::var("DS4_WGPU_SPIRV").map_or(true, |v| v != "off")
                }
            };
            let exactness = if spirv { super::Exactness::NoContraction } else { super::Exactness::OpaqueIdentity };
            let mut features = wgpu::Features::empty();
            if spirv {
                features |= wgpu::Features::PASSTHROUGH_SHADERS;
            }
            if timestamps {
                features |= wgpu::Features::TIMESTAMP_QUERY;
            }
            if subgroups {
                features |= wgpu::Features::SUBGROUP;
            }
            let desc = wgpu::DeviceDescriptor {
                label: Some("ds4"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: wgpu::ExperimentalFeatures::disabled(),
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            };
            let (device, queue) = pollster::block_on(adapter.request_device(&desc))
                .map_err(|e| err(format!("cannot open {}: {e}", info.name)))?;
            // Validation errors are collected and returned as errors, never a panic.
            let errors = Arc::new(Mutex::new(Vec::new()));
            let sink = errors.clone();
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                if let Ok(mut v) = sink.lock() {
                    v.push(e.to_string());
                }
            }));
            // Byte indices in the shaders are u32: keep every binding under 2 GiB.
            let adapter_max = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size).min(1 << 31);
            let max_binding = tuning.max_binding.map_or(adapter_max, |m| m.min(adapter_max));
            let rows = tuning.rows_per_invocation.unwrap_or(info.device_type == wgpu::DeviceType::Cpu);
            let moe_down_pairs = tuning
                .moe_down_pairs
                .unwrap_or_else(|| std::env::var("DS4_WGPU_MOE_DOWN").map_or(true, |v| v != "single"));
            let mut shaders = super::ShaderBuild { subgroups, exactness, fused_fma: false };
            let try_fma =
                tuning.fused_fma.unwrap_or_else(|| std::env::var("DS4_WGPU_FMA").map_or(true, |v| v != "off"));
            shaders.fused_fma = try_fma && probe_fma(&device, &queue, shaders, &errors)?;
            if tuning.fused_fma == Some(true) && !shaders.fused_fma {
                return Err(err(format!("{}: fma() does not round once on this adapter (the probe)", info.name)));
            }
            Ok(WgpuBackend { device, queue, info, timestamps, max_binding, rows, shaders, moe_down_pairs, errors })
        }

        /// The adapter's name and API, for the run's header.
        pub fn adapter(&self) -> String {
            let lanes = if self.shaders.subgroups { "subgroup butterfly" } else { "workgroup-memory butterfly" };
            let rows = if self.rows { "one invocation per row" } else { "32 lanes per row" };
            let exact = match self.shaders.exactness {
                super::Exactness::OpaqueIdentity => "WGSL with the opaque identity",
                super::Exactness::NoContraction => "SPIR-V with NoContraction",
            };
            let residuals = if self.shaders.fused_fma { "fma residuals" } else { "Dekker residuals" };
            // Bit-identity was measured through Vulkan only (lavapipe, NVIDIA); say so elsewhere,
            // so that a `ds4 check` difference there is read against its tolerance, not hidden.
            let unverified = match self.info.backend {
                wgpu::Backend::Vulkan => "",
                wgpu::Backend::Metal => {
                    "; bit-identity not shown on Metal, which compiles with fast math: `ds4 check` reports the difference"
                }
                _ => "; bit-identity not shown on this API: `ds4 check` reports the difference",
            };
            format!(
                "{} ({:?}, {}; {rows}, {lanes}, {exact}, {residuals}{unverified})",
                self.info.name, self.info.backend, self.info.driver
            )
        }
    }

    impl Backend for WgpuBackend {
        fn name(&self) -> &'static str {
            "wgpu"
        }
        fn numerics(&self) -> crate::numerics::Numerics {
            crate::numerics::Numerics::Canonical
        }
        fn compile(&self, program: Arc<Program>, model: Arc<Model>) -> Result<Box<dyn Executable>, BackendError> {
            WgpuExecutable::new(self, program, model).map(|e| Box::new(e) as Box<dyn Executable>)
        }
        fn default_prefill_chunk(&self) -> usize {
            super::DEFAULT_PREFILL_CHUNK
        }
        fn describe(&self) -> Option<String> {
            Some(self.adapter())
        }
    }

    struct Resolved {
        op: usize,
        entry: &'static str,
        pipeline: usize,
        bind_group: wgpu::BindGroup,
        groups: (u32, u32),
    }

    pub struct WgpuExecutable {
        program: Arc<Program>,
        device: wgpu::Device,
        queue: wgpu::Queue,
        errors: Arc<Mutex<Vec<String>>>,
        timestamps: bool,
        params: wgpu::Buffer,
        bufs: Vec<wgpu::Buffer>,
        pipelines: Vec<wgpu::ComputePipeline>,
        /// The token's dispatches (fused plan).
        dispatches: Vec<Resolved>,
        /// One dispatch group per op (unfused plan), for running a range of ops.
        single_ops: Vec<Resolved>,
        _weights: Vec<wgpu::Buffer>,
        warnings: Vec<String>,
        /// What a chunk program's dispatches bind besides their own buffers, and how the decode
        /// program was planned (a chunk program must lay out its weights the same way).
        res: Shared,
        chunk: Option<Chunk>,
        /// Host time per token (`DS4_WGPU_HOST_TIMES=1`): encoding, submitting, reading back.
        host_times: Option<std::cell::RefCell<HostTimes>>,
        sampler: DeviceSampler,
        /// What loading measured (the upload), for `load_report`.
        report: String,
        /// `sample_then_step` runs (`DS4_WGPU_FEED_AHEAD=off` makes a session sample, then feed,
        /// for measuring what feeding ahead gains).
        feed_ahead: bool,
        /// One read-back buffer for every read, grown when a read needs more.
        staging: std::cell::RefCell<Option<wgpu::Buffer>>,
        /// A token's command buffer, encoded ahead (while the GPU runs the token before): every
        /// token's commands are the same, only the step parameters differ.
        ready: Option<wgpu::CommandBuffer>,
        /// The last `step`'s command buffer with its parameters written, not submitted yet: a
        /// `sample` submits it with the sampler's dispatches, anything else first on its own.
        pending: Option<wgpu::CommandBuffer>,
    }

    /// The entry points of shaders/sample.wgsl, in the order of `DeviceSampler::passes`.
    const SAMPLE_ENTRIES: [&str; 6] =
        ["sample_argmax_part", "sample_argmax_final", "sample_hist", "sample_pick", "sample_gather", "sample_final"];

    /// The device sampler (shaders/sample.wgsl), dispatched after a token on its logits.
    struct DeviceSampler {
        /// The draw's parameters (`SampleParams`).
        params: wgpu::Buffer,
        /// The selection's state, the candidates, the argmax partials and the sampled id.
        st: wgpu::Buffer,
        /// The radix histogram and the gather's slot counter.
        hist: wgpu::Buffer,
        /// Workgroups of the sliced entries.
        groups: u32,
        /// A pipeline and its bind group per entry of `SAMPLE_ENTRIES`.
        passes: Vec<(wgpu::ComputePipeline, wgpu::BindGroup)>,
    }

    /// Where a token's host time goes, summed over tokens (printed with the warnings).
    #[derive(Default)]
    struct HostTimes {
        tokens: u32,
        encode: std::time::Duration,
        submit: std::time::Duration,
        reads: u32,
        read: std::time::Duration,
    }

    impl HostTimes {
        fn report(&self) -> String {
            let per = |d: std::time::Duration, n: u32| 1e6 * d.as_secs_f64() / n.max(1) as f64;
            format!(
                "host time per token over {} tokens: encode {:.1} us, submit {:.1} us; per read-back ({}): {:.1} us (the wait for the GPU included)",
                self.tokens,
                per(self.encode, self.tokens),
                per(self.submit, self.tokens),
                self.reads,
                per(self.read, self.reads)
            )
        }
    }

    /// The executable's weights, tables and pipelines, which an attached chunk program shares.
    struct Shared {
        weights: Vec<wgpu::Buffer>,
        /// Chunk k of weight w is `weights[wmap[w] + k]`.
        wmap: Vec<usize>,
        grid: wgpu::Buffer,
        ropes: Vec<wgpu::Buffer>,
        dummy: wgpu::Buffer,
        dummy_out: wgpu::Buffer,
        pipeline_of: HashMap<&'static str, usize>,
        /// The bindings each entry point uses.
        used_of: HashMap<&'static str, Vec<u32>>,
        layouts: Vec<Option<Layout>>,
        plan_ropes: Vec<(crate::model::RopeParams, u32)>,
        max_binding: u64,
        rows: bool,
        moe_down_pairs: bool,
    }

    impl Shared {
        /// The buffer of a planned resource both programs bind whole (weights, tables, dummies);
        /// `None` for buffers and scratch, which each program binds its own way.
        fn buffer(&self, r: Res) -> Option<&wgpu::Buffer> {
            Some(match r {
                Res::Weight(w, k) => &self.weights[self.wmap[w.0 as usize] + k as usize],
                Res::Vector(w) => &self.weights[self.wmap[w.0 as usize]],
                Res::Grid => &self.grid,
                Res::Rope(t) => &self.ropes[t as usize],
                Res::Dummy => &self.dummy,
                Res::DummyOut => &self.dummy_out,
                Res::Buf(_) | Res::Scratch(_) => return None,
            })
        }
    }

    /// An attached chunk program (`Executable::attach_chunk`): its plan's dispatches, each with
    /// one bind group per row. Row `r` of a dispatch is the decode dispatch of the same op with
    /// the step parameters of row `r` (`StepParams::row`: its token and position, so predicates
    /// and bounds are per row) and row `r` of every scratch buffer and scratch area; state
    /// buffers are the decode program's own.
    struct Chunk {
        program: Arc<Program>,
        /// Row r's step parameters at byte `r * ARGS_STRIDE`.
        params: wgpu::Buffer,
        /// The chunk program's scratch buffers, one row every `stride[b]` bytes; `None` for
        /// state buffers (bound to the decode program's).
        bufs: Vec<Option<wgpu::Buffer>>,
        stride: Vec<u64>,
        dispatches: Vec<ChunkDispatch>,
        _keep: Vec<wgpu::Buffer>,
        /// Tokens in the last chunk run.
        count: u32,
    }

    struct ChunkDispatch {
        pipeline: usize,
        /// One per row of the program.
        rows: Vec<wgpu::BindGroup>,
        groups: (u32, u32),
        /// The row loop of its op (`Step::seq`): `None` runs for every row before the next
        /// dispatch; consecutive dispatches of one loop run row by row.
        seq: Option<u32>,
        /// One dispatch computes every row (its one bind group is row 0's), and how.
        batched: Option<Batch>,
    }

    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Batch {
        /// Each invocation loops over the chunk's rows (`chunk_rows`).
        Loop,
        /// Row `r` is the workgroups with `workgroup_id.z == r`.
        Grid,
    }

    /// Pads bytes to a whole number of 4-byte words (at least one).
    fn padded(v: Vec<u8>) -> Vec<u8> {
        padded_to(v, 4)
    }

    /// Pads bytes to a whole number of `align`-byte units (at least one).
    fn padded_to(mut v: Vec<u8>, align: usize) -> Vec<u8> {
        let n = v.len().div_ceil(align).max(1) * align;
        v.resize(n, 0);
        v
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// The global variables each entry point of a module uses, by binding number.
    fn used_bindings(module: &naga::Module, info: &naga::valid::ModuleInfo, entry: &str) -> Option<Vec<u32>> {
        let i = module.entry_points.iter().position(|e| e.name == entry)?;
        let fi = info.get_entry_point(i);
        let mut out = Vec::new();
        for (h, g) in module.global_variables.iter() {
            if let Some(b) = &g.binding {
                if !fi[h].is_empty() {
                    out.push(b.binding);
                }
            }
        }
        out.sort_unstable();
        Some(out)
    }

    /// Parses and validates one shader file with naga.
    pub fn validate(file: &str, build: super::ShaderBuild) -> Result<(naga::Module, naga::valid::ModuleInfo), String> {
        let src = super::shader_source(file, build).ok_or_else(|| format!("no shader file {file}"))?;
        let module = naga::front::wgsl::parse_str(&src).map_err(|e| e.emit_to_string(&src))?;
        let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
            .validate(&module)
            .map_err(|e| e.emit_to_string(&src))?;
        Ok((module, info))
    }

    /// Entry points that write every word of workgroup memory before reading it: the zeroing
    /// that WGSL asks for would only cost (on llvmpipe through GL a workgroup's invocation 0
    /// stores every word: 20 ms a dispatch for the attention's 14 KiB).
    const NO_ZEROED_WORKGROUP_MEMORY: [&str; 7] = [
        "attention",
        "sample_argmax_part",
        "sample_argmax_final",
        "sample_hist",
        "sample_pick",
        "sample_gather",
        "sample_final",
    ];

    fn compilation_options(entry: &str) -> wgpu::PipelineCompilationOptions<'static> {
        wgpu::PipelineCompilationOptions {
            zero_initialize_workgroup_memory: !NO_ZEROED_WORKGROUP_MEMORY.contains(&entry),
            ..Default::default()
        }
    }

    /// One shader file as the device runs it: naga's module and analysis (for the bindings each
    /// entry point uses), and the WGSL module, or nothing where each entry point is compiled to
    /// SPIR-V of its own ([`super::Exactness::NoContraction`]).
    struct ShaderFile {
        file: &'static str,
        module: naga::Module,
        info: naga::valid::ModuleInfo,
        wgsl: Option<wgpu::ShaderModule>,
    }

    impl ShaderFile {
        fn new(device: &wgpu::Device, file: &'static str, build: super::ShaderBuild) -> Result<Self, BackendError> {
            let (module, info) = validate(file, build).map_err(|e| err(format!("shaders/{file}.wgsl: {e}")))?;
            let wgsl = match build.exactness {
                super::Exactness::NoContraction => None,
                super::Exactness::OpaqueIdentity => {
                    let src = super::shader_source(file, build).unwrap_or_default();
                    let desc = wgpu::ShaderModuleDescriptor {
                        label: Some(file),
                        source: wgpu::ShaderSource::Wgsl(src.into()),
                    };
                    // SAFETY: every loop in shaders/ ends: its bound is an argument word or a
                    // constant, and no loop waits on another invocation.
                    Some(unsafe { device.create_shader_module_trusted(desc, wgsl_checks()) })
                }
            };
            Ok(ShaderFile { file, module, info, wgsl })
        }

        /// The bindings `entry` uses.
        fn used(&self, entry: &str) -> Result<Vec<u32>, BackendError> {
            used_bindings(&self.module, &self.info, entry)
                .ok_or_else(|| err(format!("shaders/{}.wgsl has no entry point '{entry}'", self.file)))
        }

        /// The compute pipeline of `entry`.
        fn pipeline(&self, device: &wgpu::Device, entry: &str) -> Result<wgpu::ComputePipeline, BackendError> {
            let desc = |layout, module| wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout,
                module,
                entry_point: Some(entry),
                compilation_options: compilation_options(entry),
                cache: None,
            };
            if let Some(sm) = &self.wgsl {
                return Ok(device.create_compute_pipeline(&desc(None, sm)));
            }
            let fail = |e: String| err(format!("shaders/{}.wgsl, {entry}: {e}", self.file));
            let ep =
                self.module.entry_points.iter().find(|e| e.name == entry).ok_or_else(|| fail("no entry".into()))?;
            let used = self.used(entry)?;
            let mut words = spirv_words(&self.module, &self.info, entry, &used).map_err(fail)?;
            super::no_contraction(&mut words).map_err(fail)?;
            let [x, y, z] = ep.workgroup_size;
            let sm_desc = wgpu::ShaderModuleDescriptorPassthrough {
                label: Some(entry),
                entry_points: vec![wgpu::PassthroughShaderEntryPoint { name: entry.into(), workgroup_size: (x, y, z) }]
                    .into(),
                spirv: Some(words.into()),
                ..Default::default()
            };
            // SAFETY: naga wrote the SPIR-V from a module it validated, with the bounds checks
            // wgpu itself would ask for (`spirv_options`); the post-pass only adds decorations.
            let sm = unsafe { device.create_shader_module_passthrough(sm_desc) };
            // Passed-through code has no reflection for wgpu: the layout comes from naga's module.
            let mut entries = Vec::new();
            for b in used {
                let ty = buffer_binding(&self.module, b).ok_or_else(|| fail(format!("binding {b} is not a buffer")))?;
                entries.push(wgpu::BindGroupLayoutEntry {
                    binding: b,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer { ty, has_dynamic_offset: false, min_binding_size: None },
                    count: None,
                });
            }
            let bgl = device
                .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(entry), entries: &entries });
            let layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(entry),
                bind_group_layouts: &[Some(&bgl)],
                immediate_size: 0,
            });
            Ok(device.create_compute_pipeline(&desc(Some(&layout), &sm)))
        }
    }

    /// Without wgpu's forced loop bound: naga would give every loop a 64-bit counter and an extra
    /// exit, which keeps the driver from unrolling the short fixed loops (lanes, blocks,
    /// butterflies) every shader is made of. Bounds checks stay on (turning them off measured no
    /// faster on the H200: flash-4l 2.37 against 2.38 ms of device time per token).
    fn wgsl_checks() -> wgpu::ShaderRuntimeChecks {
        wgpu::ShaderRuntimeChecks { force_loop_bounding: false, ..Default::default() }
    }

    /// The SPIR-V of one entry point that uses the bindings `used` (ascending), before the
    /// NoContraction post-pass.
    fn spirv_words(
        module: &naga::Module,
        info: &naga::valid::ModuleInfo,
        entry: &str,
        used: &[u32],
    ) -> Result<Vec<u32>, String> {
        let pipeline = naga::back::spv::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: entry.to_string(),
        };
        naga::back::spv::write_vec(module, info, &spirv_options(entry, used), Some(&pipeline))
            .map_err(|e| e.to_string())
    }

    /// naga's SPIR-V options for one entry point that uses the bindings `used` (ascending):
    /// what wgpu's Vulkan backend asks for with `wgsl_checks` (index and buffer accesses
    /// restricted to their bounds, integer division checked, no forced loop bound), SPIR-V 1.6
    /// for Vulkan 1.3, and workgroup memory zeroed by the driver but for the entries that write
    /// it all first (a Vulkan 1.3 feature, which wgpu turns on; naga's polyfill made lavapipe's
    /// compile of the tiny model's shaders take minutes). wgpu's Vulkan backend numbers a
    /// layout's bindings 0, 1, ... in binding order (wgpu-hal 30, `create_bind_group_layout`), so
    /// binding `used[k]` is Vulkan binding k.
    fn spirv_options(entry: &str, used: &[u32]) -> naga::back::spv::Options<'static> {
        use naga::back::spv;
        use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy};
        let binding_map = used
            .iter()
            .enumerate()
            .map(|(k, &b)| {
                let target = spv::BindingInfo { descriptor_set: 0, binding: k as u32, binding_array_size: None };
                (naga::ResourceBinding { group: 0, binding: b }, target)
            })
            .collect();
        spv::Options {
            lang_version: (1, 6),
            flags: spv::WriterFlags::empty(),
            fake_missing_bindings: false,
            binding_map,
            bounds_check_policies: BoundsCheckPolicies {
                index: BoundsCheckPolicy::Restrict,
                buffer: BoundsCheckPolicy::Restrict,
                image_load: BoundsCheckPolicy::Restrict,
                binding_array: BoundsCheckPolicy::Unchecked,
            },
            zero_initialize_workgroup_memory: if NO_ZEROED_WORKGROUP_MEMORY.contains(&entry) {
                spv::ZeroInitializeWorkgroupMemoryMode::None
            } else {
                spv::ZeroInitializeWorkgroupMemoryMode::Native
            },
            force_loop_bounding: false,
            ray_query_initialization_tracking: false,
            ..Default::default()
        }
    }

    /// The buffer type of binding `b` (group 0) as the module declares it.
    fn buffer_binding(module: &naga::Module, b: u32) -> Option<wgpu::BufferBindingType> {
        let g = module
            .global_variables
            .iter()
            .map(|(_, g)| g)
            .find(|g| g.binding.as_ref().is_some_and(|r| r.group == 0 && r.binding == b))?;
        match g.space {
            naga::AddressSpace::Uniform => Some(wgpu::BufferBindingType::Uniform),
            naga::AddressSpace::Storage { access } => {
                Some(wgpu::BufferBindingType::Storage { read_only: !access.contains(naga::StorageAccess::STORE) })
            }
            _ => None,
        }
    }

    impl DeviceSampler {
        /// The sampler's buffers, pipelines and bind groups, over `logits` (`n` values).
        fn new(
            device: &wgpu::Device,
            build: super::ShaderBuild,
            params: &wgpu::Buffer,
            logits: &wgpu::Buffer,
            n: usize,
        ) -> Result<Self, BackendError> {
            let n = u32::try_from(n).map_err(|_| err("the vocabulary is too large to sample on the device"))?;
            let groups = n.div_ceil(super::SAMPLE_SLICE).max(1);
            if groups > device.limits().max_compute_workgroups_per_dimension {
                return Err(err("the vocabulary is too large to sample on the device"));
            }
            let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
            let buffer = |label: &str, words: u32, usage: wgpu::BufferUsages| {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: 4 * words as u64,
                    usage,
                    mapped_at_creation: false,
                })
            };
            let st = buffer("sampler state", super::SAMPLE_ST_PART + 2 * groups, storage);
            let hist = buffer("sampler histogram", 260, storage);
            let sp = buffer("sampler params", 8, wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST);
            let shader = ShaderFile::new(device, "sample", build)?;
            let mut passes = Vec::with_capacity(SAMPLE_ENTRIES.len());
            for entry in SAMPLE_ENTRIES {
                let pipeline = shader.pipeline(device, entry)?;
                let used = shader.used(entry)?;
                let mut entries = Vec::with_capacity(used.len());
                for b in used {
                    let buf = match b {
                        0 => params,
                        2 => logits,
                        3 => &st,
                        4 => &hist,
                        5 => &sp,
                        _ => return Err(err(format!("{entry}: binding {b} is not the sampler's"))),
                    };
                    entries.push(wgpu::BindGroupEntry { binding: b, resource: buf.as_entire_binding() });
                }
                let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(entry),
                    layout: &pipeline.get_bind_group_layout(0),
                    entries: &entries,
                });
                passes.push((pipeline, bind_group));
            }
            Ok(DeviceSampler { params: sp, st, hist, groups, passes })
        }
    }

    impl WgpuExecutable {
        fn new(be: &WgpuBackend, program: Arc<Program>, model: Arc<Model>) -> Result<Self, BackendError> {
            if !model.file.has_data() {
                return Err(err(format!(
                    "{} has no weights in host memory; it runs on --backend cuda, which draws them",
                    model.file.name()
                )));
            }
            let device = be.device.clone();
            // The token's fused plan, and one dispatch group per op for running single ops.
            let plan = plan::plan(&program, be.max_binding, be.rows, true, be.moe_down_pairs).map_err(err)?;
            let single = plan::plan(&program, be.max_binding, be.rows, false, be.moe_down_pairs).map_err(err)?;
            if single.layouts != plan.layouts || single.ropes != plan.ropes {
                return Err(err("the fused and the single-op plans lay the weights out differently"));
            }
            let mut scratch_need = plan.scratch.clone();
            for &(k, bytes) in &single.scratch {
                match scratch_need.iter_mut().find(|(s, _)| *s == k) {
                    Some((_, b)) => *b = (*b).max(bytes),
                    None => scratch_need.push((k, bytes)),
                }
            }
            let all: Vec<&plan::Dispatch> = plan.dispatches.iter().chain(&single.dispatches).collect();
            use wgpu::util::DeviceExt;
            let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
            let make = |label: &str, bytes: &[u8]| {
                device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: bytes,
                    usage: storage,
                })
            };
            let sized = |label: &str, bytes: u64| {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: bytes.div_ceil(4).max(1) * 4,
                    usage: storage,
                    mapped_at_creation: false,
                })
            };
            let max_buffer = device.limits().max_buffer_size;
            for d in program.buffers() {
                if d.len as u64 * 4 > max_buffer.min(be.max_binding) {
                    return Err(err(format!(
                        "buffer '{}' of {} bytes exceeds the adapter's largest binding; use a smaller --ctx",
                        d.name,
                        d.len * 4
                    )));
                }
            }
            let bufs: Vec<wgpu::Buffer> = program.buffers().iter().map(|d| sized(&d.name, d.len as u64 * 4)).collect();

            // Weights, in the layout the plan chose; chunk k of weight w is weights[wmap[w] + k].
            // wgpu stages each buffer's contents in host memory and copies it at the next submit:
            // submitting every UPLOAD_BATCH bytes bounds that staging memory (a whole model staged
            // at once would double its host footprint) and makes the upload finish here, timed,
            // instead of inside the first token.
            const UPLOAD_BATCH: u64 = 256 << 20;
            let t_upload = std::time::Instant::now();
            let (mut uploaded, mut staged) = (0u64, 0u64);
            let mut make = |label: &str, bytes: &[u8]| -> Result<wgpu::Buffer, BackendError> {
                let b = make(label, bytes);
                uploaded += bytes.len() as u64;
                staged += bytes.len() as u64;
                if staged >= UPLOAD_BATCH {
                    staged = 0;
                    be.queue.submit([]);
                    device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| err(format!("device lost: {e}")))?;
                }
                Ok(b)
            };
            let mut weights = Vec::new();
            let mut wmap = vec![usize::MAX; program.weights().len()];
            for (i, (t, layout)) in program.weights().iter().zip(&plan.layouts).enumerate() {
                let Some(layout) = layout else { continue };
                wmap[i] = weights.len();
                let data = model.data(t);
                match layout {
                    Layout::Vector => {
                        let mut v = vec![0f32; t.elements() as usize];
                        quant::dequantize_row(t.ty, data, &mut v).map_err(|e| err(format!("{}: {e}", t.name)))?;
                        weights.push(make(&t.name, &f32_bytes(&v))?);
                    }
                    Layout::Raw => {
                        if data.len() as u64 > be.max_binding {
                            return Err(err(format!("tensor '{}' exceeds the largest storage binding", t.name)));
                        }
                        weights.push(make(&t.name, &padded(data.to_vec()))?);
                    }
                    Layout::Rows(ranges) => {
                        let rb = t.ty.row_bytes(t.dim(0) as usize);
                        for &(r0, n) in ranges {
                            let bytes = &data[r0 as usize * rb..(r0 + n) as usize * rb];
                            // Q8_0 in whole 16-byte vectors: mat_vec_q8_0 reads it as vec4<u32>.
                            let bytes = if t.ty == GgmlType::Q8_0 {
                                padded_to(gpu_tables::repack_blocks(t.ty, bytes).into_owned(), 16)
                            } else {
                                padded(bytes.to_vec())
                            };
                            weights.push(make(&t.name, &bytes)?);
                        }
                    }
                    Layout::Experts(ranges) => {
                        let eb = (t.bytes / t.dim(2)) as usize;
                        for &(e0, n) in ranges {
                            // The split layout in whole 16-byte vectors: the expert shaders read
                            // quants (and Q4_K's rest) as vec4<u32>.
                            let bytes = &data[e0 as usize * eb..(e0 + n) as usize * eb];
                            let bytes = padded_to(gpu_tables::repack_blocks(t.ty, bytes).into_owned(), 16);
                            weights.push(make(&t.name, &bytes)?);
                        }
                    }
                }
            }
            let grid = make("iq2_xxs grid", &gpu_tables::iq2_xxs_grid_bytes())?;
            let ropes = plan
                .ropes
                .iter()
                .map(|(r, n_rot)| make("rope", &f32_bytes(&gpu_tables::rope_table(r, *n_rot, program.positions()))))
                .collect::<Result<Vec<_>, _>>()?;
            be.queue.submit([]);
            device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| err(format!("device lost: {e}")))?;
            let upload_s = t_upload.elapsed().as_secs_f64();
            let report = format!(
                "  upload  {:.2} GB of weights and tables in {upload_s:.2} s ({:.1} GB/s, dequantizing and repacking included)\n",
                uploaded as f64 / 1e9,
                uploaded as f64 / upload_s.max(1e-9) / 1e9
            );
            let scratch: HashMap<Scratch, wgpu::Buffer> =
                scratch_need.iter().map(|&(k, bytes)| (k, sized(&format!("{k:?}"), bytes))).collect();
            let mut shared = Shared {
                weights,
                wmap,
                grid,
                ropes,
                dummy: sized("dummy", 16),
                dummy_out: sized("dummy output", 16),
                pipeline_of: HashMap::new(),
                used_of: HashMap::new(),
                layouts: plan.layouts.clone(),
                plan_ropes: plan.ropes.clone(),
                max_binding: be.max_binding,
                rows: be.rows,
                moe_down_pairs: be.moe_down_pairs,
            };
            let params = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("step params"),
                size: 16,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut words = vec![0u32; all.len() * ARGS_STRIDE as usize / 4];
            for (i, d) in all.iter().enumerate() {
                let at = i * ARGS_STRIDE as usize / 4;
                words[at..at + 3].copy_from_slice(&d.cond);
                words[at + 4..at + 4 + d.args.len()].copy_from_slice(&d.args);
            }
            let args = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("dispatch args"),
                contents: bytemuck::cast_slice(&words),
                usage: wgpu::BufferUsages::UNIFORM,
            });

            // One module per shader file, one pipeline per entry point.
            let mut modules: HashMap<&'static str, ShaderFile> = HashMap::new();
            let mut pipelines = Vec::new();
            let mut dispatches = Vec::with_capacity(all.len());
            let max_x = device.limits().max_compute_workgroups_per_dimension.min(plan::MAX_GROUPS_X);
            for (i, d) in all.iter().enumerate() {
                let file = plan::shader_of(d.entry).ok_or_else(|| err(format!("no shader has '{}'", d.entry)))?;
                if !modules.contains_key(file) {
                    modules.insert(file, ShaderFile::new(&device, file, be.shaders)?);
                }
                let shader = &modules[file];
                let p = match shared.pipeline_of.get(d.entry) {
                    Some(&p) => p,
                    None => {
                        pipelines.push(shader.pipeline(&device, d.entry)?);
                        shared.pipeline_of.insert(d.entry, pipelines.len() - 1);
                        pipelines.len() - 1
                    }
                };
                let used = shader.used(d.entry)?;
                shared.used_of.insert(d.entry, used.clone());
                let mut entries = Vec::with_capacity(used.len());
                for b in used {
                    let resource = match b {
                        0 => params.as_entire_binding(),
                        1 => wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: &args,
                            offset: i as u64 * ARGS_STRIDE,
                            size: wgpu::BufferSize::new(128),
                        }),
                        _ => {
                            let res = d.binds.iter().find(|(k, _)| *k == b).map(|&(_, r)| r).ok_or_else(|| {
                                err(format!("op #{} ({}): binding {b} is not planned", d.op, d.entry))
                            })?;
                            let buf = match res {
                                Res::Buf(x) => &bufs[x.0 as usize],
                                Res::Scratch(s) => scratch.get(&s).ok_or_else(|| err(format!("no scratch {s:?}")))?,
                                other => shared.buffer(other).ok_or_else(|| err(format!("no buffer for {other:?}")))?,
                            };
                            buf.as_entire_binding()
                        }
                    };
                    entries.push(wgpu::BindGroupEntry { binding: b, resource });
                }
                let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(d.entry),
                    layout: &pipelines[p].get_bind_group_layout(0),
                    entries: &entries,
                });
                let x = d.groups.min(max_x);
                let y = d.groups.div_ceil(x);
                dispatches.push(Resolved { op: d.op, entry: d.entry, pipeline: p, bind_group, groups: (x, y) });
            }
            let single_ops = dispatches.split_off(plan.dispatches.len());
            let logits = &bufs[program.logits().0 as usize];
            let sampler = DeviceSampler::new(&device, be.shaders, &params, logits, program.n_vocab())?;
            let mut exe = WgpuExecutable {
                program,
                device,
                queue: be.queue.clone(),
                errors: be.errors.clone(),
                timestamps: be.timestamps,
                params,
                bufs,
                pipelines,
                dispatches,
                single_ops,
                _weights: [args].into_iter().chain(scratch.into_values()).collect(),
                warnings: Vec::new(),
                res: shared,
                chunk: None,
                host_times: std::env::var("DS4_WGPU_HOST_TIMES")
                    .is_ok_and(|v| v == "1")
                    .then(|| std::cell::RefCell::new(HostTimes::default())),
                sampler,
                report,
                feed_ahead: std::env::var("DS4_WGPU_FEED_AHEAD").map_or(true, |v| v != "off"),
                staging: std::cell::RefCell::new(None),
                ready: None,
                pending: None,
            };
            exe.check_errors()?;
            exe.reset()?;
            exe.check_errors()?;
            Ok(exe)
        }

        /// Compiles a chunk program to run on this executable's state (`attach_chunk`).
        fn make_chunk(&self, chunk: Arc<Program>) -> Result<Chunk, BackendError> {
            let res = &self.res;
            if chunk.tokens().is_none() {
                return Err(err("a chunk program needs more than one row"));
            }
            if chunk.positions() != self.program.positions() || chunk.n_vocab() != self.program.n_vocab() {
                return Err(err("the chunk program was recorded for another context or model"));
            }
            if chunk.weights() != self.program.weights() {
                return Err(err("the chunk program reads other weights than the decode program"));
            }
            let state = chunk.state_binding(&self.program).map_err(|e| err(format!("chunk program: {e}")))?;
            // One op per dispatch: a fused dispatch could join a row loop's op to a batch op.
            let plan = plan::plan(&chunk, res.max_binding, res.rows, false, res.moe_down_pairs).map_err(err)?;
            if plan.layouts != res.layouts || plan.ropes != res.plan_ropes {
                return Err(err("the chunk program lays out its weights or RoPE tables differently"));
            }
            let device = &self.device;
            let rows = chunk.rows() as u64;
            let limits = device.limits();
            let align = (limits.min_storage_buffer_offset_alignment as u64).max(ARGS_STRIDE);
            let stride_of = |bytes: u64| bytes.div_ceil(align).max(1) * align;
            let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
            let sized = |label: &str, bytes: u64| -> Result<wgpu::Buffer, BackendError> {
                if bytes > limits.max_buffer_size {
                    return Err(err(format!(
                        "the chunk's '{label}' ({rows} rows) needs {bytes} bytes, more than the adapter's largest \
                         buffer; use a smaller --prefill-chunk"
                    )));
                }
                Ok(device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: bytes,
                    usage: storage,
                    mapped_at_creation: false,
                }))
            };
            let mut state_of = vec![None; chunk.buffers().len()];
            for &(c, d) in &state {
                state_of[c.0 as usize] = Some(d);
            }
            let mut bufs = Vec::with_capacity(chunk.buffers().len());
            let mut stride = Vec::with_capacity(chunk.buffers().len());
            for (i, d) in chunk.buffers().iter().enumerate() {
                let st = stride_of(d.len as u64 * 4);
                stride.push(st);
                bufs.push(match state_of[i] {
                    Some(_) => None,
                    None => Some(sized(&d.name, rows * st)?),
                });
            }
            let mut scratch: HashMap<Scratch, (wgpu::Buffer, u64, u64)> = HashMap::new();
            for &(k, bytes) in &plan.scratch {
                let bytes = bytes.div_ceil(4).max(1) * 4;
                let st = stride_of(bytes);
                scratch.insert(k, (sized(&format!("{k:?}"), rows * st)?, st, bytes));
            }
            let params = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("chunk step params"),
                size: rows * ARGS_STRIDE,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            // Batched: one dispatch for all rows, with the row strides in words of X (or its Q8_0
            // scratch) and OUT in argument words 26 and 27 (`chunk_rows` in shaders/common.wgsl):
            // the matvecs with one invocation per matrix row loop over the chunk's rows; the
            // 32-lane matvecs (not split-K), the RMS norm (without the quantizations and RoPE it
            // fuses in a decode plan), SwiGLU, Add, the Q8_0 quantization and RoPE (each row at
            // its position) take a row per workgroup along z.
            let scratch_buf = |d: &plan::Dispatch, b: u32| match d.binds.iter().find(|(k, _)| *k == b) {
                Some(&(_, Res::Buf(x))) if state_of[x.0 as usize].is_none() => Some(stride[x.0 as usize]),
                Some(&(_, Res::Scratch(s))) => scratch.get(&s).map(|e| e.1),
                _ => None,
            };
            let max_z = limits.max_compute_workgroups_per_dimension as u64;
            let batched: Vec<Option<(u64, u64, Batch)>> = plan
                .dispatches
                .iter()
                .map(|d| {
                    let (x, out, how) = match d.entry {
                        "mat_vec_q8_0_rows" => (5, 4, Batch::Loop),
                        "mat_vec_f16_rows" | "mat_vec_f32_rows" => (3, 4, Batch::Loop),
                        // The 32-lane matvecs: a token row per workgroup along z (the Q8_0 one
                        // reads its input as 16-byte vectors: its row stride must be whole ones).
                        "mat_vec_q8_0" if rows <= max_z && scratch_buf(d, 5).is_some_and(|s| s % 16 == 0) => {
                            (5, 4, Batch::Grid)
                        }
                        "mat_vec_f16" | "mat_vec_f32" if rows <= max_z => (3, 4, Batch::Grid),
                        "rms_norm" if d.args[6..10] == [0; 4] && rows <= max_z => (2, 3, Batch::Grid),
                        "quantize_q8_0" if rows <= max_z => (3, 5, Batch::Grid),
                        // Only X has rows (the out stride is unread).
                        "rope_tail" if rows <= max_z => (2, 2, Batch::Grid),
                        // Three vectors of one length: one stride (swiglu without its Q8_0).
                        "swiglu" | "add" if (d.entry == "add" || d.args[2] == 0) && rows <= max_z => {
                            let s = [2, 3, 4].map(|b| scratch_buf(d, b));
                            if s[0].is_none() || s[0] != s[1] || s[0] != s[2] {
                                return None;
                            }
                            (2, 4, Batch::Grid)
                        }
                        _ => return None,
                    };
                    let in_loop = chunk.steps()[d.op].seq.is_some();
                    let (xs, os) = (scratch_buf(d, x)?, scratch_buf(d, out)?);
                    (!in_loop && d.args.len() <= 26).then_some((xs / 4, os / 4, how))
                })
                .collect();
            let mut words = vec![0u32; plan.dispatches.len() * ARGS_STRIDE as usize / 4];
            for (i, d) in plan.dispatches.iter().enumerate() {
                let at = i * ARGS_STRIDE as usize / 4;
                words[at..at + 3].copy_from_slice(&d.cond);
                words[at + 4..at + 4 + d.args.len()].copy_from_slice(&d.args);
                if let Some((xs, os, _)) = batched[i] {
                    words[at + 4 + 26] = xs as u32;
                    words[at + 4 + 27] = os as u32;
                }
            }
            use wgpu::util::DeviceExt;
            let args = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("chunk dispatch args"),
                contents: bytemuck::cast_slice(&words),
                usage: wgpu::BufferUsages::UNIFORM,
            });
            let range = |buffer, offset, size: u64| {
                wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer, offset, size: wgpu::BufferSize::new(size) })
            };
            let max_x = limits.max_compute_workgroups_per_dimension.min(plan::MAX_GROUPS_X);
            let mut dispatches = Vec::with_capacity(plan.dispatches.len());
            for (i, d) in plan.dispatches.iter().enumerate() {
                let named = |e: String| err(format!("chunk program: op #{} ({}): {e}", d.op, d.entry));
                let pipeline = *res
                    .pipeline_of
                    .get(d.entry)
                    .ok_or_else(|| named("no pipeline: the decode program never dispatches this entry".into()))?;
                let used = &res.used_of[d.entry];
                let layout = self.pipelines[pipeline].get_bind_group_layout(0);
                let mut per_row = Vec::with_capacity(rows as usize);
                // A batched dispatch has one bind group: row 0's parameters, whole buffers.
                let whole = batched[i].is_some();
                for r in 0..if whole { 1 } else { rows } {
                    let mut entries = Vec::with_capacity(used.len());
                    for &b in used {
                        let resource = match b {
                            0 => range(&params, r * ARGS_STRIDE, 16),
                            1 => range(&args, i as u64 * ARGS_STRIDE, 128),
                            _ => {
                                let bound = d.binds.iter().find(|(k, _)| *k == b).map(|&(_, x)| x);
                                match bound.ok_or_else(|| named(format!("binding {b} is not planned")))? {
                                    Res::Buf(x) => match (state_of[x.0 as usize], &bufs[x.0 as usize]) {
                                        (Some(dx), _) => self.bufs[dx.0 as usize].as_entire_binding(),
                                        (None, Some(buf)) if whole => buf.as_entire_binding(),
                                        (None, Some(buf)) => {
                                            let len = chunk.buffer(x).len as u64 * 4;
                                            range(buf, r * stride[x.0 as usize], len.max(4))
                                        }
                                        (None, None) => return Err(named(format!("buffer {} is missing", x.0))),
                                    },
                                    Res::Scratch(s) => {
                                        let (buf, st, bytes) =
                                            scratch.get(&s).ok_or_else(|| named(format!("no scratch {s:?}")))?;
                                        match whole {
                                            true => buf.as_entire_binding(),
                                            false => range(buf, r * st, *bytes),
                                        }
                                    }
                                    other => res
                                        .buffer(other)
                                        .ok_or_else(|| named(format!("no buffer for {other:?}")))?
                                        .as_entire_binding(),
                                }
                            }
                        };
                        entries.push(wgpu::BindGroupEntry { binding: b, resource });
                    }
                    per_row.push(device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some(d.entry),
                        layout: &layout,
                        entries: &entries,
                    }));
                }
                let x = d.groups.min(max_x);
                let y = d.groups.div_ceil(x);
                let seq = chunk.steps()[d.op].seq;
                let batched = batched[i].map(|b| b.2);
                dispatches.push(ChunkDispatch { pipeline, rows: per_row, groups: (x, y), seq, batched });
            }
            let keep = [args].into_iter().chain(scratch.into_values().map(|(b, _, _)| b)).collect();
            self.check_errors()?;
            Ok(Chunk { program: chunk, params, bufs, stride, dispatches, _keep: keep, count: 0 })
        }

        /// Runs the attached chunk program on `tokens` (`step_chunk`): batch dispatches for every
        /// row before the next dispatch, a row loop's dispatches row by row; one submit.
        fn run_chunk(&mut self, p: &StepParams, tokens: &[u32]) -> Result<(), BackendError> {
            let chunk = self.chunk.as_mut().ok_or_else(|| err("no chunk program is attached"))?;
            chunk.program.check_chunk(p, tokens).map_err(err)?;
            let mut words = vec![0u32; tokens.len() * ARGS_STRIDE as usize / 4];
            for (r, &t) in tokens.iter().enumerate() {
                let row = p.row(r as u32, t);
                let at = r * ARGS_STRIDE as usize / 4;
                words[at..at + 2].copy_from_slice(&[row.token, row.pos]);
            }
            // Row 0's parameters carry the chunk's length, for the batched dispatches.
            words[3] = tokens.len() as u32;
            self.queue.write_buffer(&chunk.params, 0, bytemuck::cast_slice(&words));
            let count = tokens.len();
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("chunk") });
            {
                let mut pass =
                    enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
                let list = &chunk.dispatches;
                let mut i = 0;
                while i < list.len() {
                    let end = match list[i].seq {
                        None => i + 1,
                        Some(k) => i + list[i..].iter().take_while(|d| d.seq == Some(k)).count(),
                    };
                    if let Some(how) = list[i].batched {
                        let d = &list[i];
                        let z = if how == Batch::Grid { count as u32 } else { 1 };
                        pass.set_pipeline(&self.pipelines[d.pipeline]);
                        pass.set_bind_group(0, &d.rows[0], &[]);
                        pass.dispatch_workgroups(d.groups.0, d.groups.1, z);
                        i = end;
                        continue;
                    }
                    for r in 0..count {
                        for d in &list[i..end] {
                            pass.set_pipeline(&self.pipelines[d.pipeline]);
                            pass.set_bind_group(0, &d.rows[r], &[]);
                            pass.dispatch_workgroups(d.groups.0, d.groups.1, 1);
                        }
                    }
                    i = end;
                }
            }
            // The decode program's logits are the last token's, as after a decode step.
            let lb = chunk.program.logits().0 as usize;
            let (src, st) = (chunk.bufs[lb].as_ref().ok_or_else(|| err("the logits are state"))?, chunk.stride[lb]);
            let bytes = self.program.n_vocab() as u64 * 4;
            let dst = &self.bufs[self.program.logits().0 as usize];
            enc.copy_buffer_to_buffer(src, (count as u64 - 1) * st, dst, 0, bytes);
            chunk.count = count as u32;
            self.queue.submit([enc.finish()]);
            self.check_errors()
        }

        /// The first validation or device error wgpu reported since the last check.
        fn check_errors(&self) -> Result<(), BackendError> {
            first_error(&self.errors)
        }

        fn wait(&self) -> Result<(), BackendError> {
            self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| err(format!("device lost: {e}")))?;
            self.check_errors()
        }

        fn write_params(&self, p: &StepParams) -> Result<(), BackendError> {
            self.program.check_params(p).map_err(err)?;
            self.queue.write_buffer(&self.params, 0, bytemuck::cast_slice(&[p.token, p.pos, 0u32, 0u32]));
            Ok(())
        }

        /// The dispatches in `list` of ops in `ops`, recorded into one compute pass.
        fn encode(&self, list: &[Resolved], ops: std::ops::Range<usize>) -> wgpu::CommandBuffer {
            let t0 = std::time::Instant::now();
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("token") });
            {
                let mut pass =
                    enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
                for d in list.iter().filter(|d| ops.contains(&d.op)) {
                    pass.set_pipeline(&self.pipelines[d.pipeline]);
                    pass.set_bind_group(0, &d.bind_group, &[]);
                    pass.dispatch_workgroups(d.groups.0, d.groups.1, 1);
                }
            }
            let cb = enc.finish();
            if let Some(h) = &self.host_times {
                h.borrow_mut().encode += t0.elapsed();
            }
            cb
        }

        fn submit(&self, cbs: impl IntoIterator<Item = wgpu::CommandBuffer>) -> wgpu::SubmissionIndex {
            let t0 = std::time::Instant::now();
            let index = self.queue.submit(cbs);
            if let Some(h) = &self.host_times {
                h.borrow_mut().submit += t0.elapsed();
            }
            index
        }

        /// Submits the last step's commands if they still wait, then encodes the next token's
        /// if none are ready (while the GPU runs the one just submitted). Everything that uses
        /// the queue, other than `sample`, calls this first.
        fn flush(&mut self) -> Result<(), BackendError> {
            if let Some(cb) = self.pending.take() {
                self.submit([cb]);
            }
            self.prepare();
            self.check_errors()
        }

        fn prepare(&mut self) {
            if self.ready.is_none() {
                self.ready = Some(self.encode(&self.dispatches, 0..usize::MAX));
            }
        }

        /// The read-back buffer, at least `bytes` long.
        fn staging(&self, bytes: u64) -> wgpu::Buffer {
            let mut s = self.staging.borrow_mut();
            if let Some(b) = s.as_ref().filter(|b| b.size() >= bytes) {
                return b.clone();
            }
            let b = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size: bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            *s = Some(b.clone());
            b
        }

        /// The first `bytes` (a multiple of 4) of the read-back buffer, once the GPU has written
        /// them: once submission `after` is done (None: every submission). After a failure the
        /// buffer is dropped (its map may still be pending).
        fn map_read(
            &self,
            staging: &wgpu::Buffer,
            bytes: u64,
            after: Option<wgpu::SubmissionIndex>,
        ) -> Result<Vec<u8>, BackendError> {
            let out = read_mapped(staging, bytes, || match after {
                None => self.wait(),
                Some(index) => {
                    self.device
                        .poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None })
                        .map_err(|e| err(format!("device lost: {e}")))?;
                    self.check_errors()
                }
            });
            if out.is_err() {
                *self.staging.borrow_mut() = None;
            }
            out
        }

        /// The device sampler's commands for draw `s` on the last step's logits, ending with a
        /// copy of the id into the read-back buffer `staging`.
        fn encode_sample(&self, s: &DeviceSample, staging: &wgpu::Buffer) -> wgpu::CommandBuffer {
            let sm = &self.sampler;
            let words = [
                self.program.n_vocab() as u32,
                s.candidates(),
                s.temperature.to_bits(),
                s.top_p.to_bits(),
                s.min_p.to_bits(),
                s.r.to_bits(),
                0,
                0,
            ];
            self.queue.write_buffer(&sm.params, 0, bytemuck::cast_slice(&words));
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("sample") });
            // (entry of SAMPLE_ENTRIES, workgroups)
            let mut seq = Vec::with_capacity(10);
            if s.is_greedy() {
                seq.extend([(0, sm.groups), (1, 1)]);
            } else {
                enc.clear_buffer(&sm.hist, 0, None);
                enc.clear_buffer(&sm.st, 0, Some(4 * super::SAMPLE_ST_HEADER as u64));
                for _ in 0..4 {
                    seq.extend([(2, sm.groups), (3, 1)]);
                }
                seq.extend([(4, sm.groups), (5, 1)]);
            }
            {
                let mut pass =
                    enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
                for (i, groups) in seq {
                    pass.set_pipeline(&sm.passes[i].0);
                    pass.set_bind_group(0, &sm.passes[i].1, &[]);
                    pass.dispatch_workgroups(groups, 1, 1);
                }
            }
            enc.copy_buffer_to_buffer(&sm.st, 4 * super::SAMPLE_ST_OUT as u64, staging, 0, 4);
            enc.finish()
        }

        /// Waits for the sampled id in `staging` (written by submission `after`) and checks it.
        fn sampled_id(
            &self,
            staging: &wgpu::Buffer,
            after: Option<wgpu::SubmissionIndex>,
            t0: std::time::Instant,
        ) -> Result<u32, BackendError> {
            let raw = self.map_read(staging, 4, after)?;
            if let Some(h) = &self.host_times {
                let mut h = h.borrow_mut();
                h.reads += 1;
                h.read += t0.elapsed();
            }
            let id = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
            let n = self.program.n_vocab();
            if id as usize >= n {
                return Err(err(format!("the device sampler returned token {id} of a {n}-token vocabulary")));
            }
            Ok(id)
        }

        /// Copies the first `bytes` of `buf` back (the queue flushed by the caller).
        fn read_raw(&self, buf: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>, BackendError> {
            let t0 = std::time::Instant::now();
            let size = bytes.div_ceil(4).max(1) * 4;
            let staging = self.staging(size);
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("read") });
            enc.copy_buffer_to_buffer(buf, 0, &staging, 0, size);
            self.queue.submit([enc.finish()]);
            let mut out = self.map_read(&staging, size, None)?;
            out.truncate(bytes as usize);
            if let Some(h) = &self.host_times {
                let mut h = h.borrow_mut();
                h.reads += 1;
                h.read += t0.elapsed();
            }
            Ok(out)
        }

        /// Times each dispatch with timestamp queries, one compute pass per dispatch. A pass's
        /// start stamp may be written before the barrier that waits for the pass before it (the
        /// earlier profile charged shaders with their predecessors' time), so a dispatch's time
        /// counts from the later of its own start and the previous pass's end: the times add up
        /// to the span of the token.
        ///
        /// `DS4_WGPU_PROFILE_REPEAT=N` (2..=100) runs each dispatch N times inside its pass and
        /// charges it 1/N of the pass: the per-pass cost, which the single-dispatch passes add to
        /// every shader, is then spread over N dispatches. The repeats write the token's buffers
        /// again (an in-place add adds N times), so the state after such a profile is not a
        /// token's: it is for timing only.
        fn profile_timestamps(&self) -> Result<Vec<(String, f64)>, BackendError> {
            let repeat = std::env::var("DS4_WGPU_PROFILE_REPEAT")
                .ok()
                .and_then(|v| v.parse::<u32>().ok())
                .filter(|r| (2..=100).contains(r))
                .unwrap_or(1);
            let n = self.dispatches.len() as u32;
            let qs = self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * n,
            });
            let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamps"),
                size: 16 * n as u64,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let mut enc =
                self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("profile") });
            for (i, d) in self.dispatches.iter().enumerate() {
                let tw = wgpu::ComputePassTimestampWrites {
                    query_set: &qs,
                    beginning_of_pass_write_index: Some(2 * i as u32),
                    end_of_pass_write_index: Some(2 * i as u32 + 1),
                };
                let mut pass =
                    enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: Some(tw) });
                pass.set_pipeline(&self.pipelines[d.pipeline]);
                pass.set_bind_group(0, &d.bind_group, &[]);
                for _ in 0..repeat {
                    pass.dispatch_workgroups(d.groups.0, d.groups.1, 1);
                }
            }
            enc.resolve_query_set(&qs, 0..2 * n, &resolve, 0);
            self.queue.submit([enc.finish()]);
            let raw = self.read_raw(&resolve, 16 * n as u64)?;
            let ticks: &[u64] = bytemuck::cast_slice(&raw);
            let period = self.queue.get_timestamp_period() as f64;
            Ok(self
                .dispatches
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let start = if i > 0 { ticks[2 * i].max(ticks[2 * i - 1]) } else { ticks[0] };
                    let us = ticks[2 * i + 1].saturating_sub(start) as f64 * period / 1e3;
                    (d.entry.to_string(), us / repeat as f64)
                })
                .collect())
        }
    }

    impl Executable for WgpuExecutable {
        fn program(&self) -> &Arc<Program> {
            &self.program
        }

        fn step(&mut self, p: &StepParams) -> Result<(), BackendError> {
            self.program.check_params(p).map_err(err)?;
            // The token before goes first: its parameters are written at its submit.
            self.flush()?;
            self.write_params(p)?;
            let cb = match self.ready.take() {
                Some(cb) => cb,
                None => self.encode(&self.dispatches, 0..usize::MAX),
            };
            self.pending = Some(cb);
            if let Some(h) = &self.host_times {
                h.borrow_mut().tokens += 1;
            }
            Ok(())
        }

        fn step_ops(&mut self, p: &StepParams, ops: std::ops::Range<usize>) -> Result<(), BackendError> {
            self.program.check_params(p).map_err(err)?;
            self.flush()?;
            self.write_params(p)?;
            let cb = self.encode(&self.single_ops, ops);
            self.submit([cb]);
            self.check_errors()
        }

        fn sample(&mut self, s: &DeviceSample) -> Result<Option<u32>, BackendError> {
            let t0 = std::time::Instant::now();
            let staging = self.staging(4);
            let cb = self.encode_sample(s, &staging);
            // The last step's commands and the sampler's in one submit.
            let mut cbs = Vec::with_capacity(2);
            cbs.extend(self.pending.take());
            cbs.push(cb);
            self.submit(cbs);
            self.check_errors()?;
            self.prepare();
            self.sampled_id(&staging, None, t0).map(Some)
        }

        fn samples_then_steps(&self) -> bool {
            self.feed_ahead
        }

        fn sample_then_step(&mut self, s: &DeviceSample, pos: u32) -> Result<u32, BackendError> {
            let t0 = std::time::Instant::now();
            let next = StepParams::new(0, pos);
            self.program.check_params(&next).map_err(err)?;
            let staging = self.staging(4);
            let cb = self.encode_sample(s, &staging);
            let mut cbs = Vec::with_capacity(2);
            cbs.extend(self.pending.take());
            cbs.push(cb);
            let sampled = self.submit(cbs);
            self.check_errors()?;
            // The next step's position now, its token from the sampler's state on the device: the
            // write lands after the sampler's submit, the copy before the step's dispatches.
            self.write_params(&next)?;
            let mut enc =
                self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("sampled token") });
            enc.copy_buffer_to_buffer(&self.sampler.st, 4 * super::SAMPLE_ST_OUT as u64, &self.params, 0, 4);
            let step = match self.ready.take() {
                Some(cb) => cb,
                None => self.encode(&self.dispatches, 0..usize::MAX),
            };
            self.submit([enc.finish(), step]);
            if let Some(h) = &self.host_times {
                h.borrow_mut().tokens += 1;
            }
            self.check_errors()?;
            // The token after it encoded while the GPU runs both; then only the sampler is waited for.
            self.prepare();
            self.sampled_id(&staging, Some(sampled), t0)
        }

        fn load_report(&self) -> Option<String> {
            Some(self.report.clone())
        }

        fn profile(&mut self, p: &StepParams) -> Result<Vec<(String, f64)>, BackendError> {
            self.program.check_params(p).map_err(err)?;
            self.flush()?;
            self.write_params(p)?;
            if self.timestamps {
                return Ok(crate::backend::summarize_profile(self.profile_timestamps()?));
            }
            // No timestamp queries on this adapter: time each dispatch from the host.
            self.warnings.push("this adapter has no timestamp queries: the profile is timed on the host".into());
            let mut times = Vec::new();
            for i in 0..self.dispatches.len() {
                let t0 = std::time::Instant::now();
                let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
                {
                    let d = &self.dispatches[i];
                    let mut pass =
                        enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
                    pass.set_pipeline(&self.pipelines[d.pipeline]);
                    pass.set_bind_group(0, &d.bind_group, &[]);
                    pass.dispatch_workgroups(d.groups.0, d.groups.1, 1);
                }
                self.queue.submit([enc.finish()]);
                self.wait()?;
                times.push((self.dispatches[i].entry.to_string(), t0.elapsed().as_secs_f64() * 1e6));
            }
            Ok(crate::backend::summarize_profile(times))
        }

        fn write_buffer(&mut self, buf: Buf, data: &[f32]) -> Result<(), BackendError> {
            self.flush()?;
            let d = self.program.buffers().get(buf.0 as usize).ok_or_else(|| err(format!("no buffer {}", buf.0)))?;
            if d.len != data.len() {
                return Err(err(format!("buffer '{}' holds {} values, not {}", d.name, d.len, data.len())));
            }
            let raw: Vec<u32> = match d.dtype {
                DType::F32 => data.iter().map(|v| v.to_bits()).collect(),
                DType::I32 => data.iter().map(|&v| v as i32 as u32).collect(),
            };
            self.queue.write_buffer(&self.bufs[buf.0 as usize], 0, bytemuck::cast_slice(&raw));
            self.wait()
        }

        fn read_logits(&mut self, out: &mut Vec<f32>) -> Result<(), BackendError> {
            *out = self.read_buffer(self.program.logits())?;
            Ok(())
        }

        fn read_buffer(&mut self, buf: Buf) -> Result<Vec<f32>, BackendError> {
            self.flush()?;
            let d = self.program.buffers().get(buf.0 as usize).ok_or_else(|| err(format!("no buffer {}", buf.0)))?;
            let raw = self.read_raw(&self.bufs[buf.0 as usize], d.len as u64 * 4)?;
            let words: Vec<u32> = raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Ok(match d.dtype {
                DType::F32 => words.into_iter().map(f32::from_bits).collect(),
                DType::I32 => words.into_iter().map(|v| v as i32 as f32).collect(),
            })
        }

        fn reset(&mut self) -> Result<(), BackendError> {
            self.flush()?;
            for (d, b) in self.program.buffers().iter().zip(&self.bufs) {
                let init = match d.kind {
                    BufKind::State { init } => init,
                    BufKind::Scratch => 0.0,
                };
                let word = match d.dtype {
                    DType::F32 => init.to_bits(),
                    DType::I32 => init as i32 as u32,
                };
                self.queue.write_buffer(b, 0, bytemuck::cast_slice(&vec![word; d.len.max(1)]));
            }
            // The writes run at a submit: done before the call returns, not inside the next step.
            self.submit([]);
            self.wait()
        }

        fn attach_chunk(&mut self, chunk: Arc<Program>) -> Result<(), BackendError> {
            self.chunk = Some(self.make_chunk(chunk)?);
            Ok(())
        }

        fn step_chunk(&mut self, params: &StepParams, tokens: &[u32]) -> Result<(), BackendError> {
            self.flush()?;
            self.run_chunk(params, tokens)
        }

        fn read_chunk_logits(&mut self, out: &mut Vec<f32>) -> Result<(), BackendError> {
            self.flush()?;
            let chunk = self.chunk.as_ref().ok_or_else(|| err("no chunk program is attached"))?;
            let lb = chunk.program.logits().0 as usize;
            let (buf, st) = (chunk.bufs[lb].as_ref().ok_or_else(|| err("the logits are state"))?, chunk.stride[lb]);
            let n_vocab = chunk.program.n_vocab();
            let count = chunk.count as usize;
            let raw = self.read_raw(buf, count as u64 * st)?;
            out.clear();
            for r in 0..count {
                let row = &raw[r * st as usize..r * st as usize + n_vocab * 4];
                out.extend(row.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
            }
            Ok(())
        }

        fn nodes_per_token(&self) -> Option<usize> {
            Some(self.dispatches.len())
        }

        fn take_warnings(&mut self) -> Vec<String> {
            if let Some(h) = &self.host_times {
                let times = h.replace(HostTimes::default());
                if times.tokens > 0 || times.reads > 0 {
                    self.warnings.push(times.report());
                }
            }
            std::mem::take(&mut self.warnings)
        }
    }

    #[cfg(test)]
    mod tests {
        use wgpu::util::DeviceExt;

        /// Runs `entry` of `body` (appended to the common code) over `data` in place, one
        /// invocation per element, on the default adapter.
        fn run_test_shader(body: &str, entry: &str, data: &mut [f32]) {
            let be = super::WgpuBackend::new(None, super::super::Tuning::default())
                .unwrap_or_else(|e| panic!("this test needs a wgpu adapter (lavapipe in CI): {e}"));
            let src = format!(
                "{}{}\n{}\n{body}",
                super::super::wgsl_constants(),
                include_str!("../../shaders/common.wgsl"),
                include_str!("../../shaders/lanes_shared.wgsl")
            );
            let d = &be.device;
            let sm = d.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: None,
                source: wgpu::ShaderSource::Wgsl(src.into()),
            });
            let pl = d.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: None,
                layout: None,
                module: &sm,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            });
            let uniform = |bytes: &[u8]| {
                d.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: None,
                    contents: bytes,
                    usage: wgpu::BufferUsages::UNIFORM,
                })
            };
            let (params, args) = (uniform(&[0u8; 16]), uniform(&[0u8; 128]));
            let t = d.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            });
            let bg = d.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pl.get_bind_group_layout(0),
                entries: &[
                    wgpu::BindGroupEntry { binding: 0, resource: params.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 1, resource: args.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 2, resource: t.as_entire_binding() },
                ],
            });
            let mut enc = d.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                pass.set_pipeline(&pl);
                pass.set_bind_group(0, &bg, &[]);
                pass.dispatch_workgroups((data.len() as u32).div_ceil(64), 1, 1);
            }
            be.queue.submit([enc.finish()]);
            let staging = d.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: 4 * data.len() as u64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut enc = d.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&t, 0, &staging, 0, 4 * data.len() as u64);
            be.queue.submit([enc.finish()]);
            staging.map_async(wgpu::MapMode::Read, .., |r| r.unwrap());
            d.poll(wgpu::PollType::wait_indefinitely()).unwrap();
            data.copy_from_slice(bytemuck::cast_slice(&staging.get_mapped_range(..).unwrap()));
            assert!(be.errors.lock().unwrap().is_empty(), "{:?}", be.errors.lock().unwrap());
        }

        /// `fdiv` and `sqrt_rn` give IEEE's correctly rounded results (what the CPU computes),
        /// whatever the driver's `/` and `sqrt` give; and the correction behind them turns a guess
        /// up to 3 ulp off (the CPU's result moved by -3..=3 ulp on purpose) into the IEEE result.
        #[test]
        fn division_and_square_root_are_corrected_to_ieee() {
            let body = "
@group(0) @binding(2) var<storage, read_write> T: array<f32>;
fn moved(x: f32, k: i32) -> f32 {
    return bitcast<f32>(u32(i32(bitcast<u32>(x)) + k));
}
// Per case: a, b, a/b and sqrt(a) as the CPU computes them, then two free slots.
@compute @workgroup_size(64)
fn check(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (!guard()) {
        return;
    }
    let i = 6u * gid.x;
    if (i + 5u >= arrayLength(&T)) {
        return;
    }
    let k = i32(gid.x % 7u) - 3;
    let a = T[i];
    let b = T[i + 1u];
    T[i + 4u] = fdiv(a, b);
    T[i + 5u] = sqrt_rn(a);
    T[i + 2u] = div_rn(a, b, moved(T[i + 2u], k));
    T[i + 3u] = sqrt_fix(a, moved(T[i + 3u], k));
}
";
            let n = 20000usize;
            let mut next = super::super::xorshift64(0x2545_f491_4f6c_dd1d);
            // Magnitudes from 2^-15 to 2^15, both signs for b; a > 0 for the square root.
            let mag = |r: u64| f32::from_bits((((r % 30) as u32 + 112) << 23) | (r >> 40) as u32 & 0x7f_ffff);
            let mut data = vec![0f32; 6 * n];
            for c in data.chunks_exact_mut(6) {
                let (a, b) = (mag(next()), if next().is_multiple_of(2) { mag(next()) } else { -mag(next()) });
                c.copy_from_slice(&[a, b, a / b, a.sqrt(), 0.0, 0.0]);
            }
            let want: Vec<(f32, f32)> = data.chunks_exact(6).map(|c| (c[2], c[3])).collect();
            run_test_shader(body, "check", &mut data);
            for (i, (c, &(q, s))) in data.chunks_exact(6).zip(&want).enumerate() {
                let (a, b, k) = (c[0], c[1], i % 7);
                assert_eq!(c[4].to_bits(), q.to_bits(), "fdiv({a:e}, {b:e})");
                assert_eq!(c[5].to_bits(), s.to_bits(), "sqrt_rn({a:e})");
                assert_eq!(c[2].to_bits(), q.to_bits(), "{a:e} / {b:e} from a guess moved {k} - 3 ulp");
                assert_eq!(c[3].to_bits(), s.to_bits(), "sqrt {a:e} from a guess moved {k} - 3 ulp");
            }
        }

        /// The device sampler's IEEE operations from integers (shaders/softfloat.wgsl) give the
        /// CPU's bits for any operands: subnormals, zeros of both signs, infinities, NaN (whose
        /// payload is not compared), overflow, underflow and the rounding to a subnormal.
        #[test]
        fn softfloat_division_product_and_difference_are_the_cpus() {
            let body = format!(
                "{}
@group(0) @binding(2) var<storage, read_write> T: array<u32>;
@compute @workgroup_size(64)
fn check(@builtin(global_invocation_id) gid: vec3<u32>) {{
    if (!guard()) {{
        return;
    }}
    let i = 5u * gid.x;
    if (i + 4u >= arrayLength(&T)) {{
        return;
    }}
    let a = T[i];
    let b = T[i + 1u];
    T[i + 2u] = sf_div(a, b);
    T[i + 3u] = sf_mul(a, b);
    T[i + 4u] = sf_sub(a, b);
}}
",
                include_str!("../../shaders/softfloat.wgsl")
            );
            let mut words = super::super::xorshift64(0x9e37_79b9_7f4a_7c15);
            let mut next = || (words() >> 16) as u32;
            let special = [0u32, 0x8000_0000, 1, 0x8000_0001, 0x007f_ffff, 0x0080_0000, 0x3f80_0000, 0x7f7f_ffff];
            let special2 = [0x7f80_0000u32, 0xff80_0000, 0x7fc0_0000, 0x0d80_0000, 0x0d7f_ffff, 0x3400_0000];
            let operand = |next: &mut dyn FnMut() -> u32| -> u32 {
                let r = next();
                let sign = r & 0x8000_0000;
                let m = next() & 0x7f_ffff;
                match r % 8 {
                    // Any magnitude.
                    0 => r,
                    // Subnormal.
                    1 => sign | m,
                    // Below 2^-100 (sf_sub's scaled path) or near the bottom of the normals.
                    2 => sign | ((next() % 28) << 23) | m,
                    // Near 1, where products and quotients of the extremes meet.
                    3 => sign | ((110 + next() % 36) << 23) | m,
                    // Large: overflow.
                    4 => sign | ((200 + next() % 55) << 23) | m,
                    5 => special[next() as usize % special.len()] | sign,
                    6 => special2[next() as usize % special2.len()] | sign,
                    _ => sign | ((1 + next() % 60) << 23) | m,
                }
            };
            let n = 60000usize;
            let mut data = vec![0f32; 5 * n];
            let mut cases = Vec::with_capacity(n);
            for c in data.chunks_exact_mut(5) {
                let (a, b) = (operand(&mut next), operand(&mut next));
                c[0] = f32::from_bits(a);
                c[1] = f32::from_bits(b);
                cases.push((a, b));
            }
            run_test_shader(&body, "check", &mut data);
            let same = |got: f32, want: f32| got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            for (c, &(a, b)) in data.chunks_exact(5).zip(&cases) {
                let (x, y) = (f32::from_bits(a), f32::from_bits(b));
                assert!(
                    same(c[2], x / y),
                    "sf_div({a:#010x}, {b:#010x}) = {:#010x}, want {:#010x}",
                    c[2].to_bits(),
                    (x / y).to_bits()
                );
                assert!(
                    same(c[3], x * y),
                    "sf_mul({a:#010x}, {b:#010x}) = {:#010x}, want {:#010x}",
                    c[3].to_bits(),
                    (x * y).to_bits()
                );
                assert!(
                    same(c[4], x - y),
                    "sf_sub({a:#010x}, {b:#010x}) = {:#010x}, want {:#010x}",
                    c[4].to_bits(),
                    (x - y).to_bits()
                );
            }
        }

        /// Every shader file parses and validates with naga, and every entry point the plans
        /// name exists in the file `shader_of` gives.
        #[test]
        fn every_shader_validates_with_naga() {
            use super::super::{Exactness, ShaderBuild};
            for file in super::super::SHADER_FILES {
                for (subgroups, fused_fma) in [(false, false), (true, false), (true, true)] {
                    let build = ShaderBuild { subgroups, exactness: Exactness::OpaqueIdentity, fused_fma };
                    let (m, _) = super::validate(file, build)
                        .unwrap_or_else(|e| panic!("shaders/{file}.wgsl ({build:?}):\n{e}"));
                    assert!(!m.entry_points.is_empty(), "{file}");
                    for ep in &m.entry_points {
                        assert_eq!(super::plan::shader_of(&ep.name), Some(file), "entry {}", ep.name);
                    }
                }
            }
        }

        /// The instructions of a SPIR-V module: (opcode, operand words).
        fn spirv_instructions(words: &[u32]) -> Vec<(u32, &[u32])> {
            let mut out = Vec::new();
            let mut at = 5;
            while at < words.len() {
                let n = (words[at] >> 16) as usize;
                assert!(n > 0 && at + n <= words.len(), "malformed instruction at word {at}");
                out.push((words[at] & 0xffff, &words[at + 1..at + n]));
                at += n;
            }
            out
        }

        /// The NoContraction build: the opaque identity is gone from the source, every entry
        /// point of every file compiles to SPIR-V, and afterwards each float operation's result
        /// carries exactly one NoContraction decoration, placed among the annotations (before
        /// the first type), with the instruction stream still well formed.
        #[test]
        fn every_entry_point_compiles_to_spirv_with_every_float_operation_no_contraction() {
            use super::super::{no_contraction, shader_source, Exactness, ShaderBuild, OPAQUE_BODY, SHADER_FILES};
            let common = include_str!("../../shaders/common.wgsl");
            assert_eq!(common.matches(OPAQUE_BODY).count(), 1, "common.wgsl's opaque identity");
            for file in SHADER_FILES {
                for (subgroups, fused_fma) in [(false, false), (true, true)] {
                    let build = ShaderBuild { subgroups, exactness: Exactness::NoContraction, fused_fma };
                    let src = shader_source(file, build).unwrap();
                    assert!(!src.contains(OPAQUE_BODY), "{file}");
                    let (m, info) = super::validate(file, build)
                        .unwrap_or_else(|e| panic!("shaders/{file}.wgsl ({build:?}):\n{e}"));
                    for ep in &m.entry_points {
                        let used = super::used_bindings(&m, &info, &ep.name).unwrap();
                        let mut w = super::spirv_words(&m, &info, &ep.name, &used)
                            .unwrap_or_else(|e| panic!("{file}/{}: {e}", ep.name));
                        let before = w.len();
                        let n = no_contraction(&mut w).unwrap();
                        assert_eq!(w.len(), before + 3 * n, "{}", ep.name);
                        let ins = spirv_instructions(&w);
                        let floats: Vec<u32> = ins
                            .iter()
                            .filter(|(op, _)| super::super::FLOAT_ARITHMETIC.contains(op))
                            .map(|(_, a)| a[1])
                            .collect();
                        assert_eq!(floats.len(), n, "{}", ep.name);
                        let decorated: Vec<u32> =
                            ins.iter().filter(|(op, a)| *op == 71 && a[1] == 42).map(|(_, a)| a[0]).collect();
                        let mut want = floats.clone();
                        let mut got = decorated.clone();
                        want.sort_unstable();
                        got.sort_unstable();
                        assert_eq!(got, want, "{}: the decorated results", ep.name);
                        let first_type = ins.iter().position(|(op, _)| (19..=39).contains(op)).unwrap();
                        let last_decoration = ins.iter().rposition(|(op, _)| *op == 71).unwrap_or(0);
                        assert!(last_decoration < first_type, "{}: a decoration after the types", ep.name);
                    }
                }
            }
        }

        #[test]
        fn no_contraction_refuses_what_is_not_spirv() {
            use super::super::no_contraction;
            assert!(no_contraction(&mut vec![1, 2, 3]).is_err());
            assert!(no_contraction(&mut vec![0x0723_0203, 0x10600, 0, 10, 0, (9 << 16) | 17]).is_err());
            assert!(no_contraction(&mut vec![0x0723_0203, 0x10600, 0, 10, 0, (2 << 16) | 17, 1]).is_err());
        }

        /// The fma build swaps exactly the residual's body: common.wgsl calls Dekker's once, and
        /// every file of the fma build calls residual_fma instead.
        #[test]
        fn the_fma_build_swaps_the_residual() {
            use super::super::{shader_source, Exactness, ShaderBuild, RESIDUAL_DEKKER, RESIDUAL_FMA, SHADER_FILES};
            let common = include_str!("../../shaders/common.wgsl");
            assert_eq!(common.matches(RESIDUAL_DEKKER).count(), 1);
            assert_eq!(common.matches(RESIDUAL_FMA).count(), 0);
            for file in SHADER_FILES {
                for fused_fma in [false, true] {
                    let build = ShaderBuild { subgroups: true, exactness: Exactness::NoContraction, fused_fma };
                    let src = shader_source(file, build).unwrap();
                    assert_eq!(src.contains(RESIDUAL_FMA), fused_fma, "{file}");
                    assert_eq!(src.contains(RESIDUAL_DEKKER), !fused_fma, "{file}");
                }
            }
        }

        /// The probe tells an fma that rounds once from one that rounds the product first: on
        /// most of its inputs the two differ, and one wrong bit or a missing output fails it.
        #[test]
        fn the_fma_probe_tells_a_fused_fma_from_a_split_one() {
            use super::super::{fma_probe_inputs, fma_rounds_once};
            let inputs = fma_probe_inputs();
            let fused: Vec<f32> = inputs.iter().map(|[a, b, c]| a.mul_add(*b, *c)).collect();
            let split: Vec<f32> = inputs.iter().map(|[a, b, c]| a * b + c).collect();
            assert!(fma_rounds_once(&inputs, &fused));
            assert!(!fma_rounds_once(&inputs, &split));
            let differ = fused.iter().zip(&split).filter(|(f, s)| f.to_bits() != s.to_bits()).count();
            assert!(differ >= 40, "only {differ} of {} inputs tell the two apart", inputs.len());
            for i in [0, 17, inputs.len() - 1] {
                let mut one_off = fused.clone();
                one_off[i] = f32::from_bits(one_off[i].to_bits() ^ 1);
                assert!(!fma_rounds_once(&inputs, &one_off), "output {i} one bit off");
            }
            assert!(!fma_rounds_once(&inputs, &fused[1..]));
        }

        /// What makes the fma build exact: for the operands fdiv and sqrt_rn give the residual
        /// (a quotient or root guess within 3 ulp, exponents in range), Dekker's residual as
        /// common.wgsl computes it (every operation rounded once, as Rust's f32 does) is a - x*y
        /// rounded once, which is what one fma gives. Bit for bit, over 200,000 cases.
        #[test]
        fn dekkers_residual_is_the_fma_residual() {
            fn split12(x: f32) -> (f32, f32) {
                let t = 4097.0 * x;
                let hi = t - (t - x);
                (hi, x - hi)
            }
            fn dekker(a: f32, x: f32, y: f32) -> f32 {
                let p = x * y;
                let (xh, xl) = split12(x);
                let (yh, yl) = split12(y);
                let e = (((xh * yh - p) + xh * yl) + xl * yh) + xl * yl;
                (a - p) - e
            }
            let moved = |x: f32, k: i32| f32::from_bits((x.to_bits() as i32 + k) as u32);
            let mut next = super::super::xorshift64(0x1234_5678_9abc_def1);
            // Magnitudes from 2^-30 to 2^30.
            let mag = |r: u64| f32::from_bits((((r % 60) as u32 + 97) << 23) | (r >> 40) as u32 & 0x7f_ffff);
            for i in 0..100_000i32 {
                let (a, b) = (mag(next()), if next().is_multiple_of(2) { mag(next()) } else { -mag(next()) });
                let k = i % 7 - 3;
                let q = moved(a / b, k);
                assert_eq!(dekker(a, q, b).to_bits(), (-q).mul_add(b, a).to_bits(), "{a:e} / {b:e}, {k} ulp");
                let s = moved(a.sqrt(), k);
                assert_eq!(dekker(a, s, s).to_bits(), (-s).mul_add(s, a).to_bits(), "sqrt {a:e}, {k} ulp");
            }
        }
    }
}
