//! The CMA copy: DRAM straight between this process and a peer process on
//! the same host, by cross-memory attach (`process_vm_readv` /
//! `process_vm_writev`), up to [`IOV_BATCH`] descriptors a system call; in
//! this very process (two agents of one process) a plain memory copy.
//!
//! UCX's own CMA transport makes one system call a descriptor, and NIXL's
//! UCX backend one UCX operation a descriptor: for thousands of 4 KiB
//! blocks those per-descriptor costs, not the copy, set the speed
//! (docs/benchmarks.md, "The CMA path").

use std::sync::atomic::{AtomicBool, Ordering};

/// The most iovecs one `process_vm_*` call takes (Linux's `IOV_MAX`).
pub const IOV_BATCH: usize = 1024;

/// The most bytes of one pair that one system call or memory copy moves,
/// so that a stop (a release, a deregistration) is seen within one piece.
pub const MAX_PIECE_BYTES: u64 = 64 << 20;

/// One copy of `len` bytes between `local` (this process's address) and
/// `remote` (the peer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

impl Pair {
    /// `self` and `next` as one pair, when `next` continues `self` on both
    /// sides (vLLM's blocks of one request are often adjacent).
    #[inline]
    pub fn merged(&self, next: &Pair) -> Option<Pair> {
        (self.local.checked_add(self.len)? == next.local
            && self.remote.checked_add(self.len)? == next.remote)
            .then(|| Pair {
                len: self.len + next.len,
                ..*self
            })
    }
}

/// Cuts `pairs` into at most `parts` consecutive slices of about equal
/// bytes (a part holds whole pairs), none under `min_part_bytes`.
pub fn split(pairs: &[Pair], parts: usize, min_part_bytes: u64) -> Vec<std::ops::Range<usize>> {
    let total: u64 = pairs.iter().map(|p| p.len).sum();
    let parts = (parts.max(1) as u64)
        .min(total / min_part_bytes.max(1))
        .max(1);
    let per = total.div_ceil(parts);
    let mut out = Vec::with_capacity(parts as usize);
    let (mut start, mut acc) = (0, 0u64);
    for (i, p) in pairs.iter().enumerate() {
        acc += p.len;
        if acc >= per && out.len() + 1 < parts as usize {
            out.push(start..i + 1);
            start = i + 1;
            acc = 0;
        }
    }
    if start < pairs.len() || out.is_empty() {
        out.push(start..pairs.len());
    }
    out
}

/// Whose memory the remote addresses are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// This process (another agent of it): a memory copy.
    ThisProcess,
    /// A process of this host, by its PID (as this process sees it).
    Process(libc::pid_t),
}

/// Why a copy stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmaError {
    #[error("the transfer was released or timed out before it ended")]
    Cancelled,
    #[error("the peer process {0} is gone")]
    PeerGone(libc::pid_t),
    #[error("not permitted to read or write process {0}'s memory (ptrace access mode; see docs/design.md \"The CMA path\")")]
    NotPermitted(libc::pid_t),
    #[error("descriptor pair {index} ({len} bytes, local {local:#x}, peer {remote:#x}) is not mapped in one of the two processes")]
    Unmapped {
        index: usize,
        local: u64,
        remote: u64,
        len: u64,
    },
    #[error("{call} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    Os { call: &'static str, errno: i32 },
}

