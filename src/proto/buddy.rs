//! A power-of-two buddy allocator over byte offsets of the arena.
//!
//! The managed space is `capacity` bytes (a power of two) split into blocks
//! of `granularity << order` bytes. `alloc(bytes)` rounds the request up to
//! the smallest such block, splitting larger free blocks as needed (lowest
//! address first, so behaviour is deterministic); `free(offset)` merges the
//! block with its buddy for as long as the buddy is free. There is no
//! external fragmentation beyond buddy alignment and internal waste is below
//! 2x.

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

/// Errors of [`BuddyAllocator`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum BuddyError {
    /// The capacity or granularity are not usable.
    #[error("invalid buddy geometry: {0}")]
    InvalidGeometry(String),
    /// `free` of an offset that is not the start of an allocated block.
    #[error("free of offset {offset:#x}, which is not an allocated block (unknown offset or double free)")]
    NotAllocated {
        /// The offending offset.
        offset: u64,
    },
    /// An internal consistency check failed (a bug).
    #[error("buddy allocator invariant violated: {0}")]
    Invariant(String),
}

/// Power-of-two buddy allocator. See the module docs.
#[derive(Debug, Clone)]
pub struct BuddyAllocator {
    capacity: u64,
    granularity: u64,
    max_order: u32,
    /// Free block offsets, per order.
    free_lists: Vec<BTreeSet<u64>>,
    /// Allocated block offset -> order.
    allocated: BTreeMap<u64, u32>,
    free_bytes: u64,
}

impl BuddyAllocator {
    /// Manages `[0, capacity)` with minimum block `granularity`.
    ///
    /// Both must be powers of two and `granularity <= capacity`.
    pub fn new(capacity: u64, granularity: u64) -> Result<BuddyAllocator, BuddyError> {
        if !capacity.is_power_of_two() {
            return Err(BuddyError::InvalidGeometry(format!(
                "capacity {capacity} is not a power of two"
            )));
        }
        if !granularity.is_power_of_two() {
            return Err(BuddyError::InvalidGeometry(format!(
                "granularity {granularity} is not a power of two"
            )));
        }
        if granularity > capacity {
            return Err(BuddyError::InvalidGeometry(format!(
                "granularity {granularity} is larger than capacity {capacity}"
            )));
        }
        let max_order = (capacity / granularity).trailing_zeros();
        let mut free_lists = vec![BTreeSet::new(); max_order as usize + 1];
        free_lists[max_order as usize].insert(0);
        Ok(BuddyAllocator {
            capacity,
            granularity,
            max_order,
            free_lists,
            allocated: BTreeMap::new(),
            free_bytes: capacity,
        })
    }

    /// Total managed bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Minimum block size.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Bytes not covered by any allocated block.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Number of allocated blocks.
    pub fn allocated_count(&self) -> usize {
        self.allocated.len()
    }

    /// The block size `alloc(bytes)` would use (`None` if it can never fit).
    pub fn block_size_for(&self, bytes: u64) -> Option<u64> {
        if bytes == 0 || bytes > self.capacity {
            return None;
        }
        let units = bytes.div_ceil(self.granularity);
        let block = units.checked_next_power_of_two()? * self.granularity;
        (block <= self.capacity).then_some(block)
    }

    fn order_of_block(&self, block: u64) -> u32 {
        (block / self.granularity).trailing_zeros()
    }

    fn block_of_order(&self, order: u32) -> u64 {
        self.granularity << order
    }

    /// Allocates a block of at least `bytes` bytes and returns its offset, or
    /// `None` when no free block is large enough (or `bytes` is 0 or larger
    /// than the capacity).
    pub fn alloc(&mut self, bytes: u64) -> Option<u64> {
        let block = self.block_size_for(bytes)?;
        let want = self.order_of_block(block);
        let have = (want..=self.max_order).find(|&o| !self.free_lists[o as usize].is_empty())?;
        let offset = self.free_lists[have as usize].pop_first()?;
        // Split down: keep the low half, free the high half at each level.
        let mut order = have;
        while order > want {
            order -= 1;
            let buddy = offset + self.block_of_order(order);
            self.free_lists[order as usize].insert(buddy);
        }
        self.allocated.insert(offset, want);
        self.free_bytes -= block;
        Some(offset)
    }

    /// Frees the block starting at `offset`, coalescing with free buddies.
    pub fn free(&mut self, offset: u64) -> Result<(), BuddyError> {
        let mut order = self
            .allocated
            .remove(&offset)
            .ok_or(BuddyError::NotAllocated { offset })?;
        self.free_bytes += self.block_of_order(order);
        let mut offset = offset;
        while order < self.max_order {
            let buddy = offset ^ self.block_of_order(order);
            if !self.free_lists[order as usize].remove(&buddy) {
                break;
            }
            offset = offset.min(buddy);
            order += 1;
        }
        self.free_lists[order as usize].insert(offset);
        Ok(())
    }

    /// The size of the allocated block at `offset`, if any.
    pub fn block_size(&self, offset: u64) -> Option<u64> {
        self.allocated.get(&offset).map(|&o| self.block_of_order(o))
    }

    /// The largest block that could be allocated right now (0 if none).
    pub fn largest_free_block(&self) -> u64 {
        (0..=self.max_order)
            .rev()
            .find(|&o| !self.free_lists[o as usize].is_empty())
            .map_or(0, |o| self.block_of_order(o))
    }

