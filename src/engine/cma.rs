//! The CMA path in the engine: DRAM on both sides, peers on one host. One
//! copy straight between the application's memory and the peer's, by
//! cross-memory attach (`copy::cma`), with no arena and nothing run in the
//! peer; between two agents of one process, a memory copy.
//!
//! - **Export.** Every DRAM registration carries this process's CMA block
//!   (`conn_info::CmaExport`: boot id, random token, pid and the token's
//!   address).
//! - **Proof.** A peer's block is believed once per peer process: same boot
//!   id, and its token read at its address in its pid
//!   ([`crate::copy::cma::read_remote`]) is the token it published. That one read
//!   proves the same host, the same PID namespace and the permission to
//!   reach the process; anything else (another host, a container with its
//!   own PID namespace, ptrace rules that refuse) leaves the peer to the
//!   other paths.
//! - **Route.** DRAM on both sides, every local descriptor in memory this
//!   agent registered, every remote one in memory of one proven peer, and
//!   the gate (`cma_min_descriptor_count`).
//! - **Post.** Small transfers are copied in the post itself (as UCX's CMA
//!   transport does); larger ones are cut into parts copied by the path's
//!   threads, the last part's thread sending the notification.
//! - **Safety.** A deregistration fails and stops every copy of the process
//!   that touches its memory, on either side, and waits until none does
//!   ([`Cma::quiesce`]); a copy stops between pieces of at most
//!   `copy::cma::MAX_PIECE_BYTES`, and so does a released one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nixl_sys::Agent;

use super::conn_info::{ArenaSeal, CmaExport};
use super::{Descs, MdOwner, MemKind, Op, Range, RawDesc};
use crate::config::Config;
use crate::copy::cma::{self, CmaError, Pair, Target};
use crate::copy::ipc::identity;
use crate::sync::Locked;

/// The bytes of a copy below which the post copies it itself: a hand-off
/// to a thread costs more than it saves there.
pub const INLINE_MAX_BYTES: u64 = 256 << 10;

/// The fewest bytes a part of a copy split over the path's threads holds.
const MIN_PART_BYTES: u64 = 1 << 20;

/// This process's pid and token, where peers read the token to prove who
/// we are: a static, so its address lives as long as the process. A child
/// forked from this process writes its own there at its first export.
static TOKEN: Mutex<(u32, [u8; 16])> = Mutex::new((0, [0; 16]));

/// The CMA block of this process as it is now (a forked child is another
/// process, with a token of its own).
fn current_export() -> Option<CmaExport> {
    let id = identity()?;
    let pid = std::process::id();
    let mut token = TOKEN.locked();
    if *token != (pid, id.process) {
        *token = (pid, id.process);
    }
    Some(CmaExport {
        host: id.host,
        process: token.1,
        pid,
        token_addr: token.1.as_ptr() as u64,
    })
}

/// Every copy of this path in the process that may still touch memory, of
/// every engine: a deregistration waits for those touching its memory,
/// whether it is their local side or, between two agents of this process,
/// their remote side. With the pid that started them (a forked child has
/// none running).
static RUNNING: Mutex<(u32, Vec<Arc<Job>>)> = Mutex::new((0, Vec::new()));

/// The running copies, emptied in a child forked after some started.
fn running() -> std::sync::MutexGuard<'static, (u32, Vec<Arc<Job>>)> {
    let mut r = RUNNING.locked();
    let pid = std::process::id();
    if r.0 != pid {
        *r = (pid, Vec::new());
    }
    r
}

/// A completion notification to send: the inner agent, the peer's inner
/// agent, the message.
pub type Notification = (Agent, Arc<str>, Vec<u8>);

/// A peer process proven reachable (see the module's "Proof").
#[derive(Debug, PartialEq, Eq)]
pub enum CmaPeer {
    /// An agent of this process: a memory copy.
    ThisProcess,
    /// Another process, with where its token lies and what it is, read
    /// again before every copy (see [`CmaPeer::check`]).
    Process {
        pid: libc::pid_t,
        token_addr: u64,
        token: [u8; 16],
    },
}

impl CmaPeer {
    /// Where a copy to or from this peer goes.
    pub fn target(&self) -> Target {
        match *self {
            Self::ThisProcess => Target::ThisProcess,
            Self::Process { pid, .. } => Target::Process(pid),
        }
    }

