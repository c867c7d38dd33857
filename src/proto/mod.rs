//! The pure, sans-IO bounce protocol core.
//!
//! Everything under `proto/` is deterministic: no threads, sockets, clocks,
//! GPU or NIXL calls. Time is an argument ([`Time`]), events come in through
//! `handle_*` methods and work goes out through `poll_*` methods. The runtime
//! (reactor thread, copy engine, data plane, control channel) drives an
//! [`endpoint::Endpoint`] and executes the [`endpoint::Action`]s it hands out.
//!
//! Module map:
//!
//! | module | role |
//! |---|---|
//! | [`plan`] | descriptors -> chunks, gather runs, scatter runs |
//! | [`wire`] | control-message and handshake codec |
//! | [`buddy`] | power-of-two allocator over arena byte offsets |
//! | [`credit`] | credit scheduler: who may hold which arena region |
//! | [`sender`] | request / chunk state machine (the initiator role) |
//! | [`receiver`] | flow state machine (the target role) |
//! | [`read`] | the READ direction: the reader's requests (flows it grants itself) |
//! | [`endpoint`] | one local agent: shared scheduler + both roles, actions out |
//! | `driver` | (tests, feature `harness`) plays the runtime for two endpoints |

#![forbid(unsafe_code)]

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::sync::Locked;

pub mod buddy;
pub mod credit;
#[cfg(any(test, feature = "harness"))]
pub mod driver;
pub mod endpoint;
pub mod plan;
pub mod read;
pub mod receiver;
pub mod sender;
pub mod wire;

pub use endpoint::{Action, Endpoint, EndpointConfig, FailureReason, Outcome, SubmitError};

/// A point in virtual time: nanoseconds since an arbitrary origin chosen by
/// the runtime (usually the moment the endpoint was created).
///
/// The protocol core never reads a clock; every `handle_*` call carries the
/// current `Time`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(u64);

impl Time {
    /// The origin.
    pub const ZERO: Time = Time(0);

    /// A time `nanos` nanoseconds after the origin.
    pub const fn from_nanos(nanos: u64) -> Time {
        Time(nanos)
    }

    /// A time `millis` milliseconds after the origin (saturating).
    pub const fn from_millis(millis: u64) -> Time {
        Time(millis.saturating_mul(1_000_000))
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `self + d`, saturating at the end of time.
    pub fn after(self, d: Duration) -> Time {
        let add = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(add))
    }

    /// The duration from `earlier` to `self` (zero if `earlier` is later).
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:06}ms", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}

/// The name of a remote agent, as the control channel identifies it.
///
/// Cheap to clone (shared string).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerId(Arc<str>);

impl PeerId {
    /// Wraps an agent name.
    pub fn new(name: &str) -> PeerId {
        PeerId(Arc::from(name))
    }

    /// The agent name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for PeerId {
    fn from(s: &str) -> PeerId {
        PeerId::new(s)
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Identifies one transfer request of one sender. Assigned by the sending
/// endpoint, monotonic and never reused (the runtime seeds the counter with
/// a value that differs between incarnations of the agent, see
/// [`EndpointConfig::request_id_base`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// Which side started a flow (and therefore whose id space its request id
/// comes from).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FlowKind {
    /// A peer's WRITE into this agent: the request id is the peer's.
    Write,
    /// This agent's READ from a peer, which writes the data into regions
    /// this agent grants: the request id is this agent's own.
    Read,
}

/// A flow: one request stream as the receiver (the agent whose arena is
/// written) sees it, keyed by the writing peer, the request id and the
/// kind (concurrent requests of one peer are distinct flows; a peer's
/// WRITE and this agent's READ never share a key even if their ids are
/// equal, the two come from different id spaces).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FlowId {
    /// The agent that writes into the regions.
    pub peer: PeerId,
    /// The request id (the peer's for a WRITE, ours for a READ).
    pub request: RequestId,
    /// WRITE or READ.
    pub kind: FlowKind,
}

impl FlowId {
    /// The flow of `peer`'s WRITE request `request`.
    pub fn write(peer: PeerId, request: RequestId) -> FlowId {
        FlowId {
            peer,
            request,
            kind: FlowKind::Write,
        }
    }

