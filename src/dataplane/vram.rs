//! The device (VRAM) arena: one plain device allocation (`cuMemAlloc`, not
//! managed memory), registered once with the inner UCX agent like
//! [`super::HostArena`].
//!
//! Fabric memory (MNNVL, `cuMemCreate` with a fabric handle) is optional in
//! issue 5 and not implemented: plain device memory is the default and the
//! only allocation; `disable_fabric_memory` therefore changes nothing yet.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};
use nixl_sys::{MemType, MemoryRegion, NixlDescriptor};

use crate::copy::cuda::CudaDevice;
use crate::copy::RegionSpan;

/// `len` bytes of device memory on device `ordinal`, freed on drop.
#[derive(Debug)]
pub struct DeviceArena {
    ptr: sys::CUdeviceptr,
    len: usize,
    ordinal: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceArena {
    /// Allocates the arena on `device`. Also sets `SYNC_MEMOPS` on the
    /// allocation (as GPUDirect RDMA users should), best effort.
    pub fn new(device: &CudaDevice, len: usize) -> Result<Self, String> {
        if len == 0 {
            return Err("device arena size is zero".into());
        }
        device.bind()?;
        // SAFETY: a plain device allocation of len bytes; checked.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(|e| {
            format!(
                "cuMemAlloc of a {len}-byte arena on CUDA device {}: {e}",
                device.ordinal()
            )
        })?;
        let one: u32 = 1;
        // SAFETY: sets an attribute of the allocation just made; `one`
        // outlives the call.
        let sync = unsafe {
            sys::cuPointerSetAttribute(
                &one as *const u32 as *const std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                ptr,
            )
        }
        .result();
        if let Err(e) = sync {
            tracing::warn!("setting SYNC_MEMOPS on the device arena failed (continuing): {e}");
        }
        Ok(DeviceArena {
            ptr,
            len,
            ordinal: device.ordinal(),
            ctx: device.context().clone(),
        })
    }

    /// Device address of the first byte.
    pub fn base(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The region `[offset, offset + len)` as a copy-engine span, if inside.
    pub fn span(&self, offset: usize, len: usize) -> Option<RegionSpan> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| RegionSpan {
            addr: self.ptr as usize + offset,
            len,
        })
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(format!(
                "{len} bytes at offset {offset} leave the {}-byte device arena",
                self.len
            )),
        }
    }

    /// Copies `data` to `offset` (synchronous; for set-up, tests and tools).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), String> {
        self.check(offset, data.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e}"))?;
        // SAFETY: the destination range lies inside this allocation (checked).
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, data) }
            .map_err(|e| format!("cuMemcpyHtoD into the device arena: {e}"))
    }

    /// Copies `out.len()` bytes from `offset` (synchronous).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), String> {
        self.check(offset, out.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e}"))?;
        // SAFETY: the source range lies inside this allocation (checked).
        unsafe { result::memcpy_dtoh_sync(out, self.ptr + offset as u64) }
            .map_err(|e| format!("cuMemcpyDtoH from the device arena: {e}"))
    }

    /// Sets every byte to `byte` (synchronous).
    pub fn fill(&self, byte: u8) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e}"))?;
        // SAFETY: exactly this allocation.
        unsafe { result::memset_d8_sync(self.ptr, byte, self.len) }
            .map_err(|e| format!("cuMemsetD8 on the device arena: {e}"))?;
        // cuMemsetD8 may return before the memory is set when the target is
        // device memory; make it visible to the caller's next step.
        self.ctx
            .synchronize()
            .map_err(|e| format!("cuCtxSynchronize after cuMemsetD8: {e}"))
    }
}

impl Drop for DeviceArena {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: ptr came from cuMemAlloc and is freed once; the owner
        // guarantees no copy or transfer still uses it (the engine drains
        // its copies and deregisters the arena first).
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!("cuMemFree of the device arena: {e}");
        }
    }
}

impl MemoryRegion for DeviceArena {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.ptr as usize as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for DeviceArena {
    fn mem_type(&self) -> MemType {
        MemType::Vram
    }
    fn device_id(&self) -> u64 {
        self.ordinal as u64
    }
}

impl super::Arena for DeviceArena {
    fn base(&self) -> usize {
        DeviceArena::base(self) as usize
    }
    fn len(&self) -> usize {
        DeviceArena::len(self)
    }
}