/// Copies every pair: the peer's memory to ours for a `read`, ours to the
/// peer's otherwise. Checks `cancelled` between system calls.
///
/// # Safety
/// Every pair's local range is memory of this process that stays mapped
/// for the call and that nothing else writes meanwhile (for a read: that
/// nothing else uses). With [`Target::ThisProcess`] the same holds for the
/// remote ranges. For another process, the kernel checks the remote
/// ranges: one that is not mapped there fails the copy, it cannot corrupt
/// this process.
pub unsafe fn copy(
    target: Target,
    read: bool,
    pairs: &[Pair],
    cancelled: &AtomicBool,
) -> Result<(), CmaError> {
    match target {
        Target::ThisProcess => {
            for p in pairs {
                let (src, dst) = if read {
                    (p.remote, p.local)
                } else {
                    (p.local, p.remote)
                };
                let mut at = 0;
                while at < p.len {
                    if cancelled.load(Ordering::Relaxed) {
                        return Err(CmaError::Cancelled);
                    }
                    let n = (p.len - at).min(MAX_PIECE_BYTES);
                    // SAFETY: the caller's contract: both ranges are live
                    // memory of this process; `copy` allows them to overlap.
                    unsafe {
                        std::ptr::copy((src + at) as *const u8, (dst + at) as *mut u8, n as usize);
                    }
                    at += n;
                }
            }
            Ok(())
        }
        // SAFETY: the caller's contract, passed on.
        Target::Process(pid) => unsafe { copy_process(pid, read, pairs, cancelled) },
    }
}

/// # Safety
/// As [`copy`]'s for the local ranges.
unsafe fn copy_process(
    pid: libc::pid_t,
    read: bool,
    pairs: &[Pair],
    cancelled: &AtomicBool,
) -> Result<(), CmaError> {
    let mut local = Vec::with_capacity(IOV_BATCH.min(pairs.len()));
    let mut remote = Vec::with_capacity(IOV_BATCH.min(pairs.len()));
    // The next pair to move, and how many of its bytes already moved.
    let (mut next, mut moved) = (0usize, 0u64);
    while next < pairs.len() {
        if cancelled.load(Ordering::Relaxed) {
            return Err(CmaError::Cancelled);
        }
        local.clear();
        remote.clear();
        // Whole pairs, except that a pair longer than a piece goes alone
        // and in pieces (the resume below continues it).
        for (k, p) in pairs[next..].iter().take(IOV_BATCH).enumerate() {
            let skip = if k == 0 { moved } else { 0 };
            let rest = p.len - skip;
            if rest > MAX_PIECE_BYTES && k > 0 {
                break;
            }
            let n = rest.min(MAX_PIECE_BYTES) as usize;
            local.push(libc::iovec {
                iov_base: p.local.wrapping_add(skip) as *mut libc::c_void,
                iov_len: n,
            });
            remote.push(libc::iovec {
                iov_base: p.remote.wrapping_add(skip) as *mut libc::c_void,
                iov_len: n,
            });
            if rest > MAX_PIECE_BYTES {
                break;
            }
        }
        let n = local.len() as libc::c_ulong;
        // SAFETY: the iovecs are valid arrays of `n` entries; the local
        // ranges are the caller's (this function's contract), the remote
        // ones are checked by the kernel against the peer's mappings.
        let done = unsafe {
            if read {
                libc::process_vm_readv(pid, local.as_ptr(), n, remote.as_ptr(), n, 0)
            } else {
                libc::process_vm_writev(pid, local.as_ptr(), n, remote.as_ptr(), n, 0)
            }
        };
        if done < 0 {
            let err = std::io::Error::last_os_error();
            return Err(match err.raw_os_error() {
                Some(libc::ESRCH) => CmaError::PeerGone(pid),
                Some(libc::EPERM) => CmaError::NotPermitted(pid),
                Some(libc::EFAULT) => unmapped(pairs, next),
                errno => CmaError::Os {
                    call: if read {
                        "process_vm_readv"
                    } else {
                        "process_vm_writev"
                    },
                    errno: errno.unwrap_or(0),
                },
            });
        }
        if done == 0 {
            return Err(unmapped(pairs, next));
        }
        // Partial transfers end at an iovec's edge or inside one: go on
        // from the first byte not moved.
        let mut left = done as u64;
        while left > 0 && next < pairs.len() {
            let rest = pairs[next].len - moved;
            if left >= rest {
                left -= rest;
                next += 1;
                moved = 0;
            } else {
                moved += left;
                left = 0;
            }
        }
    }
    Ok(())
}

fn unmapped(pairs: &[Pair], index: usize) -> CmaError {
    let p = pairs[index];
    CmaError::Unmapped {
        index,
        local: p.local,
        remote: p.remote,
        len: p.len,
    }
}