    /// The flow of this agent's READ request `request` from `peer`.
    pub fn read(peer: PeerId, request: RequestId) -> FlowId {
        FlowId {
            peer,
            request,
            kind: FlowKind::Read,
        }
    }
}

impl fmt::Display for FlowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            FlowKind::Write => write!(f, "{}/{}", self.peer, self.request),
            FlowKind::Read => write!(f, "{}/read {}", self.peer, self.request),
        }
    }
}

/// A region of the arena, named by its byte offset from the arena base
/// (the address is `arena_base + offset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionHandle(pub u64);

impl fmt::Display for RegionHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{:#x}", self.0)
    }
}

/// One chunk of one local request (the sender's unit of gather and write).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChunkRef {
    /// The request.
    pub request: RequestId,
    /// The chunk's index within the request's plan.
    pub chunk: u32,
}

impl fmt::Display for ChunkRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.request, self.chunk)
    }
}

/// A coalesced copy run between a region and application memory: `count`
/// copies of `len` bytes; copy `i` moves between
/// `region_offset + i * region_stride` (relative to the region start) and
/// `addr + i * addr_stride`.
///
/// Used for both directions: gather (addr is the source) and scatter
/// (addr is the destination).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Run {
    /// Offset of the first copy within the region.
    pub region_offset: u64,
    /// Application address of the first copy.
    pub addr: u64,
    /// Bytes per copy (> 0).
    pub len: u64,
    /// Number of copies (>= 1).
    pub count: u32,
    /// Region-offset step between copies (meaningful when `count > 1`).
    pub region_stride: u64,
    /// Address step between copies (meaningful when `count > 1`).
    pub addr_stride: u64,
}

impl Run {
    /// A single copy.
    pub fn single(region_offset: u64, addr: u64, len: u64) -> Run {
        Run {
            region_offset,
            addr,
            len,
            count: 1,
            region_stride: 0,
            addr_stride: 0,
        }
    }

    /// Total bytes moved by this run (`None` on overflow).
    pub fn total_bytes(&self) -> Option<u64> {
        self.len.checked_mul(u64::from(self.count))
    }

    /// One past the last region byte touched (`None` on overflow or when
    /// the run is empty).
    pub fn region_end(&self) -> Option<u64> {
        if self.len == 0 || self.count == 0 {
            return None;
        }
        let last = u64::from(self.count - 1).checked_mul(self.region_stride)?;
        self.region_offset.checked_add(last)?.checked_add(self.len)
    }

    /// One past the last application byte touched (`None` on overflow or
    /// when the run is empty).
    pub fn addr_end(&self) -> Option<u64> {
        if self.len == 0 || self.count == 0 {
            return None;
        }
        let last = u64::from(self.count - 1).checked_mul(self.addr_stride)?;
        self.addr.checked_add(last)?.checked_add(self.len)
    }

    /// The individual copies `(region_offset, addr, len)` of this run.
    pub fn copies(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        (0..u64::from(self.count)).map(move |i| {
            (
                self.region_offset
                    .wrapping_add(i.wrapping_mul(self.region_stride)),
                self.addr.wrapping_add(i.wrapping_mul(self.addr_stride)),
                self.len,
            )
        })
    }
}

/// A shared, immutable run list. Plans are built once (when a transfer is
/// prepared) and reposted many times: gathers, DATA messages and scatters
/// share the plan's lists instead of copying them per post. A list built
/// from a [`RunPool`] gives its storage back to it when the last holder
/// lets go.
///
/// A list decoded from a DATA in wire version 3's packed form keeps that
/// form ([`Copies`]: an address a copy) and makes its runs only when
/// something reads them as runs (`Deref`): the receiver's check, its
/// registration check and its table fill read the copies instead, so a
/// chunk's runs are never built on the way from the message to the GPU
/// (docs/design.md §4, "Runs the GPU reads as they arrive").
#[derive(Clone, Default)]
pub struct Runs(Arc<RunList>);

#[derive(Default)]
struct RunList {
    runs: std::sync::OnceLock<Vec<Run>>,
    copies: Option<Copies>,
    home: Option<RunPool>,
}

impl Drop for RunList {
    fn drop(&mut self) {
        if let (Some(pool), Some(runs)) = (self.home.take(), self.runs.take()) {
            pool.put(runs);
        }
    }
}

