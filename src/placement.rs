//! Where a token program's weights go for a device memory budget: everything in device memory,
//! or the dense weights, KV state and buffers there with the routed experts in host memory and
//! the rest of the budget as an expert cache, or (unified memory, as on the GB10) everything in
//! page-locked host memory that the GPU reads in place. A pure function of the program's sizes
//! and the budget, so it can be planned (and tested) without a GPU; the CUDA backend follows it
//! (backends/cuda/mod.rs) and `ds4 inspect --vram-budget` prints it.

use crate::recorder::Program;

/// Bytes of one program, by where they may live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Weights every token reads: attention, shared experts, HC, embeddings, LM head, routers.
    pub dense: u64,
    /// Routed expert tensors (`*_exps`), all of them.
    pub experts: u64,
    /// KV caches, compressor and indexer state, scratch: the program's buffers.
    pub buffers: u64,
    /// Expert bytes a token reads: `n_used / n_expert` of the expert tensors.
    pub experts_per_token: u64,
}

impl Footprint {
    /// The footprint of `program`, whose layers route `n_used` of `n_expert` experts per token.
    /// Whether a tensor is a routed-expert tensor (what may live in host memory).
    pub fn is_expert(name: &str) -> bool {
        name.contains("_exps")
    }

    pub fn of(program: &Program, n_used: usize, n_expert: usize) -> Footprint {
        let is_expert = Footprint::is_expert;
        let (mut dense, mut experts) = (0u64, 0u64);
        for t in program.weights() {
            if is_expert(&t.name) {
                experts += t.bytes;
            } else {
                dense += t.bytes;
            }
        }
        let buffers = program.buffers().iter().map(|b| b.len as u64 * 4).sum();
        let experts_per_token = experts * n_used as u64 / n_expert.max(1) as u64;
        Footprint { dense, experts, buffers, experts_per_token }
    }

    /// What must be in device memory whatever the plan.
    pub fn resident(&self) -> u64 {
        self.dense + self.buffers
    }
}

/// Where the weights are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Every weight in device memory.
    Device,
    /// Routed experts in page-locked host memory; `cache` bytes of device memory hold the
    /// experts used most recently.
    HostExperts { cache: u64 },
    /// Every weight read by the GPU in place from page-locked host memory: a model file's own
    /// pages, registered, in GGUF's block layout (no copy). On a unified-memory GPU (the GB10)
    /// the weights occupy memory once; on a discrete GPU every byte crosses the bus.
    Unified,
}

/// A placement the user forces (`--placement`), instead of the one the budget gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementMode {
    Device,
    Host,
    Unified,
}

impl std::str::FromStr for PlacementMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "device" => Ok(PlacementMode::Device),
            "host" => Ok(PlacementMode::Host),
            "unified" => Ok(PlacementMode::Unified),
            other => Err(format!("unknown placement '{other}' (expected device, host or unified)")),
        }
    }
}

/// What the user asked for: a budget (default: the device's free memory) and a forced placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlacementRequest {
    pub budget: Option<u64>,
    pub mode: Option<PlacementMode>,
    /// At most this many expert cache slots per MoE layer (0: read every expert from host
    /// memory in place), for tests and for measuring the hit rate against the cache's size.
    pub cache_slots: Option<usize>,
}

impl PlacementRequest {
    pub fn is_default(&self) -> bool {
        *self == PlacementRequest::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacementPlan {
    pub footprint: Footprint,
    pub budget: u64,
    pub placement: Placement,
}

/// Why no plan exists for a budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error(
        "the model cannot run in {budget}: its dense weights ({dense}) and KV state and buffers ({buffers}) alone \
         need {need} of device memory",
        budget = gb(*budget), dense = gb(*dense), buffers = gb(*buffers), need = gb(dense + buffers)
    )]
    TooLarge { dense: u64, buffers: u64, budget: u64 },
    #[error(
        "--placement device needs {need} of device memory (dense weights {dense}, routed experts {experts}, \
         KV state and buffers {buffers}) but the budget is {budget}",
        need = gb(dense + experts + buffers), dense = gb(*dense), experts = gb(*experts),
        buffers = gb(*buffers), budget = gb(*budget)
    )]
    DeviceTooSmall { dense: u64, experts: u64, buffers: u64, budget: u64 },
    #[error(
        "the model's KV state and buffers ({buffers}) alone exceed the budget of {budget}",
        buffers = gb(*buffers), budget = gb(*budget)
    )]
    BuffersTooLarge { buffers: u64, budget: u64 },
}

