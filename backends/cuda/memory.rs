//! Where the CUDA backend keeps weights: device memory, or page-locked host memory that the
//! kernels read through mapped pointers (placement "host" and "unified", src/placement.rs); and
//! the upload of host bytes into device memory through two pinned staging buffers, so that
//! preparing one chunk on the CPU overlaps the copy of the other.

use std::time::Instant;

use cudarc::driver::{result, sys, CudaEvent, CudaSlice, CudaStream, DevicePtr};

/// Page-locked host memory mapped into the device's address space.
pub struct HostMem {
    ptr: *mut u8,
    len: usize,
    dev: u64,
}

// SAFETY: the allocation is owned by this value alone and freed once, in Drop; moving it to
// another thread moves that ownership.
unsafe impl Send for HostMem {}

impl HostMem {
    pub fn alloc(len: usize) -> Result<HostMem, result::DriverError> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a plain allocation of `len.max(1)` bytes; freed in Drop.
        let ptr = unsafe { result::malloc_host(len.max(1), flags) }? as *mut u8;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` was just allocated with DEVICEMAP, so it has a device address.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr as *mut _, 0) }.result();
        let mem = HostMem { ptr, len, dev };
        mapped?;
        Ok(mem)
    }

    /// The address kernels read it at.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `len` bytes owned by self; the borrow of self keeps them unaliased.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host and not freed before.
        let _ = unsafe { result::free_host(self.ptr as *mut _) };
    }
}

/// Host memory owned by someone else (the model file's read-only mapping), registered with the
/// driver so kernels read it in place: its pages locked and mapped into the device's address
/// space. The owner must keep the bytes alive and unmoved until this is dropped.
pub struct HostRegistration {
    ptr: *mut u8,
    dev: u64,
}

// SAFETY: holds only addresses; unregistering from another thread is allowed by the driver.
unsafe impl Send for HostRegistration {}

impl HostRegistration {
    /// Registers `bytes`; `read_only` for pages mapped without write access (the driver must
    /// support it: CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED).
    pub fn register(bytes: &[u8], read_only: bool) -> Result<HostRegistration, result::DriverError> {
        let mut flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        if read_only {
            flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
        }
        let ptr = bytes.as_ptr() as *mut u8;
        // Whole 4 KiB pages: a mapping covers the last page of the file entirely.
        let len = bytes.len().div_ceil(4096) * 4096;
        // SAFETY: `ptr` addresses `len` bytes of one live mapping (the caller keeps it alive until
        // Drop); the driver only locks and maps those pages, it writes nothing with READ_ONLY.
        unsafe { sys::cuMemHostRegister_v2(ptr as *mut _, len, flags) }.result()?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` was just registered with DEVICEMAP, so it has a device address.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr as *mut _, 0) }.result();
        let reg = HostRegistration { ptr, dev };
        mapped?;
        Ok(reg)
    }

    /// The device address of host byte `bytes[offset]`.
    pub fn device_ptr(&self, offset: usize) -> u64 {
        self.dev + offset as u64
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // SAFETY: registered by `register` and not unregistered before.
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut _) };
    }
}

/// Reads one byte of every 4 KiB page of `bytes` on every core, so that a mapped file is in
/// memory before its pages are locked; `progress(done, total)` after each 64 MiB.
pub fn fault_in(bytes: &[u8], progress: impl Fn(u64) + Sync) {
    use rayon::prelude::*;
    const RUN: usize = 64 << 20;
    bytes.par_chunks(RUN).for_each(|run| {
        let mut x = 0u8;
        for i in (0..run.len()).step_by(4096) {
            x ^= run[i];
        }
        std::hint::black_box(x);
        progress(run.len() as u64);
    });
}

/// Where one weight lives.
pub enum WeightMem {
    Device(CudaSlice<u8>),
    Host(HostMem),
    /// Inside a registered mapping (the model file read in place): its device address.
    InPlace(u64),
}

impl WeightMem {
    pub fn ptr(&self, stream: &CudaStream) -> u64 {
        match self {
            WeightMem::Device(d) => d.device_ptr(stream).0,
            WeightMem::Host(h) => h.device_ptr(),
            WeightMem::InPlace(p) => *p,
        }
    }
}

/// Bytes per staging buffer.
const STAGE: usize = 64 << 20;

/// Copies host bytes into device memory through two pinned staging buffers, reporting progress.
pub struct Uploader {
    stages: Vec<(HostMem, CudaEvent)>,
    next: usize,
    done: u64,
    total: u64,
    progress: Option<fn(u64, u64)>,
    started: Instant,
    /// Bytes that went through the staging buffers (not those drawn on the device).
    copied: u64,
}

impl Uploader {
    pub fn new(stream: &CudaStream, total: u64, progress: Option<fn(u64, u64)>) -> Result<Self, result::DriverError> {
        let mut stages = Vec::new();
        for _ in 0..2 {
            let event = stream.context().new_event(None)?;
            event.record(stream)?;
            stages.push((HostMem::alloc(STAGE)?, event));
        }
        Ok(Uploader { stages, next: 0, done: 0, total, progress, started: Instant::now(), copied: 0 })
    }

    /// Counts `bytes` as done (weights made some other way).
    pub fn advance(&mut self, bytes: u64) {
        self.done += bytes;
        if let Some(p) = self.progress {
            p(self.done.min(self.total), self.total);
        }
    }

    /// Queues the copy of `src` to device address `dst` on `stream`. Returns when `src` may be
    /// dropped (its bytes are in a staging buffer or on the device).
    pub fn upload(&mut self, stream: &CudaStream, dst: u64, src: &[u8]) -> Result<(), result::DriverError> {
        for (i, chunk) in src.chunks(STAGE).enumerate() {
            let (mem, event) = &mut self.stages[self.next];
            // The copy that used this buffer last must have finished before it is refilled.
            event.synchronize()?;
            parallel_copy(&mut mem.as_mut_slice()[..chunk.len()], chunk);
            // SAFETY: `dst + i*STAGE` addresses `chunk.len()` bytes of the caller's device
            // allocation; the staging buffer stays untouched until `event` says the copy is done.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst + (i * STAGE) as u64,
                    mem.ptr as *const _,
                    chunk.len(),
                    stream.cu_stream(),
                )
            }
            .result()?;
            event.record(stream)?;
            self.next = (self.next + 1) % self.stages.len();
            self.copied += chunk.len() as u64;
            self.advance(chunk.len() as u64);
        }
        Ok(())
    }

    /// Waits for the last copies; returns (bytes copied through staging, seconds since start).
    pub fn finish(self, stream: &CudaStream) -> Result<(u64, f64), result::DriverError> {
        stream.synchronize()?;
        if let Some(p) = self.progress {
            p(self.total, self.total);
        }
        Ok((self.copied, self.started.elapsed().as_secs_f64()))
    }
}

/// `dst.copy_from_slice(src)` on every core (a single core copies a few GB/s at most).
pub fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    dst.par_chunks_mut(1 << 20).zip(src.par_chunks(1 << 20)).for_each(|(d, s)| d.copy_from_slice(s));
}