/// Copies of one length packed back to back in a region: copy `j` moves
/// `len` bytes between region offset `first + j * len` and `addrs[j]`. A
/// copy marked in `marks` (bit `j % 8` of byte `j / 8`) is the second of a
/// run of two with the copy before it, which is what the list is as runs
/// when made from the copies ([`Runs::from_copies`]; a plan's own runs may
/// hold two contiguous copies as one run twice as long,
/// [`Copies::same_copies_as`]). Built only through [`Copies::new`], which
/// checks that the runs exist, or by the planner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Copies {
    len: u64,
    first: u64,
    addrs: Vec<u64>,
    marks: Vec<u8>,
    /// [`Copies::addresses_fit`], found once when built.
    fit: bool,
}

impl Copies {
    /// The list, checked: at least one copy of at least one byte, region
    /// offsets that do not overflow, one mark bit a copy and none past the
    /// copies, and no mark on the first copy or on a copy after a marked
    /// one (a run is one or two copies).
    pub fn new(len: u64, first: u64, addrs: Vec<u64>, marks: Vec<u8>) -> Result<Copies, String> {
        let n = addrs.len();
        if n == 0 || len == 0 {
            return Err(format!("{n} copies of {len} bytes"));
        }
        if (n as u64)
            .checked_mul(len)
            .and_then(|b| b.checked_add(first))
            .is_none()
        {
            return Err(format!(
                "{n} copies of {len} bytes from offset {first} overflow"
            ));
        }
        check_marks(n, &marks)?;
        // Whether every run's application range fits in 64 bits: each
        // copy's end does, and a run's second copy lies at or after its
        // first (the run's address stride is their difference). Only the
        // marked copies are looked at (none for scattered blocks, at most
        // every other copy; copy 0 is never marked, `check_marks`).
        // The addresses' bitwise or bounds the largest from above and
        // vectorises on any x86-64 (a 64-bit unsigned max does not): the
        // exact max only when that bound is too high.
        let limit = u64::MAX - len;
        let below_limit =
            addrs.iter().fold(0, |m, &a| m | a) <= limit || addrs.iter().all(|&a| a <= limit);
        let back = marks.iter().enumerate().any(|(i, &m)| {
            let mut bits = m;
            while bits != 0 {
                let j = i * 8 + bits.trailing_zeros() as usize;
                if addrs[j] < addrs[j - 1] {
                    return true;
                }
                bits &= bits - 1;
            }
            false
        });
        let fit = below_limit && !back;
        Ok(Copies {
            len,
            first,
            addrs,
            marks,
            fit,
        })
    }

    /// Copies a plan packed (`proto::plan`): from region offset 0, the
    /// marks made as its runs were merged (or, packed copies first, its
    /// greedy pairs of forward copies), no copy's end past the address
    /// space (its descriptors were checked) and every run's second copy
    /// after its first (the merge rule), so none of [`Copies::new`]'s
    /// passes is needed (checked in debug builds and by the planner's
    /// property test).
    pub(crate) fn planned(len: u64, addrs: Vec<u64>, marks: Vec<u8>) -> Copies {
        debug_assert!(Copies::new(len, 0, addrs.clone(), marks.clone()).is_ok_and(|c| c.fit));
        Copies {
            len,
            first: 0,
            addrs,
            marks,
            fit: true,
        }
    }

    /// Bytes a copy.
    pub fn copy_len(&self) -> u64 {
        self.len
    }
    /// The first copy's region offset.
    pub fn first(&self) -> u64 {
        self.first
    }
    /// Each copy's application address.
    pub fn addrs(&self) -> &[u64] {
        &self.addrs
    }
    /// The marks (bit `j % 8` of byte `j / 8`: copy `j` is a run's second).
    pub(crate) fn marks(&self) -> &[u8] {
        &self.marks
    }
    /// Whether copy `j` is a run's second.
    pub fn marked(&self, j: usize) -> bool {
        self.marks[j / 8] >> (j % 8) & 1 != 0
    }
    /// One past the last region byte (checked not to overflow).
    pub fn region_end(&self) -> u64 {
        self.first + self.addrs.len() as u64 * self.len
    }

    /// Whether every run these copies are has an application range that
    /// does not wrap around the address space ([`Run::addr_end`]): each
    /// copy's end fits in 64 bits, and a run's second copy lies at or after
    /// its first (found when the list was built).
    pub fn addresses_fit(&self) -> bool {
        self.fit
    }