/// The plan for `budget` bytes of device memory: everything there when it fits, else the routed
/// experts in host memory with what is left as their cache.
pub fn plan(footprint: &Footprint, budget: u64) -> Result<PlacementPlan, PlacementError> {
    let resident = footprint.resident();
    if resident > budget {
        return Err(PlacementError::TooLarge { dense: footprint.dense, buffers: footprint.buffers, budget });
    }
    let placement = if resident + footprint.experts <= budget {
        Placement::Device
    } else {
        Placement::HostExperts { cache: budget - resident }
    };
    Ok(PlacementPlan { footprint: *footprint, budget, placement })
}

/// The plan for `budget`, or for the placement `mode` forces within it.
pub fn plan_for(
    footprint: &Footprint,
    budget: u64,
    mode: Option<PlacementMode>,
) -> Result<PlacementPlan, PlacementError> {
    let f = footprint;
    let placement = match mode {
        None => return plan(f, budget),
        Some(PlacementMode::Device) => {
            if f.resident() + f.experts > budget {
                return Err(PlacementError::DeviceTooSmall {
                    dense: f.dense,
                    experts: f.experts,
                    buffers: f.buffers,
                    budget,
                });
            }
            Placement::Device
        }
        Some(PlacementMode::Host) => {
            if f.resident() > budget {
                return Err(PlacementError::TooLarge { dense: f.dense, buffers: f.buffers, budget });
            }
            Placement::HostExperts { cache: (budget - f.resident()).min(f.experts) }
        }
        Some(PlacementMode::Unified) => {
            if f.buffers > budget {
                return Err(PlacementError::BuffersTooLarge { buffers: f.buffers, budget });
            }
            Placement::Unified
        }
    };
    Ok(PlacementPlan { footprint: *f, budget, placement })
}

impl PlacementPlan {
    /// Expert bytes a token reads over the bus when no used expert is in the cache.
    pub fn bus_bytes_per_token_max(&self) -> u64 {
        match self.placement {
            Placement::Device => 0,
            Placement::HostExperts { .. } => self.footprint.experts_per_token,
            Placement::Unified => self.footprint.dense + self.footprint.experts_per_token,
        }
    }

    /// The plan as a short table, one line per place.
    pub fn table(&self) -> String {
        let f = &self.footprint;
        let mut s = format!("placement for a budget of {}:\n", gb(self.budget));
        match self.placement {
            Placement::Device => {
                s += &format!(
                    "  device  everything: dense weights {}, routed experts {}, KV state and buffers {} ({} free)\n",
                    gb(f.dense),
                    gb(f.experts),
                    gb(f.buffers),
                    gb(self.budget - f.resident() - f.experts)
                );
                s += "  bus     nothing per token\n";
            }
            Placement::HostExperts { cache } => {
                s += &format!(
                    "  device  dense weights {}, KV state and buffers {}, expert cache {} ({:.0}% of the experts)\n",
                    gb(f.dense),
                    gb(f.buffers),
                    gb(cache),
                    100.0 * cache as f64 / f.experts.max(1) as f64
                );
                s += &format!("  host    routed experts {} (page-locked, read on a cache miss)\n", gb(f.experts));
                s += &format!(
                    "  bus     at most {} per token (every used expert missing the cache)\n",
                    gb(self.bus_bytes_per_token_max())
                );
            }
            Placement::Unified => {
                s += &format!("  device  KV state and buffers {}\n", gb(f.buffers));
                s += &format!(
                    "  host    every weight: dense {}, routed experts {} (page-locked, read in place)\n",
                    gb(f.dense),
                    gb(f.experts)
                );
                s += &format!(
                    "  bus     {} per token on a discrete GPU (none where memory is unified)\n",
                    gb(self.bus_bytes_per_token_max())
                );
            }
        }
        s
    }
}

