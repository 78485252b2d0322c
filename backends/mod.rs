//! The backends. Each implements every `Op` in one place with an exhaustive match.

pub mod cpu;
pub mod cuda;
pub mod gpu_tables;
pub mod wgpu;