    /// Whether `runs` move exactly these copies, in order: each run cut
    /// into pieces of the copies' length. The planner's runs are these
    /// copies' own runs ([`Copies::to_runs`]) except where they merge
    /// further: contiguous copies as one longer run, three strided copies
    /// or more as one run.
    pub fn same_copies_as(&self, runs: &[Run]) -> bool {
        let (len, mut j) = (self.len, 0usize);
        for r in runs {
            if r.len == 0 || !r.len.is_multiple_of(len) {
                return false;
            }
            for k in 0..u64::from(r.count) {
                for p in 0..r.len / len {
                    let piece = |base: u64, stride: u64| {
                        k.checked_mul(stride)?
                            .checked_add(base)?
                            .checked_add(p * len)
                    };
                    let want = (j as u64)
                        .checked_mul(len)
                        .and_then(|o| o.checked_add(self.first));
                    if j >= self.addrs.len()
                        || piece(r.region_offset, r.region_stride) != want
                        || piece(r.addr, r.addr_stride) != Some(self.addrs[j])
                    {
                        return false;
                    }
                    j += 1;
                }
            }
        }
        j == self.addrs.len()
    }

    /// The runs these copies are: each copy a run of its own, or with the
    /// marked copy after it a run of two.
    fn to_runs(&self) -> Vec<Run> {
        let (first, len) = (self.first, self.len);
        runs_of_marked_copies(self.addrs.len(), len, &self.marks, |j| {
            (first + j as u64 * len, self.addrs[j])
        })
    }
}

/// Checks the marks of `n` copies (bit `j % 8` of byte `j / 8` marks copy
/// `j` a run's second): one byte for every eight copies, none past the
/// copies, and a mark only on a copy after an unmarked one (a run is one
/// or two copies). Shared by [`Copies::new`] and the wire's compact run
/// lists.
pub(crate) fn check_marks(n: usize, marks: &[u8]) -> Result<(), String> {
    if marks.len() != n.div_ceil(8) {
        return Err(format!("{} mark bytes for {n} copies", marks.len()));
    }
    if !n.is_multiple_of(8) && marks.last().is_some_and(|&m| m >> (n % 8) != 0) {
        return Err(format!("marks past its {n} copies"));
    }
    // No mark on copy 0 and no two marks in a row, across byte boundaries
    // too.
    let mut carry = 1u8; // as if copy -1 were marked
    for (i, &m) in marks.iter().enumerate() {
        let after_mark = m & ((m << 1) | carry);
        if after_mark != 0 {
            let j = i * 8 + after_mark.trailing_zeros() as usize;
            return Err(format!(
                "copy {j} is marked a run's second copy after no single copy"
            ));
        }
        carry = m >> 7;
    }
    Ok(())
}

/// The runs of `n` copies of `len` bytes, copy `j` at `copy(j)` (region
/// offset, address), marks checked ([`check_marks`]): each copy a run of
/// its own, or with the marked copy after it a run of two whose strides
/// are the differences (wrapping: a run that then overflows is refused by
/// the checks of runs). One indexed loop.
pub(crate) fn runs_of_marked_copies(
    n: usize,
    len: u64,
    marks: &[u8],
    copy: impl Fn(usize) -> (u64, u64),
) -> Vec<Run> {
    let marked = |j: usize| marks[j / 8] >> (j % 8) & 1 != 0;
    let pairs: usize = marks.iter().map(|m| m.count_ones() as usize).sum();
    let mut runs = Vec::with_capacity(n - pairs);
    let mut j = 0;
    while j < n {
        let (off, addr) = copy(j);
        let mut run = Run::single(off, addr, len);
        if j + 1 < n && marked(j + 1) {
            let (off2, addr2) = copy(j + 1);
            run.count = 2;
            run.region_stride = off2.wrapping_sub(off);
            run.addr_stride = addr2.wrapping_sub(addr);
            j += 2;
        } else {
            j += 1;
        }
        runs.push(run);
    }
    runs
}