/// Reads `N` bytes at `addr` in process `pid`: how a peer's identity is
/// proven (a random token it published is where it said).
pub fn read_remote<const N: usize>(pid: libc::pid_t, addr: u64) -> Result<[u8; N], CmaError> {
    let mut out = [0u8; N];
    let pair = Pair {
        local: out.as_mut_ptr() as u64,
        remote: addr,
        len: N as u64,
    };
    // SAFETY: the local range is `out`, owned here for the call.
    unsafe { copy_process(pid, true, &[pair], &AtomicBool::new(false))? };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Pairs between two buffers: `count` blocks of `block` bytes, block i
    /// of `a` with block `count - 1 - i` of `b`.
    fn crossed(a: &[u8], b: &[u8], count: usize, block: usize) -> Vec<Pair> {
        (0..count)
            .map(|i| Pair {
                local: a.as_ptr() as u64 + (i * block) as u64,
                remote: b.as_ptr() as u64 + ((count - 1 - i) * block) as u64,
                len: block as u64,
            })
            .collect()
    }

    fn expect_crossed(from: &[u8], to: &[u8], count: usize, block: usize) {
        for i in 0..count {
            let j = count - 1 - i;
            assert_eq!(
                &from[i * block..(i + 1) * block],
                &to[j * block..(j + 1) * block],
                "block {i}"
            );
        }
    }

    /// Appends `p` as the CMA path's preparation does: merged into the
    /// last pair when it continues it, and never when it is empty.
    fn push_merged(pairs: &mut Vec<Pair>, p: Pair) {
        if p.len == 0 {
            return;
        }
        match pairs.last().and_then(|last| last.merged(&p)) {
            Some(m) => *pairs.last_mut().unwrap() = m,
            None => pairs.push(p),
        }
    }

    #[test]
    fn adjacent_pairs_merge_and_others_do_not() {
        let mut v = Vec::new();
        push_merged(
            &mut v,
            Pair {
                local: 0,
                remote: 100,
                len: 10,
            },
        );
        push_merged(
            &mut v,
            Pair {
                local: 10,
                remote: 110,
                len: 5,
            },
        );
        push_merged(
            &mut v,
            Pair {
                local: 15,
                remote: 200,
                len: 5,
            },
        );
        push_merged(
            &mut v,
            Pair {
                local: 30,
                remote: 205,
                len: 0,
            },
        );
        push_merged(
            &mut v,
            Pair {
                local: u64::MAX - 1,
                remote: 0,
                len: 1,
            },
        );
        push_merged(
            &mut v,
            Pair {
                local: 0,
                remote: 1,
                len: 1,
            },
        );
        assert_eq!(
            v,
            vec![
                Pair {
                    local: 0,
                    remote: 100,
                    len: 15
                },
                Pair {
                    local: 15,
                    remote: 200,
                    len: 5
                },
                Pair {
                    local: u64::MAX - 1,
                    remote: 0,
                    len: 1
                },
                Pair {
                    local: 0,
                    remote: 1,
                    len: 1
                },
            ]
        );
    }

    #[test]
    fn parts_cover_every_pair_once_in_order() {
        let pairs: Vec<Pair> = (0..10)
            .map(|i| Pair {
                local: i * 100,
                remote: 0,
                len: 100 + i,
            })
            .collect();
        for (parts, min) in [(1, 1), (2, 1), (3, 1), (4, 500), (16, 1), (2, 1 << 20)] {
            let cut = split(&pairs, parts, min);
            assert!(
                !cut.is_empty() && cut.len() <= parts,
                "{parts} {min}: {cut:?}"
            );
            assert_eq!(cut[0].start, 0);
            assert_eq!(cut.last().unwrap().end, pairs.len());
            assert!(cut
                .windows(2)
                .all(|w| w[0].end == w[1].start && !w[0].is_empty()));
        }
        assert_eq!(split(&pairs, 2, 1 << 20), vec![0..10]);
        assert_eq!(split(&[], 4, 1), vec![0..0]);
    }

    #[test]
    fn copies_within_this_process_both_ways() {
        let (count, block) = (300, 4096);
        let a = pattern(count * block, 1);
        let mut b = vec![0u8; count * block];
        let pairs = crossed(&a, &b, count, block);
        let no = AtomicBool::new(false);
        // SAFETY: both buffers live for the call; `a` is only read.
        unsafe { copy(Target::ThisProcess, false, &pairs, &no) }.unwrap();
        expect_crossed(&a, &b, count, block);
        let mut c = vec![0u8; count * block];
        let back = crossed(&c, &b, count, block);
        // SAFETY: as above; `b` is read, `c` written.
        unsafe { copy(Target::ThisProcess, true, &back, &no) }.unwrap();
        assert_eq!(a, c);
        b.clear();
        c.clear();
    }

    #[test]
    fn copies_through_cma_in_batches_both_ways() {
        // More pairs than one call takes, and lengths that are not pages.
        let (count, block) = (IOV_BATCH * 2 + 7, 1000);
        let a = pattern(count * block, 2);
        let b = vec![0u8; count * block];
        let me = std::process::id() as libc::pid_t;
        let no = AtomicBool::new(false);
        let pairs = crossed(&a, &b, count, block);
        // SAFETY: `a` lives and is only read; `b` is written by the kernel.
        match unsafe { copy(Target::Process(me), false, &pairs, &no) } {
            Err(CmaError::NotPermitted(_)) => {
                eprintln!("SKIP: process_vm_writev is not permitted here");
                return;
            }
            r => r.unwrap(),
        }
        expect_crossed(&a, &b, count, block);
        let c = vec![0u8; count * block];
        let back = crossed(&c, &b, count, block);
        // SAFETY: as above.
        unsafe { copy(Target::Process(me), true, &back, &no) }.unwrap();
        assert_eq!(a, c);
    }

    #[test]
    fn an_unmapped_peer_range_fails_with_its_pair_and_a_cancel_stops() {
        let me = std::process::id() as libc::pid_t;
        let a = pattern(8192, 3);
        // SAFETY: a page mapped and unmapped again: an address with nothing
        // behind it for the rest of the test.
        let hole = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            libc::munmap(p, 4096);
            p as u64
        };
        let b = vec![0u8; 8192];
        let pairs = [
            Pair {
                local: a.as_ptr() as u64,
                remote: b.as_ptr() as u64,
                len: 4096,
            },
            Pair {
                local: a.as_ptr() as u64 + 4096,
                remote: hole,
                len: 4096,
            },
        ];
        let no = AtomicBool::new(false);
        // SAFETY: the local ranges are `a`, alive and only read.
        match unsafe { copy(Target::Process(me), false, &pairs, &no) } {
            Err(CmaError::NotPermitted(_)) => return,
            Err(CmaError::Unmapped { index, .. }) => assert_eq!(index, 1),
            other => panic!("expected the unmapped pair, got {other:?}"),
        }
        assert_eq!(&a[..4096], &b[..4096], "the mapped pair still moved");
        let yes = AtomicBool::new(true);
        // SAFETY: as above.
        let r = unsafe { copy(Target::Process(me), false, &pairs[..1], &yes) };
        assert_eq!(r, Err(CmaError::Cancelled));
        let r = unsafe { copy(Target::ThisProcess, false, &pairs[..1], &yes) };
        assert_eq!(r, Err(CmaError::Cancelled));
    }

    #[test]
    fn a_token_is_read_where_it_lies() {
        let token = [7u8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];
        let me = std::process::id() as libc::pid_t;
        match read_remote::<16>(me, token.as_ptr() as u64) {
            Err(CmaError::NotPermitted(_)) => {}
            r => assert_eq!(r.unwrap(), token),
        }
        assert!(matches!(
            read_remote::<16>(i32::MAX, token.as_ptr() as u64),
            Err(CmaError::PeerGone(_))
        ));
    }
}
