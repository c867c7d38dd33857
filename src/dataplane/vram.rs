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

use crate::copy::cuda::{CudaDevice, CudaError};
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
    pub fn new(device: &CudaDevice, len: usize) -> Result<Self, CudaError> {
        if len == 0 {
            return Err(CudaError::Invalid("device arena size is zero".into()));
        }
        device.bind()?;
        // SAFETY: a plain device allocation of len bytes; checked.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(|e| {
            CudaError::call(
                format!(
                    "cuMemAlloc of a {len}-byte arena on CUDA device {}",
                    device.ordinal()
                ),
                e,
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

    fn check(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::Invalid(format!(
                "{len} bytes at offset {offset} leave the {}-byte device arena",
                self.len
            ))),
        }
    }

    /// Copies `data` to `offset` (synchronous; for set-up, tests and tools).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        self.check(offset, data.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::call("binding the CUDA context", e))?;
        // SAFETY: the destination range lies inside this allocation (checked).
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, data) }
            .map_err(|e| CudaError::call("cuMemcpyHtoD into the device arena", e))?;
        // From pageable memory cuMemcpyHtoD may return before its DMA ends,
        // and the copies that read the arena next run on other streams:
        // finish it here, as `fill` does.
        self.ctx
            .synchronize()
            .map_err(|e| CudaError::call("cuCtxSynchronize after cuMemcpyHtoD", e))
    }

    /// Copies `out.len()` bytes from `offset` (synchronous).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        self.check(offset, out.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::call("binding the CUDA context", e))?;
        // SAFETY: the source range lies inside this allocation (checked).
        unsafe { result::memcpy_dtoh_sync(out, self.ptr + offset as u64) }
            .map_err(|e| CudaError::call("cuMemcpyDtoH from the device arena", e))
    }

    /// Sets every byte to `byte` (synchronous).
    pub fn fill(&self, byte: u8) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::call("binding the CUDA context", e))?;
        // SAFETY: exactly this allocation.
        unsafe { result::memset_d8_sync(self.ptr, byte, self.len) }
            .map_err(|e| CudaError::call("cuMemsetD8 on the device arena", e))?;
        // cuMemsetD8 may return before the memory is set when the target is
        // device memory; make it visible to the caller's next step.
        self.ctx
            .synchronize()
            .map_err(|e| CudaError::call("cuCtxSynchronize after cuMemsetD8", e))
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

/// Host memory pinned and mapped for one GPU: the arena of a host-staged
/// instance (docs/design.md §3, "Mixed memory"). The GPU's gather and
/// scatter kernels read and write it across PCIe at the same address the
/// host uses (unified addressing), while the inner agent registers it as
/// DRAM, so a chunk write between it and a peer's DRAM arena is a host to
/// host write (shared memory on one host, RDMA across hosts), not UCX's
/// staged device-to-host path.
#[derive(Debug)]
pub struct PinnedArena {
    host: super::HostArena,
    ctx: Arc<CudaContext>,
}

impl PinnedArena {
    /// Allocates `len` bytes of host memory and pins them for `device`.
    /// Refused where the device would address them at another address than
    /// the host does (the kernels and the chunk writes share one address).
    pub fn new(device: &CudaDevice, len: usize) -> Result<Self, CudaError> {
        let host = super::HostArena::new(len).map_err(|e| {
            CudaError::call(format!("allocating the {len}-byte host-staged arena"), e)
        })?;
        device.bind()?;
        let ptr = host.base() as *mut std::ffi::c_void;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: pins exactly the mapping `host` owns, which outlives the
        // registration (Drop unregisters before `host` unmaps it).
        unsafe { sys::cuMemHostRegister_v2(ptr, len, flags) }
            .result()
            .map_err(|e| {
                CudaError::call(
                    format!(
                        "cuMemHostRegister of the {len}-byte host-staged arena for CUDA device {}",
                        device.ordinal()
                    ),
                    e,
                )
            })?;
        let arena = PinnedArena {
            host,
            ctx: device.context().clone(),
        };
        let mut dev_ptr: sys::CUdeviceptr = 0;
        // SAFETY: asks for the device address of memory registered just
        // above; writes one CUdeviceptr through a valid pointer.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_ptr, ptr, 0) }
            .result()
            .map_err(|e| {
                CudaError::call("cuMemHostGetDevicePointer of the host-staged arena", e)
            })?;
        if dev_ptr as usize != arena.host.base() {
            return Err(CudaError::Invalid(format!(
                "CUDA device {} addresses the host-staged arena at {dev_ptr:#x}, not at its host address {:#x}",
                device.ordinal(),
                arena.host.base()
            )));
        }
        Ok(arena)
    }
}

impl Drop for PinnedArena {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: unregisters the registration made in new(), once; the
        // owner guarantees no copy or transfer still uses it (as for the
        // device arena). `host` unmaps the memory after this.
        if let Err(e) =
            unsafe { sys::cuMemHostUnregister(self.host.base() as *mut std::ffi::c_void) }.result()
        {
            tracing::warn!("cuMemHostUnregister of the host-staged arena: {e}");
        }
    }
}

impl MemoryRegion for PinnedArena {
    unsafe fn as_ptr(&self) -> *const u8 {
        // SAFETY: forwards to the host arena under the same contract.
        unsafe { self.host.as_ptr() }
    }
    fn size(&self) -> usize {
        self.host.len()
    }
}

impl NixlDescriptor for PinnedArena {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

impl super::Arena for PinnedArena {
    fn base(&self) -> usize {
        self.host.base()
    }
    fn len(&self) -> usize {
        self.host.len()
    }
}