impl Runs {
    /// Whether `other` is the same list: the one shared (a clone of it,
    /// which is a pointer's compare), or one equal to it.
    pub fn same(&self, other: &Runs) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self == other
    }

    /// `runs`, whose storage goes back to `pool` at the end.
    pub fn pooled(runs: Vec<Run>, pool: &RunPool) -> Runs {
        Runs(Arc::new(RunList {
            runs: runs.into(),
            copies: None,
            home: Some(pool.clone()),
        }))
    }

    /// `runs` (storage back to `pool` at the end), with the packed
    /// `copies` they are when there are such (the planner's chunks of
    /// equal blocks): the wire encodes them and the GPU's table is filled
    /// from them without a pass over the runs. `copies` must move exactly
    /// what `runs` move ([`Copies::same_copies_as`]: their own runs, or
    /// with a run of two contiguous copies as one run twice as long, which
    /// the host's memcpy takes in one piece).
    pub fn pooled_with_copies(runs: Vec<Run>, copies: Option<Copies>, pool: &RunPool) -> Runs {
        debug_assert!(copies.as_ref().is_none_or(|c| c.same_copies_as(&runs)));
        Runs(Arc::new(RunList {
            runs: runs.into(),
            copies,
            home: Some(pool.clone()),
        }))
    }

    /// The runs `copies` are, kept as copies until read as runs.
    pub fn from_copies(copies: Copies) -> Runs {
        Runs(Arc::new(RunList {
            runs: std::sync::OnceLock::new(),
            copies: Some(copies),
            home: None,
        }))
    }

    /// The list as packed copies, when it was made from them.
    pub fn copies(&self) -> Option<&Copies> {
        self.0.copies.as_ref()
    }
}

impl std::ops::Deref for Runs {
    type Target = [Run];
    fn deref(&self) -> &[Run] {
        let list = &self.0;
        list.runs
            .get_or_init(|| list.copies.as_ref().map_or_else(Vec::new, Copies::to_runs))
    }
}

impl From<Vec<Run>> for Runs {
    fn from(runs: Vec<Run>) -> Runs {
        Runs(Arc::new(RunList {
            runs: runs.into(),
            copies: None,
            home: None,
        }))
    }
}

