//! The data plane: the arena, registered once with the inner UCX agent, and
//! one NIXL WRITE per chunk from a local region into a region of the peer's
//! arena.

pub mod vram;

use std::ptr::NonNull;

use nixl_sys::{
    Agent, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, XferDescList, XferOp,
    XferRequest, XferStatus,
};

/// Page-aligned host memory for the arena (anonymous mapping, released on drop).
#[derive(Debug)]
pub struct HostArena {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; which thread
// touches which byte is decided by the protocol (one owner per region).
unsafe impl Send for HostArena {}
// SAFETY: as above; &HostArena only hands out addresses.
unsafe impl Sync for HostArena {}

impl HostArena {
    pub fn new(len: usize) -> std::io::Result<Self> {
        if len == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "arena size is zero",
            ));
        }
        // SAFETY: an anonymous private mapping with no address hint; the
        // result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            ptr: NonNull::new(p as *mut u8).expect("mmap never returns NULL on success"),
            len,
        })
    }
    pub fn base(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostArena {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in new().
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

impl MemoryRegion for HostArena {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for HostArena {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// A bounce arena: registered memory the protocol carves into regions. Host
/// memory ([`HostArena`]) or device memory (the CUDA arena).
pub trait Arena: NixlDescriptor + Send + Sync + std::fmt::Debug {
    /// Address of the first byte (a device address for device memory).
    fn base(&self) -> usize;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Arena for HostArena {
    fn base(&self) -> usize {
        HostArena::base(self)
    }
    fn len(&self) -> usize {
        HostArena::len(self)
    }
}

/// Lends any arena (also behind `dyn`) to nixl-sys, which registers sized
/// descriptors only.
#[derive(Debug)]
struct ArenaRef<'a, A: Arena + ?Sized>(&'a A);

impl<A: Arena + ?Sized> MemoryRegion for ArenaRef<'_, A> {
    unsafe fn as_ptr(&self) -> *const u8 {
        // SAFETY: forwards to the arena's own as_ptr under the same contract.
        unsafe { self.0.as_ptr() }
    }
    fn size(&self) -> usize {
        self.0.size()
    }
}

impl<A: Arena + ?Sized> NixlDescriptor for ArenaRef<'_, A> {
    fn mem_type(&self) -> MemType {
        self.0.mem_type()
    }
    fn device_id(&self) -> u64 {
        self.0.device_id()
    }
}

/// Where a peer's arena lives, from its handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerArena {
    /// The peer's inner agent (the write target).
    pub inner_agent: String,
    pub base: u64,
    pub device: u64,
    pub mem: MemType,
}

/// Issues chunk writes through the inner agent.
#[derive(Debug)]
pub struct DataPlane {
    agent: Agent,
    arena_base: usize,
    arena_len: usize,
    arena_mem: MemType,
    arena_dev: u64,
    _registration: RegistrationHandle,
}

/// A chunk write in flight.
pub struct ChunkWrite {
    req: XferRequest,
}

impl std::fmt::Debug for ChunkWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChunkWrite")
    }
}

/// Where a chunk write stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteState {
    InProgress,
    /// Complete at the target (NIXL's UCX backend flushes before reporting success).
    Done,
    Failed(String),
}

impl DataPlane {
    /// Registers `arena` with the inner agent (once, for the engine's life).
    pub fn new<A: Arena + ?Sized>(agent: Agent, arena: &A) -> Result<Self, String> {
        let registration = agent.register_memory(&ArenaRef(arena), None).map_err(|e| {
            format!(
                "registering the {}-byte arena with the inner UCX agent: {e}",
                arena.len()
            )
        })?;
        Ok(Self {
            agent,
            arena_base: arena.base(),
            arena_len: arena.len(),
            arena_mem: arena.mem_type(),
            arena_dev: arena.device_id(),
            _registration: registration,
        })
    }

    /// The inner agent's metadata for the arena alone: what a peer loads to
    /// be able to write into it.
    pub fn arena_metadata(&self) -> Result<Vec<u8>, String> {
        let mut descs = nixl_sys::RegDescList::new(self.arena_mem)
            .map_err(|e| format!("descriptor list: {e}"))?;
        descs.add_desc(self.arena_base, self.arena_len, self.arena_dev);
        self.agent
            .get_local_partial_md(&descs, None)
            .map_err(|e| format!("exporting the arena's metadata: {e}"))
    }

    /// Starts writing `len` bytes at local arena offset `local` into the
    /// peer's arena at offset `remote`.
    pub fn post_write(
        &self,
        peer: &PeerArena,
        local: u64,
        remote: u64,
        len: u64,
    ) -> Result<ChunkWrite, String> {
        let end = local
            .checked_add(len)
            .filter(|&e| e <= self.arena_len as u64);
        if end.is_none() || len == 0 {
            return Err(format!(
                "chunk write of {len} bytes at local offset {local} leaves the arena"
            ));
        }
        let mut l =
            XferDescList::new(self.arena_mem).map_err(|e| format!("descriptor list: {e}"))?;
        l.add_desc(
            self.arena_base + local as usize,
            len as usize,
            self.arena_dev,
        );
        let mut r = XferDescList::new(peer.mem).map_err(|e| format!("descriptor list: {e}"))?;
        let target = peer
            .base
            .checked_add(remote)
            .ok_or("remote region address overflows")?;
        r.add_desc(target as usize, len as usize, peer.device);
        let req = self
            .agent
            .create_xfer_req(XferOp::Write, &l, &r, &peer.inner_agent, None)
            .map_err(|e| {
                format!(
                    "preparing a {len}-byte chunk write to {}: {e}",
                    peer.inner_agent
                )
            })?;
        match self.agent.post_xfer_req(&req, None) {
            Ok(_) => Ok(ChunkWrite { req }),
            Err(e) => Err(format!(
                "posting a {len}-byte chunk write to {}: {e}",
                peer.inner_agent
            )),
        }
    }

    pub fn poll(&self, w: &ChunkWrite) -> WriteState {
        match self.agent.get_xfer_status(&w.req) {
            Ok(XferStatus::Success) => WriteState::Done,
            Ok(XferStatus::InProgress) => WriteState::InProgress,
            Err(e) => WriteState::Failed(format!("chunk write failed: {e}")),
        }
    }
}