/// Bytes in the binary units budgets are given in: GiB, or MiB below one GiB.
pub fn gb(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// Parses a memory size: a number with an optional unit K, M, G or T (binary: 1K = 1024 bytes;
/// `GB` and `GiB` mean the same), e.g. `22G`, `1.5T`, `512MiB`, `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(format!("'{s}' is not a size: the unit must be K, M, G or T (e.g. 22G)")),
    };
    let value: f64 = num.trim().parse().map_err(|_| format!("'{s}' is not a size (e.g. 22G, 512M, 4096)"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
        return Err(format!("'{s}' is not a size between 1 byte and 16 EiB"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{record_token, Caps};
    use crate::synth::{self, Preset};

    fn flash() -> Footprint {
        let model = synth::device_model(&Preset::flash(), 1).unwrap();
        let program = record_token(&model, Caps { ctx: 2048 }).unwrap();
        Footprint::of(&program, model.config.n_expert_used, model.config.n_expert)
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("22G"), Ok(22 << 30));
        assert_eq!(parse_size("22GiB"), Ok(22 << 30));
        assert_eq!(parse_size("512mb"), Ok(512 << 20));
        assert_eq!(parse_size("1.5T"), Ok(3 << 39));
        for bad in ["", "G", "22X", "-1G", "0", "nanG", "1e30T"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    /// On the Flash shape: the routed experts are most of the model (the issue: about 81 GB with
    /// q2 experts, 8 GB not routed), a token reads 6 of 256 of them.
    #[test]
    fn flash_footprint_matches_the_shape() {
        let f = flash();
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let (dense, experts) = (gib(f.dense), gib(f.experts));
        assert!((6.0..10.0).contains(&dense), "dense {dense} GiB");
        assert!((65.0..80.0).contains(&experts), "experts {experts} GiB");
        assert_eq!(f.experts_per_token, f.experts * 6 / 256);
    }

    #[test]
    fn a_budget_gives_device_host_or_a_clear_refusal() {
        let f = flash();
        let all = f.resident() + f.experts;
        let p = plan(&f, all).unwrap();
        assert_eq!(p.placement, Placement::Device);
        assert_eq!(p.bus_bytes_per_token_max(), 0);
        // A 24 GB card's 22 GiB: experts in host memory, the rest of the budget caches them.
        let p = plan(&f, 22 << 30).unwrap();
        match p.placement {
            Placement::HostExperts { cache } => assert_eq!(f.resident() + cache, 22 << 30),
            other => panic!("{other:?}"),
        }
        assert_eq!(p.bus_bytes_per_token_max(), f.experts_per_token);
        assert!(p.table().contains("expert cache"), "{}", p.table());
        assert_eq!(plan(&f, all - 1).unwrap().placement, Placement::HostExperts { cache: f.experts - 1 });
        // Less than the dense part: refused, naming the sizes and the budget.
        // Forced placements within a budget.
        assert_eq!(
            plan_for(&f, all, Some(PlacementMode::Host)).unwrap().placement,
            Placement::HostExperts { cache: f.experts }
        );
        assert_eq!(plan_for(&f, f.buffers, Some(PlacementMode::Unified)).unwrap().placement, Placement::Unified);
        let e = plan_for(&f, 22 << 30, Some(PlacementMode::Device)).unwrap_err().to_string();
        assert!(e.contains("--placement device") && e.contains(&gb(22 << 30)), "{e}");
        assert!(plan_for(&f, f.buffers - 1, Some(PlacementMode::Unified)).is_err());
        let e = plan(&f, f.resident() - 1).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("cannot run") && msg.contains(&gb(f.dense)) && msg.contains(&gb(f.resident() - 1)),
            "{msg}"
        );
    }
}