impl FromIterator<Run> for Runs {
    fn from_iter<I: IntoIterator<Item = Run>>(iter: I) -> Runs {
        Runs::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl PartialEq for Runs {
    fn eq(&self, other: &Runs) -> bool {
        **self == **other
    }
}

impl Eq for Runs {}

impl fmt::Debug for Runs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

/// Run lists' storage kept for the next plans. A plan of thousands of
/// descriptors has hundreds of KiB of runs; storage freshly taken from the
/// system costs a page fault every 4 KiB, which was most of a preparation's
/// time on the arena path (docs/benchmarks.md, "Figures behind the code").
/// Bounded: lists beyond [`RunPool::KEPT_RUNS`] runs
/// in all are freed.
#[derive(Clone, Default)]
pub struct RunPool(Arc<std::sync::Mutex<Vec<Vec<Run>>>>);

impl RunPool {
    /// The most runs kept in all (24 MiB).
    pub const KEPT_RUNS: usize = 1 << 19;

    /// An empty list with room for `capacity` runs, reused when one is kept.
    pub fn take(&self, capacity: usize) -> Vec<Run> {
        let kept = self.0.locked().pop();
        let mut v = kept.unwrap_or_default();
        v.reserve(capacity);
        v
    }

    fn put(&self, mut v: Vec<Run>) {
        v.clear();
        let mut kept = self.0.locked();
        let held: usize = kept.iter().map(Vec::capacity).sum();
        if held + v.capacity() <= Self::KEPT_RUNS {
            kept.push(v);
        }
    }
}

/// Random packed copies for the tests that check each reader of
/// [`Copies`] against the same reader of the runs they are.
#[cfg(test)]
pub(crate) mod testing {
    use proptest::prelude::*;

    use super::Copies;

    /// Where [`arb_copies`]' addresses mostly lie: 64 KiB from 1 MiB.
    pub(crate) const WINDOW: (u64, u64) = (1 << 20, (1 << 20) + (1 << 16));

    /// Valid packed copies: mostly 4 KiB or short copies, each mostly a
    /// step forward from the one before in [`WINDOW`], now and then
    /// anywhere in it (so a run's second copy may lie below its first),
    /// and now and then an address, a length or a first offset at an edge.
    pub(crate) fn arb_copies() -> impl Strategy<Value = Copies> {
        let len = prop_oneof![4 => Just(4096u64), 4 => 1..5000u64, 1 => (u64::MAX / 4)..u64::MAX];
        let first = prop_oneof![8 => 0..1u64 << 16, 1 => (u64::MAX - (1 << 16))..=u64::MAX];
        // (false, step) steps forward; (true, address) jumps.
        let addr = prop_oneof![
            24 => (0..8192u64).prop_map(|d| (false, d)),
            2 => (WINDOW.0..WINDOW.1).prop_map(|a| (true, a)),
            1 => ((u64::MAX - 8192)..=u64::MAX).prop_map(|a| (true, a)),
        ];
        let copies = proptest::collection::vec((addr, any::<bool>()), 1..40);
        (len, first, copies).prop_filter_map("no such copies", |(len, first, copies)| {
            let mut marks = vec![0u8; copies.len().div_ceil(8)];
            let mut addrs = Vec::with_capacity(copies.len());
            let mut at = WINDOW.0;
            let mut after_mark = true; // no mark on copy 0
            for (j, &((jump, a), mark)) in copies.iter().enumerate() {
                at = if jump { a } else { at.saturating_add(a) };
                addrs.push(at);
                after_mark = mark && !after_mark;
                if after_mark {
                    marks[j / 8] |= 1 << (j % 8);
                }
            }
            Copies::new(len, first, addrs, marks).ok()
        })
    }
}

#[cfg(test)]
mod copies_tests {
    use proptest::prelude::*;

    use super::testing::arb_copies;
    use super::*;

    #[test]
    fn a_list_that_is_no_runs_is_refused_with_what_is_wrong() {
        let bad = |n: usize, len, first, marks: Vec<u8>| {
            Copies::new(len, first, vec![0x1000; n], marks).unwrap_err()
        };
        assert_eq!(bad(0, 4096, 0, vec![]), "0 copies of 4096 bytes");
        assert_eq!(bad(3, 0, 0, vec![0]), "3 copies of 0 bytes");
        assert!(bad(4, u64::MAX / 4, 8, vec![0]).contains("overflow"));
        assert_eq!(bad(9, 4096, 0, vec![0]), "1 mark bytes for 9 copies");
        assert_eq!(bad(3, 4096, 0, vec![0b1000]), "marks past its 3 copies");
        let no_first = "is marked a run's second copy after no single copy";
        assert_eq!(bad(3, 4096, 0, vec![0b001]), format!("copy 0 {no_first}"));
        assert_eq!(bad(3, 4096, 0, vec![0b110]), format!("copy 2 {no_first}"));
        // Copies 7 and 8 marked: a run of three across a mark byte.
        assert_eq!(
            bad(10, 4096, 0, vec![0b1000_0000, 0b01]),
            format!("copy 8 {no_first}")
        );
        // Marks on copies 1, 3 and 8 are three runs of two.
        let ok = Copies::new(
            4096,
            0,
            (0..10).map(|j| j * 8192).collect(),
            vec![0b1010, 0b10],
        );
        assert_eq!(Runs::from_copies(ok.unwrap()).len(), 7);
    }

    proptest! {
        /// The runs a list of copies is moves exactly its copies, in
        /// order, with runs of two only where marked.
        #[test]
        fn copies_are_the_runs_they_make(c in arb_copies()) {
            let runs = Runs::from_copies(c.clone());
            prop_assert!(runs.copies().is_some());
            let mut j = 0usize;
            for r in runs.iter() {
                prop_assert!(r.count == 1 || r.count == 2);
                prop_assert_eq!(r.count == 2, j + 1 < c.addrs().len() && c.marked(j + 1));
                for k in 0..u64::from(r.count) {
                    prop_assert_eq!(r.len, c.copy_len());
                    prop_assert_eq!(r.region_offset + k * r.region_stride, c.first() + j as u64 * c.copy_len());
                    prop_assert_eq!(r.addr.wrapping_add(k.wrapping_mul(r.addr_stride)), c.addrs()[j]);
                    j += 1;
                }
            }
            prop_assert_eq!(j, c.addrs().len());
            // Fit exactly when no run's application range wraps.
            prop_assert_eq!(c.addresses_fit(), runs.iter().all(|r| r.addr_end().is_some()));
        }
    }
}
