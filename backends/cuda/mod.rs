//! The CUDA backend (NVRTC kernels, one captured graph per token). Its kernels are not written
//! yet: asking for it is an error that says so, rather than a silent fallback.

use crate::backend::{Backend, BackendError, BackendOptions};

#[cfg(feature = "cuda")]
pub fn create(_opts: BackendOptions) -> Result<Box<dyn Backend>, BackendError> {
    Err(BackendError::new("cuda", "its CUDA kernels are not implemented yet in this version of ds4"))
}

#[cfg(not(feature = "cuda"))]
pub fn create(_opts: BackendOptions) -> Result<Box<dyn Backend>, BackendError> {
    Err(BackendError::new("cuda", "ds4 was built without the `cuda` feature"))
}
