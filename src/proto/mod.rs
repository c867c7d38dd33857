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
#[derive(Clone, Default)]
pub struct Runs(Arc<RunList>);

#[derive(Default)]
struct RunList {
    runs: Vec<Run>,
    home: Option<RunPool>,
}

impl Drop for RunList {
    fn drop(&mut self) {
        if let Some(pool) = self.home.take() {
            pool.put(std::mem::take(&mut self.runs));
        }
    }
}

impl Runs {
    /// `runs`, whose storage goes back to `pool` at the end.
    pub fn pooled(runs: Vec<Run>, pool: &RunPool) -> Runs {
        Runs(Arc::new(RunList {
            runs,
            home: Some(pool.clone()),
        }))
    }
}

impl std::ops::Deref for Runs {
    type Target = [Run];
    fn deref(&self) -> &[Run] {
        &self.0.runs
    }
}

impl From<Vec<Run>> for Runs {
    fn from(runs: Vec<Run>) -> Runs {
        Runs(Arc::new(RunList { runs, home: None }))
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