    /// Whether the pid still belongs to the process proven: after that
    /// process exits, the kernel may give its pid to another one, and a copy
    /// would then reach a stranger's memory. One 16-byte read of the token,
    /// a microsecond or two, before each part of a copy; the pid would have
    /// to be freed and given out again within the part's own copy to slip
    /// past it.
    fn check(&self) -> Result<(), CmaError> {
        let Self::Process {
            pid,
            token_addr,
            token,
        } = *self
        else {
            return Ok(());
        };
        match cma::read_remote::<16>(pid, token_addr) {
            Ok(t) if t == token => Ok(()),
            Ok(_) | Err(CmaError::PeerGone(_)) | Err(CmaError::Unmapped { .. }) => {
                Err(CmaError::PeerGone(pid))
            }
            Err(e) => Err(e),
        }
    }
}

/// Peers by process token: proven reachable, or not.
type Proven = HashMap<[u8; 16], Option<Arc<CmaPeer>>>;

/// The CMA path of one engine.
pub struct Cma {
    enabled: bool,
    /// Peers by process token: proven (`Some`) or not (`None`), once each,
    /// with the pid that proved them (a forked child starts afresh: its
    /// parent is another process to it).
    peers: Mutex<(u32, Proven)>,
    threads: usize,
    /// `cma_max_average_descriptor_size_bytes`, for peers in another
    /// process (0: no limit).
    process_max_average: u64,
    pool: OnceLock<Option<(rayon::ThreadPool, u32)>>,
    spare: SparePairs,
}

/// Pair lists kept for the next preparations: a fresh list of 32,768
/// pairs is 768 KiB of pages never touched, and on a VM each page's first
/// touch costs microseconds (docs/benchmarks.md, "Figures behind the
/// code").
#[derive(Clone, Default)]
struct SparePairs(Arc<Mutex<Vec<Vec<Pair>>>>);

/// Lists kept at most.
const SPARE_LISTS: usize = 8;

impl SparePairs {
    fn take(&self, n: usize) -> Pairs {
        let mut v = self.0.locked().pop().unwrap_or_default();
        v.reserve(n);
        Pairs {
            v,
            spare: self.clone(),
        }
    }
}

/// A transfer's pairs; given back to the spare lists when the last user
/// (the request, its running copy) lets go.
pub struct Pairs {
    v: Vec<Pair>,
    spare: SparePairs,
}

impl std::ops::Deref for Pairs {
    type Target = [Pair];
    fn deref(&self) -> &[Pair] {
        &self.v
    }
}

impl Drop for Pairs {
    fn drop(&mut self) {
        let mut v = std::mem::take(&mut self.v);
        v.clear();
        let mut spare = self.spare.0.locked();
        if spare.len() < SPARE_LISTS {
            spare.push(v);
        }
    }
}

