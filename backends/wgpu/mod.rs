//! The wgpu backend (WGSL compute shaders). Its shaders are not written yet: asking for it is an
//! error that says so, rather than a silent fallback.

use crate::backend::{Backend, BackendError, BackendOptions};

#[cfg(feature = "wgpu")]
pub fn create(_opts: BackendOptions) -> Result<Box<dyn Backend>, BackendError> {
    Err(BackendError::new("wgpu", "its WGSL kernels are not implemented yet in this version of ds4"))
}

#[cfg(not(feature = "wgpu"))]
pub fn create(_opts: BackendOptions) -> Result<Box<dyn Backend>, BackendError> {
    Err(BackendError::new("wgpu", "ds4 was built without the `wgpu` feature"))
}