    /// Allocated blocks as `(offset, size)`, in offset order.
    pub fn allocated_blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.allocated
            .iter()
            .map(|(&off, &o)| (off, self.block_of_order(o)))
    }

    /// Checks that free and allocated blocks tile `[0, capacity)` exactly,
    /// are aligned to their size, and that no two free buddies were left
    /// unmerged.
    pub fn check_invariants(&self) -> Result<(), BuddyError> {
        let mut blocks: Vec<(u64, u64, bool)> = self
            .allocated_blocks()
            .map(|(off, size)| (off, size, true))
            .collect();
        for (order, list) in self.free_lists.iter().enumerate() {
            let size = self.block_of_order(order as u32);
            for &off in list {
                blocks.push((off, size, false));
                if (order as u32) < self.max_order && list.contains(&(off ^ size)) {
                    return Err(BuddyError::Invariant(format!(
                        "free buddies {off:#x} and {:#x} of size {size} not merged",
                        off ^ size
                    )));
                }
            }
        }
        blocks.sort_unstable();
        let mut cursor = 0u64;
        let mut free = 0u64;
        for (off, size, allocated) in blocks {
            if off != cursor {
                return Err(BuddyError::Invariant(format!(
                    "gap or overlap at {cursor:#x} (next block at {off:#x})"
                )));
            }
            if off % size != 0 {
                return Err(BuddyError::Invariant(format!(
                    "block {off:#x} not aligned to its size {size}"
                )));
            }
            if !allocated {
                free += size;
            }
            cursor = off + size;
        }
        if cursor != self.capacity {
            return Err(BuddyError::Invariant(format!(
                "blocks end at {cursor:#x}, capacity is {:#x}",
                self.capacity
            )));
        }
        if free != self.free_bytes {
            return Err(BuddyError::Invariant(format!(
                "free_bytes says {} but free blocks sum to {free}",
                self.free_bytes
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rejects_bad_geometry() {
        assert!(BuddyAllocator::new(1000, 8).is_err());
        assert!(BuddyAllocator::new(1024, 24).is_err());
        assert!(BuddyAllocator::new(1024, 2048).is_err());
        assert!(BuddyAllocator::new(1024, 1024).is_ok());
    }

    #[test]
    fn rounds_up_and_splits_lowest_first() {
        let mut b = BuddyAllocator::new(1024, 64).unwrap();
        assert_eq!(b.alloc(1), Some(0));
        assert_eq!(b.block_size(0), Some(64));
        assert_eq!(b.alloc(65), Some(128));
        assert_eq!(b.block_size(128), Some(128));
        assert_eq!(b.alloc(64), Some(64));
        assert_eq!(b.free_bytes(), 1024 - 256);
        b.check_invariants().unwrap();
    }

    #[test]
    fn zero_and_oversize_never_fit() {
        let mut b = BuddyAllocator::new(1024, 64).unwrap();
        assert_eq!(b.alloc(0), None);
        assert_eq!(b.alloc(1025), None);
        assert_eq!(b.alloc(u64::MAX), None);
        assert_eq!(b.alloc(1024), Some(0));
        assert_eq!(b.alloc(1), None);
    }

    #[test]
    fn double_and_unknown_free_are_errors() {
        let mut b = BuddyAllocator::new(1024, 64).unwrap();
        let a = b.alloc(64).unwrap();
        assert_eq!(
            b.free(a + 1),
            Err(BuddyError::NotAllocated { offset: a + 1 })
        );
        b.free(a).unwrap();
        assert_eq!(b.free(a), Err(BuddyError::NotAllocated { offset: a }));
        b.check_invariants().unwrap();
    }

    #[test]
    fn coalesces_back_to_one_block() {
        let mut b = BuddyAllocator::new(1024, 64).unwrap();
        let offs: Vec<u64> = (0..16).map(|_| b.alloc(64).unwrap()).collect();
        assert_eq!(b.alloc(1), None);
        assert_eq!(b.largest_free_block(), 0);
        for off in offs.iter().rev().step_by(2).chain(offs.iter().step_by(2)) {
            b.free(*off).unwrap();
            b.check_invariants().unwrap();
        }
        assert_eq!(b.largest_free_block(), 1024);
        assert_eq!(b.alloc(1024), Some(0));
    }

    proptest! {
        #[test]
        fn random_sequences_never_overlap_and_fully_coalesce(
            ops in proptest::collection::vec((any::<bool>(), 1u64..3000, any::<prop::sample::Index>()), 1..200)
        ) {
            let mut b = BuddyAllocator::new(4096, 32).unwrap();
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (is_alloc, bytes, pick) in ops {
                if is_alloc || live.is_empty() {
                    if let Some(off) = b.alloc(bytes) {
                        let size = b.block_size(off).unwrap();
                        prop_assert!(size >= bytes);
                        prop_assert!(size < 2 * bytes.max(32));
                        for &(o, s) in &live {
                            prop_assert!(off + size <= o || o + s <= off, "overlap");
                        }
                        live.push((off, size));
                    } else {
                        // Refusal only when no free block is large enough.
                        prop_assert!(b.largest_free_block() < b.block_size_for(bytes).unwrap_or(u64::MAX));
                    }
                } else {
                    let (off, _) = live.swap_remove(pick.index(live.len()));
                    b.free(off).unwrap();
                }
                b.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
                let used: u64 = live.iter().map(|&(_, s)| s).sum();
                prop_assert_eq!(b.free_bytes(), 4096 - used);
            }
            for (off, _) in live.drain(..) {
                b.free(off).unwrap();
            }
            prop_assert_eq!(b.largest_free_block(), 4096);
            prop_assert_eq!(b.free_bytes(), 4096);
        }
    }
}