impl std::fmt::Debug for Cma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cma")
            .field("enabled", &self.enabled)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Cma {
    pub fn new(cfg: &Config) -> Self {
        Self {
            enabled: cfg.enabled && cfg.enable_cma,
            peers: Mutex::new((0, HashMap::new())),
            // The cores by default, at most 4.
            threads: super::threads(cfg.cma_threads as usize, |cores| cores.min(4)),
            process_max_average: cfg.cma_max_average_descriptor_size_bytes,
            pool: OnceLock::new(),
            spare: SparePairs::default(),
        }
    }

    /// The block this process's DRAM regions carry; `None` with the path
    /// off or the host unidentifiable.
    pub fn export(&self) -> Option<CmaExport> {
        self.enabled.then(current_export).flatten()
    }

    /// The peer behind a region's CMA block, when it is proven reachable;
    /// each peer process is tried once.
    pub fn peer(&self, e: &CmaExport) -> Option<Arc<CmaPeer>> {
        let ours = self.export()?;
        if e.host != ours.host {
            return None;
        }
        let mut peers = self.peers.locked();
        if peers.0 != ours.pid {
            *peers = (ours.pid, HashMap::new());
        }
        peers
            .1
            .entry(e.process)
            .or_insert_with(|| {
                let peer = if e.process == ours.process && e.pid == ours.pid {
                    CmaPeer::ThisProcess
                } else {
                    let pid = libc::pid_t::try_from(e.pid).ok()?;
                    match cma::read_remote::<16>(pid, e.token_addr) {
                        Ok(t) if t == e.process => CmaPeer::Process {
                            pid,
                            token_addr: e.token_addr,
                            token: e.process,
                        },
                        Ok(_) => {
                            tracing::info!(pid, "CMA path off for a peer: its pid here is another process (another PID namespace?)");
                            return None;
                        }
                        Err(err) => {
                            tracing::info!(pid, "CMA path off for a peer: {err}");
                            return None;
                        }
                    }
                };
                Some(Arc::new(peer))
            })
            .clone()
    }

    /// The copies of a transfer when it can take this path, in one pass
    /// over NIXL's two descriptor arrays: DRAM on both sides (checked by
    /// the caller), every local descriptor in memory this agent registered,
    /// every remote one in memory of one proven peer, each pair of one
    /// length and inside its regions. Each distinct metadata handle is
    /// looked up once. Declines (`None`) at the first descriptor that is
    /// not plainly so; the caller's checked path then words any error.
    /// Why one pass: on cold caches (a new request every step) each pass
    /// over 32,768 descriptors reads 2 MiB, and four separate checks made
    /// the preparation 2.5x UCX's (docs/benchmarks.md, "The CMA path").
    pub fn prepare(&self, op: Op, local: &Descs<'_>, remote: &Descs<'_>) -> Option<CmaXfer> {
        if !self.enabled {
            return None;
        }
        let (lraw, rraw) = (local.raw(), remote.raw());
        if lraw.len() != rraw.len() {
            return None;
        }
        let mut peer: Option<&Arc<CmaPeer>> = None;
        // Between two processes, the most bytes in all (the average size
        // limit), checked after each run of descriptors.
        let mut limit = u64::MAX;
        let mut pairs = self.spare.take(lraw.len());
        let mut spans = Spans::default();
        let mut at = 0;
        // One run at a time: the descriptors that share both sides'
        // handles (a region's blocks, one after the other in vLLM's lists)
        // have their regions looked up once, and the inner loop carries
        // only the two regions and the sums.
        while let (Some(l0), Some(r0)) = (lraw.get(at), rraw.get(at)) {
            let m = local.md(l0.md)?;
            if m.kind != MemKind::Dram || !matches!(m.owner, MdOwner::Registered { .. }) {
                return None;
            }
            let lw = m.range;
            let m = remote.md(r0.md)?;
            let MdOwner::Remote { cma: Some(p), .. } = &m.owner else {
                return None;
            };
            match peer {
                Some(q) if !Arc::ptr_eq(q, p) => return None,
                Some(_) => {}
                None => {
                    if matches!(**p, CmaPeer::Process { .. }) && self.process_max_average > 0 {
                        limit = self.process_max_average.saturating_mul(lraw.len() as u64);
                    }
                    peer = Some(p);
                }
            }
            let rw = m.range;
            at += walk_run(&lraw[at..], &rraw[at..], lw, rw, &mut pairs.v, &mut spans)?;
            if spans.bytes > limit {
                return None;
            }
        }
        Some(CmaXfer {
            read: op == Op::Read,
            peer: peer?.clone(),
            pairs: Arc::new(pairs),
            bytes: spans.bytes,
            span: spans.local,
            remote_span: spans.remote,
            job: None,
        })
    }

    /// A bounce arena's chunk write into a peer's host arena on this host
    /// (`dataplane::DataPlane::post_write`): `len` bytes from this
    /// process's `local` address to the peer's `remote`, cut into pieces
    /// the path's threads share (one thread alone falls far short of the
    /// memory's bandwidth: docs/benchmarks.md). `None` with the path off.
    /// The caller checked both ends against the two arenas.
    pub fn chunk_write(
        &self,
        peer: Arc<CmaPeer>,
        local: u64,
        remote: u64,
        len: u64,
    ) -> Option<CmaXfer> {
        if !self.enabled || len == 0 {
            return None;
        }
        let piece = len
            .div_ceil(self.threads.max(1) as u64)
            .max(MIN_PART_BYTES)
            .min(len);
        let mut pairs = self.spare.take(len.div_ceil(piece) as usize);
        let mut at = 0;
        while at < len {
            let n = piece.min(len - at);
            pairs.v.push(Pair {
                local: local + at,
                remote: remote + at,
                len: n,
            });
            at += n;
        }
        Some(CmaXfer {
            read: false,
            peer,
            pairs: Arc::new(pairs),
            bytes: len,
            span: (local, local + len),
            remote_span: (remote, remote + len),
            job: None,
        })
    }

    /// Starts a prepared copy. Returns whether it already ended (copied in
    /// the post: `Some(result)`), else it runs on the path's threads and
    /// [`CmaXfer::outcome`] tells when it ends. `notify` is sent to the
    /// peer after the bytes are in place, unless the request was released
    /// or timed out first.
    pub fn post(
        &self,
        x: &mut CmaXfer,
        notify: Option<Notification>,
    ) -> Option<Result<(), String>> {
        let pool = (x.bytes > INLINE_MAX_BYTES).then(|| self.pool()).flatten();
        let parts = match pool {
            Some(_) => cma::split(&x.pairs, self.threads, MIN_PART_BYTES),
            None => std::iter::once(0..x.pairs.len()).collect(),
        };
        let job = Arc::new(Job {
            read: x.read,
            peer: x.peer.clone(),
            pairs: x.pairs.clone(),
            span: x.span,
            remote_span: x.remote_span,
            left: AtomicUsize::new(parts.len()),
            cancelled: AtomicBool::new(false),
            outcome: OnceLock::new(),
            failure: Mutex::new(None),
            notify: Mutex::new(notify),
            started: Instant::now(),
        });
        x.job = Some(job.clone());
        running().1.push(job.clone());
        match pool {
            None => {
                job.run(0..job.pairs.len());
                job.outcome.get().cloned()
            }
            Some(pool) => {
                for part in parts {
                    let job = job.clone();
                    pool.spawn(move || job.run(part));
                }
                None
            }
        }
    }

    /// The path's threads, started at the first copy that needs them; none
    /// in a child forked after they started (a fork copies only the
    /// forking thread): there the post copies alone.
    fn pool(&self) -> Option<&rayon::ThreadPool> {
        let (pool, pid) = self
            .pool
            .get_or_init(|| {
                if self.threads < 2 {
                    return None;
                }
                rayon::ThreadPoolBuilder::new()
                    .num_threads(self.threads)
                    .thread_name(|i| format!("bounce-cma-{i}"))
                    .build()
                    .map_err(|e| {
                        tracing::warn!("CMA copy threads not started ({e}); copies run in the post")
                    })
                    .ok()
                    .map(|p| (p, std::process::id()))
            })
            .as_ref()?;
        (*pid == std::process::id()).then_some(pool)
    }

    /// Stops every copy of this path in this process that touches `range`
    /// of this process's memory (as its local side, or as the remote side
    /// of a copy between two agents of this process), and waits until none
    /// does, for at most `bound`; whether none does. A deregistration calls
    /// it: the memory may be freed once it returns, so a copy still using
    /// it fails instead.
    pub fn quiesce(&self, range: Range, bound: Duration) -> bool {
        let (lo, hi) = (
            range.addr as u64,
            range.addr.saturating_add(range.len) as u64,
        );
        let touches = |j: &Job| {
            let overlaps = |(a, b): (u64, u64)| a < hi && lo < b;
            overlaps(j.span) || (*j.peer == CmaPeer::ThisProcess && overlaps(j.remote_span))
        };
        let deadline = Instant::now() + bound;
        let mut stopped = false;
        loop {
            let busy: Vec<Arc<Job>> = running().1.iter().filter(|j| touches(j)).cloned().collect();
            if busy.is_empty() {
                return true;
            }
            if !stopped {
                for j in &busy {
                    j.fail("memory it copies was deregistered while it ran".into());
                }
                stopped = true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// A transfer prepared on the CMA path.
pub struct CmaXfer {
    read: bool,
    peer: Arc<CmaPeer>,
    pairs: Arc<Pairs>,
    pub bytes: u64,
    /// The lowest and highest local address the copies touch, and remote.
    span: (u64, u64),
    remote_span: (u64, u64),
    job: Option<Arc<Job>>,
}

impl CmaXfer {
    /// Whether a posted copy still runs: a part may still be copying even
    /// after the request failed (a timeout), so a new post waits for it.
    pub fn running(&self) -> bool {
        self.job
            .as_ref()
            .is_some_and(|j| j.left.load(Ordering::Acquire) > 0)
    }

    /// Whether it was posted.
    pub fn posted(&self) -> bool {
        self.job.is_some()
    }

    /// The posted copy's result once it ended; a copy that runs longer
    /// than `limit` is stopped and fails.
    pub fn outcome(&self, limit: Duration) -> Option<Result<(), String>> {
        let job = self.job.as_ref()?;
        if job.outcome.get().is_none() && job.started.elapsed() > limit {
            job.fail(format!(
                "the CMA copy did not end within {} ms",
                limit.as_millis()
            ));
        }
        job.outcome.get().cloned()
    }

    /// Stops a copy still running (at its next system call; no
    /// notification is sent).
    pub fn cancel(&self) -> bool {
        match &self.job {
            Some(j) if j.outcome.get().is_none() => {
                j.fail(CmaError::Cancelled.to_string());
                true
            }
            _ => false,
        }
    }
}

/// One posted copy, in one or more parts.
struct Job {
    read: bool,
    peer: Arc<CmaPeer>,
    pairs: Arc<Pairs>,
    span: (u64, u64),
    remote_span: (u64, u64),
    /// Parts not ended yet.
    left: AtomicUsize,
    cancelled: AtomicBool,
    /// Set once: when every part ended, or when it failed or timed out.
    outcome: OnceLock<Result<(), String>>,
    failure: Mutex<Option<String>>,
    /// The notification to send; its lock also orders the end against a
    /// failure, a release or a timeout ([`Job::fail`]): whichever takes it
    /// first decides, so none is sent after any of those.
    notify: Mutex<Option<Notification>>,
    started: Instant,
}

impl Job {
    fn run(self: &Arc<Self>, part: std::ops::Range<usize>) {
        // SAFETY: the local ranges are memory this agent registered, checked
        // against their registrations when the request was prepared; a
        // deregistration of them stops this copy and waits for it to end
        // (`Cma::quiesce`, over every copy of the process), and so does one
        // of the remote ranges when the peer is an agent of this process.
        // The peer's pid is checked to be still the process proven first.
        let r = self.peer.check().and_then(|()| unsafe {
            cma::copy(
                self.peer.target(),
                self.read,
                &self.pairs[part],
                &self.cancelled,
            )
        });
        if let Err(e) = r {
            // The other parts stop too.
            self.cancelled.store(true, Ordering::SeqCst);
            let mut f = self.failure.locked();
            f.get_or_insert_with(|| e.to_string());
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        // The last part: the whole copy ended.
        let failure = self.failure.locked().take();
        match failure {
            None => {
                let mut notify = self.notify.locked();
                if !self.cancelled.load(Ordering::SeqCst) {
                    if let Some((inner, peer, message)) = notify.take() {
                        if let Err(e) = inner.send_notification(&peer, &message, None) {
                            tracing::warn!(%peer, "sending a CMA transfer's notification: {e}");
                        }
                    }
                    let _ = self.outcome.set(Ok(()));
                }
            }
            Some(why) => self.fail(why),
        }
        // A failure set the outcome before (`fail`); a cancel that found no
        // failure here means a release or a timeout did.
        if self.outcome.get().is_none() {
            self.fail(CmaError::Cancelled.to_string());
        }
        running().1.retain(|j| !Arc::ptr_eq(j, self));
    }

    /// Ends the copy as failed, unless it ended first: a part still running
    /// stops at its next piece, and nothing is notified.
    fn fail(&self, why: String) {
        let mut notify = self.notify.locked();
        if self.outcome.get().is_some() {
            return;
        }
        self.cancelled.store(true, Ordering::SeqCst);
        notify.take();
        let _ = self.outcome.set(Err(why));
    }
}

/// What a transfer's copies cover: the bytes in all, and the lowest and
/// highest address on each side (empty: `(u64::MAX, 0)`).
struct Spans {
    bytes: u64,
    local: (u64, u64),
    remote: (u64, u64),
}

impl Default for Spans {
    fn default() -> Self {
        Spans {
            bytes: 0,
            local: (u64::MAX, 0),
            remote: (u64::MAX, 0),
        }
    }
}

/// One run of [`Cma::prepare`]: the descriptors from the first of
/// `local` and `remote` on that share its two handles, of one local region
/// `lw` and one remote region `rw`, appended to `pairs` (merged where they
/// continue the last) and added to `spans`. How many there were (at least
/// one), or `None` at the first pair of two lengths or outside its region
/// (no wrap, the region's device).
fn walk_run(
    local: &[RawDesc],
    remote: &[RawDesc],
    lw: Range,
    rw: Range,
    pairs: &mut Vec<Pair>,
    spans: &mut Spans,
) -> Option<usize> {
    let (lmd, rmd) = (local.first()?.md, remote.first()?.md);
    let inside = |d: &RawDesc, w: &Range| {
        d.dev == w.dev && d.len <= w.len && d.addr.wrapping_sub(w.addr) <= w.len - d.len
    };
    let (mut lo, mut hi) = spans.local;
    let (mut rlo, mut rhi) = spans.remote;
    let mut bytes = spans.bytes;
    // The pair being merged into (the list's last, so that runs merge
    // too), kept out of the list until a pair does not continue it (len 0:
    // none yet; merged into, it is the next pair).
    let mut cur = pairs.pop().unwrap_or(Pair {
        local: 0,
        remote: 0,
        len: 0,
    });
    let mut run = 0;
    for (l, r) in local.iter().zip(remote) {
        if l.md != lmd || r.md != rmd {
            break;
        }
        run += 1;
        if l.len != r.len || !inside(l, &lw) || !inside(r, &rw) {
            return None;
        }
        // (Inside their regions, neither end wraps.)
        let (la, ra, len) = (l.addr as u64, r.addr as u64, l.len as u64);
        if len == 0 {
            continue;
        }
        lo = lo.min(la);
        hi = hi.max(la.wrapping_add(len));
        rlo = rlo.min(ra);
        rhi = rhi.max(ra.wrapping_add(len));
        bytes += len;
        let p = Pair {
            local: la,
            remote: ra,
            len,
        };
        match cur.merged(&p) {
            Some(m) => cur = m,
            None => {
                if cur.len != 0 {
                    pairs.push(cur);
                }
                cur = p;
            }
        }
    }
    if cur.len != 0 {
        pairs.push(cur);
    }
    *spans = Spans {
        bytes,
        local: (lo, hi),
        remote: (rlo, rhi),
    };
    Some(run)
}

/// Whether `seal` lies at its address in process `pid`, naming a host
/// arena at `base` ([`ArenaSeal`]: how an owner checks a READ's data path
/// before writing into the reader's arena by cross-memory attach).
pub fn seal_found(pid: libc::pid_t, seal: &ArenaSeal, base: u64) -> Result<bool, CmaError> {
    Ok(cma::read_remote::<32>(pid, seal.addr)? == seal.image(base))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cma() -> Cma {
        Cma::new(&Config::default())
    }

    /// A seal is believed only where it lies, naming that arena: a data
    /// path with another base, length or token, or an address holding
    /// something else or nothing, is not.
    #[test]
    fn an_arena_seal_is_believed_only_where_it_lies() {
        let pid = std::process::id() as libc::pid_t;
        let base = 0x7f00_1234_0000;
        let mut seal = ArenaSeal {
            addr: 0,
            token: [9; 16],
            len: 1 << 28,
        };
        let kept = Box::new(seal.image(base));
        seal.addr = kept.as_ptr() as u64;
        assert!(seal_found(pid, &seal, base).unwrap());
        assert!(
            !seal_found(pid, &seal, base + 4096).unwrap(),
            "another base"
        );
        let longer = ArenaSeal {
            len: 1 << 29,
            ..seal
        };
        assert!(!seal_found(pid, &longer, base).unwrap(), "another length");
        let forged = ArenaSeal {
            token: [8; 16],
            ..seal
        };
        assert!(!seal_found(pid, &forged, base).unwrap(), "another token");
        let elsewhere = ArenaSeal {
            addr: seal.addr + 8,
            ..seal
        };
        assert!(
            !seal_found(pid, &elsewhere, base).unwrap(),
            "another address"
        );
        let unmapped = ArenaSeal { addr: 8, ..seal };
        assert!(
            seal_found(pid, &unmapped, base).is_err(),
            "nothing mapped there"
        );
    }

    #[test]
    fn a_peer_is_believed_only_where_its_token_lies() {
        let c = cma();
        let Some(ours) = c.export() else {
            eprintln!("SKIP: no boot id here, so no CMA export");
            return;
        };
        // This process: a memory copy.
        let me = c.peer(&ours).expect("this process");
        assert_eq!(*me, CmaPeer::ThisProcess);
        // Another host: not tried.
        let elsewhere = CmaExport {
            host: [0xee; 16],
            process: [1; 16],
            ..ours
        };
        assert!(c.peer(&elsewhere).is_none());
        // A process whose token is not where it says (here: our own pid,
        // whose token differs): refused, and remembered.
        let forged = CmaExport {
            process: [0x5a; 16],
            ..ours
        };
        assert!(c.peer(&forged).is_none());
        assert!(c.peer(&forged).is_none());
        // A pid with no process behind it.
        let gone = CmaExport {
            process: [0x5b; 16],
            pid: i32::MAX as u32,
            ..ours
        };
        assert!(c.peer(&gone).is_none());
    }

    /// A copy between two buffers of this process, prepared by hand.
    fn xfer(c: &Cma, from: &[u8], to: &mut [u8]) -> CmaXfer {
        let mut pairs = c.spare.take(1);
        pairs.v.push(Pair {
            local: from.as_ptr() as u64,
            remote: to.as_mut_ptr() as u64,
            len: from.len() as u64,
        });
        let span = |b: &[u8]| (b.as_ptr() as u64, b.as_ptr() as u64 + b.len() as u64);
        CmaXfer {
            read: false,
            peer: Arc::new(CmaPeer::ThisProcess),
            pairs: Arc::new(pairs),
            bytes: from.len() as u64,
            span: span(from),
            remote_span: span(to),
            job: None,
        }
    }

    #[test]
    fn a_copy_stops_once_the_peer_pid_is_another_process() {
        // This process stands for the peer, through its pid; the token
        // changing stands for the pid passing to another process.
        let c = cma();
        let token = Box::new(std::sync::Mutex::new([7u8; 16]));
        let addr = token.locked().as_ptr() as u64;
        let me = libc::pid_t::try_from(std::process::id()).unwrap();
        let from = vec![1u8; 4096];
        let mut to = vec![0u8; 4096];
        let mut x = xfer(&c, &from, &mut to);
        x.peer = Arc::new(CmaPeer::Process {
            pid: me,
            token_addr: addr,
            token: [7; 16],
        });
        match c.post(&mut x, None) {
            Some(Ok(())) => assert_eq!(to, from),
            Some(Err(e)) if e.contains("not permitted") => {
                eprintln!("SKIP: {e}");
                return;
            }
            other => panic!("{other:?}"),
        }
        to.fill(0);
        *token.locked() = [8; 16];
        let mut x = CmaXfer {
            peer: x.peer.clone(),
            ..xfer(&c, &from, &mut to)
        };
        let r = c.post(&mut x, None).expect("copied in the post");
        assert_eq!(r, Err(CmaError::PeerGone(me).to_string()));
        assert!(to.iter().all(|&b| b == 0), "nothing reached the stranger");
    }

    #[test]
    fn a_deregistration_stops_a_copy_into_its_memory_and_waits_for_it() {
        let c = Cma::new(&Config {
            cma_threads: 2,
            ..Config::default()
        });
        if c.threads < 2 {
            eprintln!("SKIP: one core, no copy threads");
            return;
        }
        let from = vec![7u8; 512 << 20];
        let mut to = vec![0u8; 512 << 20];
        let range = Range {
            addr: to.as_ptr() as usize,
            len: to.len(),
            dev: 0,
        };
        let mut x = xfer(&c, &from, &mut to);
        assert!(c.post(&mut x, None).is_none(), "copied on the threads");
        // The peer agent of this process deregisters the destination.
        let t = Instant::now();
        assert!(c.quiesce(range, Duration::from_secs(5)));
        assert!(!x.running(), "no part still copies");
        let waited = t.elapsed();
        match x.outcome(Duration::from_secs(60)) {
            Some(Err(e)) => assert!(e.contains("deregistered"), "{e}"),
            // It may have ended before the stop.
            Some(Ok(())) => assert!(to.iter().all(|&b| b == 7)),
            None => panic!("no outcome after the wait"),
        }
        eprintln!("stopped and quiet after {waited:?}");
        drop(x);
        drop(to);
    }

    #[test]
    fn a_forked_child_is_not_its_parent() {
        let c = cma();
        let Some(parent) = c.export() else {
            return;
        };
        // SAFETY: the child only reads files, takes locks no other thread
        // of this test holds for long, and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            let ok = match c.export() {
                Some(child) => {
                    child.process != parent.process
                        && child.pid != parent.pid
                        && c.peer(&parent).is_some_and(|p| *p != CmaPeer::ThisProcess)
                }
                None => false,
            };
            // SAFETY: ends the child without running the parent's exit
            // handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut status = 0;
        loop {
            // SAFETY: waits for our own child.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            if Instant::now() > deadline {
                // SAFETY: our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("the forked child did not end");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child passed for its parent (status {status})"
        );
    }

    #[test]
    fn nothing_is_exported_with_the_path_off() {
        let off = Config {
            enable_cma: false,
            ..Config::default()
        };
        assert!(Cma::new(&off).export().is_none());
        let disabled = Config {
            enabled: false,
            ..Config::default()
        };
        assert!(Cma::new(&disabled).export().is_none());
    }
}

#[cfg(test)]
mod prepare_tests {
    use super::*;
    use crate::engine::testing::{at, md, registered, REGION};
    use crate::engine::Md;

    /// Regions of this agent and of a peer (this very process), made by
    /// hand: the `Md`s NIXL's handles resolve to.
    struct Regions {
        local: Vec<Md>,
        remote: Vec<Md>,
    }

    /// `n` regions a side, each side's one right after the other (so that
    /// runs can merge), the local ones from 1 << 32, the remote ones from
    /// 1 << 40.
    fn regions(n: usize) -> Regions {
        let peer = Arc::new(CmaPeer::ThisProcess);
        let remote = || MdOwner::Remote {
            agent: String::new(),
            bounce: None,
            staged: None,
            peer: None,
            mapped: OnceLock::new(),
            cma: Some(peer.clone()),
        };
        Regions {
            local: (0..n)
                .map(|i| md((1 << 32) + i * REGION, registered()))
                .collect(),
            remote: (0..n)
                .map(|i| md((1 << 40) + i * REGION, remote()))
                .collect(),
        }
    }

    fn prepare(c: &Cma, l: &[RawDesc], r: &[RawDesc]) -> Option<CmaXfer> {
        let resolve = |p: *const std::ffi::c_void| p as *const Md;
        // SAFETY: every handle is an `Md` of the caller's `Regions`, alive
        // for the call.
        let (ld, rd) = unsafe {
            (
                Descs::new(MemKind::Dram, l, &resolve),
                Descs::new(MemKind::Dram, r, &resolve),
            )
        };
        c.prepare(Op::Write, &ld, &rd)
    }

    #[test]
    fn runs_of_regions_merge_and_span_what_they_touch() {
        let c = Cma::new(&Config::default());
        let g = regions(2);
        let (l0, l1, r0, r1) = (&g.local[0], &g.local[1], &g.remote[0], &g.remote[1]);
        let l = [
            at(l0, 0, 4096),
            at(l0, 4096, 4096),
            at(l0, 4 * 4096, 0),
            at(l0, REGION - 4096, 4096),
            at(l1, 0, 4096),
            at(l1, 8192, 4096),
        ];
        let r = [
            at(r0, 0, 4096),
            at(r0, 4096, 4096),
            at(r0, 9 * 4096, 0),
            // The end of the first regions, then the start of the next on
            // both sides: one copy across the two runs.
            at(r0, REGION - 4096, 4096),
            at(r1, 0, 4096),
            at(r1, 4096, 4096),
        ];
        let x = prepare(&c, &l, &r).expect("prepared");
        let pair = |l: &RawDesc, r: &RawDesc, len| Pair {
            local: l.addr as u64,
            remote: r.addr as u64,
            len,
        };
        assert_eq!(
            &x.pairs[..],
            [
                pair(&l[0], &r[0], 8192),
                pair(&l[3], &r[3], 8192),
                pair(&l[5], &r[5], 4096),
            ]
        );
        assert_eq!(x.bytes, 5 * 4096);
        let end = |d: &RawDesc| (d.addr + d.len) as u64;
        assert_eq!(x.span, (l[0].addr as u64, end(&l[5])));
        assert_eq!(x.remote_span, (r[0].addr as u64, end(&r[5])));
    }

    #[test]
    fn anything_not_plainly_a_cma_copy_is_declined() {
        let c = Cma::new(&Config::default());
        let g = regions(1);
        let (l0, r0) = (&g.local[0], &g.remote[0]);
        let good = || (vec![at(l0, 0, 4096); 3], vec![at(r0, 0, 4096); 3]);
        assert!(prepare(&c, &good().0, &good().1).is_some());
        let mut cases: Vec<(&str, Vec<RawDesc>, Vec<RawDesc>)> = Vec::new();
        let (mut l, r) = good();
        l[2].len = 8192;
        cases.push(("two lengths", l, r));
        let (l, mut r) = good();
        r[1] = at(r0, REGION - 4096, 8192);
        cases.push(("past the remote region", l, r));
        let (mut l, r) = good();
        l[1].addr = l0.range.addr - 4096;
        cases.push(("below the local region", l, r));
        let (mut l, r) = good();
        l[2].dev = 1;
        cases.push(("another device", l, r));
        let (mut l, r) = good();
        l[1].md = std::ptr::null();
        cases.push(("a null handle", l, r));
        // A remote region as the local side: not memory this agent
        // registered.
        let (l, r) = good();
        cases.push(("the sides swapped", r.clone(), l));
        let (l, mut r) = good();
        r.pop();
        cases.push(("two counts", l, r));
        for (what, l, r) in cases {
            assert!(prepare(&c, &l, &r).is_none(), "{what}");
        }
    }

    /// Not a benchmark: how long one preparation's walk takes here, warm.
    /// `cargo test --release --lib cma_prepare_cost -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn cma_prepare_cost() {
        let c = Cma::new(&Config::default());
        // vLLM's TP=8 at 1024 tokens: 64 regions x 64 blocks of 4 KiB.
        let (blocks, len) = (64usize, 4096usize);
        let g = regions(64);
        let (mut l, mut r) = (Vec::new(), Vec::new());
        for (lm, rm) in g.local.iter().zip(&g.remote) {
            for b in 0..blocks {
                l.push(at(lm, (b * 7919) % 128 * len, len));
                r.push(at(rm, (b * 104_729) % 128 * len, len));
            }
        }
        let mut best = u128::MAX;
        for _ in 0..2000 {
            let t = Instant::now();
            let x = prepare(&c, &l, &r).expect("prepared");
            best = best.min(t.elapsed().as_nanos());
            drop(x);
        }
        println!(
            "Cma::prepare: {} descriptors in {:.1} us ({:.2} ns each, best of 2000)",
            l.len(),
            best as f64 / 1e3,
            best as f64 / l.len() as f64
        );
        // Cold: the caches flushed by a pass over 64 MiB first, as a
        // request after a transfer finds them.
        let mut sweep = vec![0u8; 64 << 20];
        let mut cold = Vec::new();
        for i in 0..50u8 {
            sweep
                .iter_mut()
                .step_by(64)
                .for_each(|b| *b = b.wrapping_add(i));
            let t = Instant::now();
            let x = prepare(&c, &l, &r).expect("prepared");
            cold.push(t.elapsed().as_nanos());
            drop(x);
        }
        cold.sort_unstable();
        println!(
            "Cma::prepare, cold: {:.1} us (median of 50)",
            cold[25] as f64 / 1e3
        );
        std::hint::black_box(&sweep);
    }
}
