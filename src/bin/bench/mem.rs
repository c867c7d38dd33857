//! The memory the bench moves, behind a small trait so that the CUDA issue
//! can add VRAM buffers (device allocations filled and read back through the
//! host) without touching the runner.

use std::borrow::Cow;

use nixl_sys::{MemType, RegistrationHandle};

use crate::cli::MemKind;
use nixl_bounce::harness::{fill_pattern, DramBuffer, Node};

/// One side's buffer: registered with every variant's agent on that side.
pub trait BenchMemory {
    fn mem_type(&self) -> MemType;
    fn device_id(&self) -> u64;
    /// Address of byte 0 as the transfer descriptors name it.
    fn addr(&self) -> usize;
    fn len(&self) -> usize;
    /// Fill `[offset, offset + len)` with the seeded pattern of `seed`
    /// (byte `i` of the range depends on `(seed, i)` only).
    fn fill(&mut self, offset: usize, len: usize, seed: u64);
    /// The bytes of `[offset, offset + len)`, copied to the host if needed.
    fn read(&self, offset: usize, len: usize) -> Cow<'_, [u8]>;
    /// Whether the bytes around the buffer are intact.
    fn check_guards(&self) -> Result<(), String>;
    fn register(&self, node: &Node) -> Result<RegistrationHandle, String>;
}

/// Host memory with guard pages (the harness' `DramBuffer`).
pub struct Dram(DramBuffer);

impl BenchMemory for Dram {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
    fn addr(&self) -> usize {
        self.0.addr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn fill(&mut self, offset: usize, len: usize, seed: u64) {
        fill_pattern(&mut self.0.as_mut_slice()[offset..offset + len], seed);
    }
    fn read(&self, offset: usize, len: usize) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.0.as_slice()[offset..offset + len])
    }
    fn check_guards(&self) -> Result<(), String> {
        self.0.check_guards()
    }
    fn register(&self, node: &Node) -> Result<RegistrationHandle, String> {
        node.register(&self.0)
    }
}

/// Allocates a buffer of `len` bytes of the requested kind.
pub fn allocate(kind: MemKind, len: usize) -> Result<Box<dyn BenchMemory>, String> {
    match kind {
        MemKind::Dram => {
            let mut b = DramBuffer::new(len.max(1));
            // Touch every page now so that first-touch faults are not timed.
            b.as_mut_slice().fill(0);
            Ok(Box::new(Dram(b)))
        }
    }
}
