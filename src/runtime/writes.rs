//! Chunk writes: each posted through the data plane (one write from this
//! arena into the peer's), then polled until NIXL reports it complete at
//! the target.
//!
//! Where they are posted and polled (`chunk_writes`, [`IoThreadUse`]):
//! - **On the IO thread**: the reactor posts the write as soon as it sees
//!   the gather finished, polls it between its other events, and sends
//!   DATA on the turn that sees it done. No thread hand-off, which a lone
//!   request feels (two thread wake-ups a chunk). Only where a post merely
//!   queues work (a device arena: a CUDA IPC copy, an RDMA write).
//! - **On the writer thread**: where a post may carry the whole send (a
//!   host arena: UCX over TCP sends inside the post, which on the IO thread
//!   would stall every control message and the next gather), and under
//!   load, where the IO thread is the bottleneck and a post costs it tens
//!   of microseconds (docs/benchmarks.md, "Figures behind the code").
//!
//! Either way, a write that may still be running keeps its handle and the
//! arena's registration: after the quiescence bound they are left to the
//! process (leaked), never released under a transport that may still read
//! the arena.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{next_job, precise_timers, Shared, QUIESCE_BOUND};
use crate::config::IoThreadUse;
use crate::dataplane::{ChunkWrite, DataPlane, DataPlaneError, PeerArena, WriteState};
use crate::proto::{ChunkRef, PeerId};
use crate::sync::Locked;

/// A write of `len` bytes from local arena offset `local` into `arena` at
/// offset `remote`, for `chunk`.
pub(super) struct WriteJob {
    pub chunk: ChunkRef,
    pub arena: PeerArena,
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

pub(super) enum WriteOutcome {
    Done(ChunkRef),
    Failed(ChunkRef, DataPlaneError),
}

/// Why a chunk write was not posted (it never will be).
#[derive(Debug, thiserror::Error)]
pub(super) enum PostError {
    /// The data plane refused or failed the post.
    #[error(transparent)]
    DataPlane(#[from] DataPlaneError),
    /// No data path to the peer was loaded.
    #[error("no data path to peer {0}")]
    NoDataPath(PeerId),
    /// The writer thread ended (a panic).
    #[error("the writer thread is gone")]
    WriterGone,
    /// The writer is shutting down.
    #[error("shutting down")]
    ShuttingDown,
    /// A failpoint (tests) failed it.
    #[error("failpoint {0}")]
    Failpoint(&'static str),
}

/// How long after the latest post on the IO thread its writes are polled
/// without pause; after that (a slow transport, a large chunk across
/// hosts) the reactor pauses [`SLOW_WRITE_PAUSE`] between polls, as the
/// writer thread does.
const FAST_WRITE: Duration = Duration::from_millis(1);
/// The pause between polls of writes older than [`FAST_WRITE`].
const SLOW_WRITE_PAUSE: Duration = Duration::from_micros(20);
/// Writes older than this (stuck, or a forgotten peer's that must stay
/// pinned) no longer keep the reactor polling: it waits for its next event
/// as when idle (at most `IDLE_WAIT`) and polls them then.
const STALE_WRITE: Duration = Duration::from_millis(100);
/// A post on the IO thread slower than this, [`SLOW_POSTS_OF_LAST`].0
/// times among the last [`SLOW_POSTS_OF_LAST`].1, means the transport
/// sends inside the post (UCX staging device memory through TCP, say):
/// under [`IoThreadUse::WhenIdle`] the writer thread then takes every
/// later post.
const SLOW_POST: Duration = Duration::from_micros(200);
/// One slow post proves nothing (a thread preempted once); most of a few
/// do, even when a short chunk's post is fast among them.
const SLOW_POSTS_OF_LAST: (u32, u32) = (3, 8);

/// Whether the IO thread's posts block it, judged from the durations of
/// its recent posts. The first post to each peer is not judged: it opens
/// the peer's mapping (UCX's cuda_ipc: most of a millisecond), once, and a
/// fan-out to new peers would otherwise look like a slow transport.
#[derive(Debug, Default)]
struct SlowPosts {
    /// Bit i: the i-th most recent judged post was slow.
    recent: u8,
    /// The peers (their inner agents) posted to from the IO thread.
    seen: std::collections::HashSet<String>,
}

impl SlowPosts {
    /// Notes a post to `peer` that took `took`; true: the posts block the
    /// IO thread.
    fn blocking(&mut self, peer: &str, took: Duration) -> bool {
        if !self.seen.contains(peer) {
            self.seen.insert(peer.to_string());
            return false;
        }
        let (slow, of_last) = SLOW_POSTS_OF_LAST;
        let window = ((1u16 << of_last) - 1) as u8;
        self.recent = ((self.recent << 1) | u8::from(took > SLOW_POST)) & window;
        self.recent.count_ones() >= slow
    }
}

pub(super) struct ChunkWriter {
    /// The engine's agent, for the logs.
    agent: String,
    data: Arc<DataPlane>,
    posting: IoThreadUse,
    /// Writes posted here.
    here: Vec<Pending>,
    /// The writer thread (none for [`IoThreadUse::Always`]).
    thread: Option<WriterThread>,
    /// Jobs handed to the writer thread whose outcome has not come back.
    handed: usize,
    /// The IO thread's posts, judged for [`IoThreadUse::WhenIdle`].
    slow_posts: SlowPosts,
    shared: Arc<Shared>,
}

struct WriterThread {
    /// `None` once closed.
    jobs: Option<Sender<WriteJob>>,
    done: Receiver<WriteOutcome>,
    handles: Vec<JoinHandle<()>>,
}

/// Posts one write, counting the post's time.
fn post(data: &DataPlane, shared: &Shared, j: &WriteJob) -> Result<ChunkWrite, DataPlaneError> {
    let t = Instant::now();
    let posted = data.post_write(&j.arena, j.local, j.remote, j.len);
    let c = &shared.counters;
    c.write_post_ns
        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    if let Ok(ChunkWrite::Cma(_)) = &posted {
        c.chunk_writes_cma.fetch_add(1, Ordering::Relaxed);
    }
    posted
}

/// A write posted and not yet seen finished: its chunk, its handle, when it
/// was posted.
type Pending = (ChunkRef, ChunkWrite, Instant);

/// Polls `pending` once each; the finished ones leave it, their outcomes
/// passed to `report`. Returns whether any finished.
fn poll_pending(
    data: &DataPlane,
    pending: &mut Vec<Pending>,
    mut report: impl FnMut(WriteOutcome),
) -> bool {
    let mut any = false;
    let mut i = 0;
    while i < pending.len() {
        let outcome = match data.poll(&pending[i].1) {
            WriteState::InProgress => {
                i += 1;
                continue;
            }
            WriteState::Done => WriteOutcome::Done(pending[i].0),
            WriteState::Failed(e) => WriteOutcome::Failed(pending[i].0, e),
        };
        any = true;
        pending.swap_remove(i);
        report(outcome);
    }
    any
}

impl ChunkWriter {
    /// Writes through `data`, posted as `posting` says, for the engine of
    /// agent `agent`. The writer thread (unless every write is posted here)
    /// wakes the reactor with each outcome; `spin`: how long it polls for
    /// the next job before it blocks; `delay`: a failpoint's pause before
    /// each of its posts; `writers`: writer threads taking jobs from one
    /// queue (UCX copies a host-to-host write on one host inside the post,
    /// so several threads, each on its own inner-agent worker, may copy at
    /// once; `chunk_writer_threads`).
    pub(super) fn start(
        agent: String,
        data: DataPlane,
        posting: IoThreadUse,
        shared: Arc<Shared>,
        (spin, delay): (Duration, Duration),
        writers: usize,
    ) -> std::io::Result<ChunkWriter> {
        let data = Arc::new(data);
        let thread = if posting == IoThreadUse::Always {
            None
        } else {
            let (jobs_tx, jobs_rx) = mpsc::channel::<WriteJob>();
            let (done_tx, done_rx) = mpsc::channel::<WriteOutcome>();
            let jobs_rx = Arc::new(Mutex::new(jobs_rx));
            let mut handles = Vec::new();
            for _ in 0..writers.max(1) {
                let (d, sh, rx, tx) = (
                    data.clone(),
                    shared.clone(),
                    jobs_rx.clone(),
                    done_tx.clone(),
                );
                handles.push(
                    std::thread::Builder::new()
                        .name(format!("bounce-write-{agent}"))
                        .spawn(move || write_worker(d, rx, tx, sh, spin, delay))?,
                );
            }
            Some(WriterThread {
                jobs: Some(jobs_tx),
                done: done_rx,
                handles,
            })
        };
        Ok(ChunkWriter {
            agent,
            data,
            posting,
            here: Vec::new(),
            thread,
            handed: 0,
            slow_posts: SlowPosts::default(),
            shared,
        })
    }

    /// Posts `job` here or hands it to the writer thread. Err: it was not
    /// posted and never will be. A post that fails on the writer thread
    /// comes back from [`poll`](Self::poll) instead.
    pub(super) fn post(&mut self, job: WriteJob) -> Result<(), PostError> {
        let here = match self.posting {
            IoThreadUse::Always => true,
            IoThreadUse::Never => false,
            IoThreadUse::WhenIdle => self.here.is_empty() && self.handed == 0,
        };
        match &self.thread {
            _ if here => {
                let t = Instant::now();
                let w = post(&self.data, &self.shared, &job)?;
                let took = t.elapsed();
                let slow = self.slow_posts.blocking(&job.arena.inner_agent, took);
                if slow && self.posting == IoThreadUse::WhenIdle {
                    let (n, of) = SLOW_POSTS_OF_LAST;
                    tracing::warn!(agent = %self.agent, ?took, "chunk write posts block the IO thread ({n} of the last {of} took over {SLOW_POST:?}); the writer thread posts from now on");
                    self.posting = IoThreadUse::Never;
                }
                self.here.push((job.chunk, w, Instant::now()));
                Ok(())
            }
            Some(WriterThread { jobs: Some(tx), .. }) => {
                tx.send(job).map_err(|_| PostError::WriterGone)?;
                self.handed += 1;
                Ok(())
            }
            _ => Err(PostError::ShuttingDown),
        }
    }

    /// The writes that ended since the last call, in `out`.
    pub(super) fn poll(&mut self, out: &mut Vec<WriteOutcome>) {
        poll_pending(&self.data, &mut self.here, |o| out.push(o));
        if let Some(t) = &self.thread {
            let before = out.len();
            out.extend(t.done.try_iter());
            self.handed = self.handed.saturating_sub(out.len() - before);
        }
    }

    /// How the IO thread should pause while writes it posted run: `None`
    /// when none does, or only stale ones (it may wait in the control
    /// channel), zero within [`FAST_WRITE`] of the latest post (poll again
    /// at once), else [`SLOW_WRITE_PAUSE`].
    pub(super) fn pause(&self) -> Option<Duration> {
        let age = self.here.iter().map(|p| p.2).max()?.elapsed();
        if age < FAST_WRITE {
            Some(Duration::ZERO)
        } else if age < STALE_WRITE {
            Some(SLOW_WRITE_PAUSE)
        } else {
            None
        }
    }

    /// Takes no more writes. The writer thread finishes what it holds
    /// (within the quiescence bound) and is joined; writes still running
    /// here are left to the process when this is dropped.
    pub(super) fn close(&mut self) {
        if let Some(t) = &mut self.thread {
            t.jobs = None;
            for h in t.handles.drain(..) {
                let _ = h.join();
            }
        }
    }
}

impl Drop for ChunkWriter {
    fn drop(&mut self) {
        // Writes by cross-memory attach posted here stop at their next
        // piece: stop them and wait (within the bound) until none touches
        // an arena. (The writer threads' own end within their close, as
        // NIXL's do.)
        let copying = |p: &Pending| p.1.copying();
        if self.here.iter().any(copying) {
            self.here.iter().for_each(|p| {
                p.1.cancel();
            });
            let t = Instant::now();
            while self.here.iter().any(copying) && t.elapsed() < QUIESCE_BOUND {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        poll_pending(&self.data, &mut self.here, |_| {});
        if !self.here.is_empty() {
            // A write the transport may still run reads the arena: keep its
            // handle and the arena's registration alive rather than release
            // them under it (the reactor has already poisoned the arena, or
            // a forgotten peer's write was reported stuck).
            let cause = format!(
                "{} chunk writes never finished; leaving them to the process",
                self.here.len()
            );
            self.shared.poison(&self.agent, cause);
            std::mem::forget(std::mem::take(&mut self.here));
            std::mem::forget(self.data.clone());
        }
    }
}

/// The writer thread: posts chunk writes and polls them to completion, off
/// the IO thread, and wakes the reactor with each outcome.
fn write_worker(
    data: Arc<DataPlane>,
    jobs: Arc<Mutex<Receiver<WriteJob>>>,
    done: Sender<WriteOutcome>,
    shared: Arc<Shared>,
    spin: Duration,
    // Failpoint delay before each post (zero normally).
    delay: Duration,
) {
    precise_timers();
    let waker = shared.waker.clone();
    let mut pending: Vec<Pending> = Vec::new();
    let mut closed_at: Option<Instant> = None;
    let mut idle = 0u32;
    let report = |o: WriteOutcome| {
        let _ = done.send(o);
        waker();
    };
    loop {
        let job = if pending.is_empty() && closed_at.is_none() {
            match next_job(&jobs, spin) {
                Some(j) => Some(j),
                None => return,
            }
        } else if closed_at.is_none() {
            // Another writer may wait in the queue holding its lock: skip
            // this turn rather than stop polling the writes here.
            let next = match jobs.try_locked() {
                Some(rx) => rx.try_recv(),
                None => Err(mpsc::TryRecvError::Empty),
            };
            match next {
                Ok(j) => Some(j),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => {
                    closed_at = Some(Instant::now());
                    None
                }
            }
        } else {
            None
        };
        let mut progressed = false;
        if let Some(j) = job {
            progressed = true;
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            match post(&data, &shared, &j) {
                Ok(w) => pending.push((j.chunk, w, Instant::now())),
                Err(e) => report(WriteOutcome::Failed(j.chunk, e)),
            }
        }
        progressed |= poll_pending(&data, &mut pending, &report);
        if let Some(t) = closed_at {
            if pending.is_empty() {
                return;
            }
            if t.elapsed() > QUIESCE_BOUND {
                // The reactor already reported these as stuck (poisoned):
                // keep their handles alive rather than release a request
                // the transport may still be reading for.
                tracing::error!(
                    "{} chunk writes never finished; leaving them to the process",
                    pending.len()
                );
                std::mem::forget(pending);
                // Nor deregister the arena they may still read.
                std::mem::forget(data);
                return;
            }
        }
        if progressed {
            idle = 0;
        } else {
            idle += 1;
            if idle > 64 {
                std::thread::sleep(SLOW_WRITE_PAUSE);
            } else {
                std::thread::yield_now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A first post that opens a peer's mapping, or a stray slow one, keeps
    /// the IO thread posting; a transport slow on every post does not.
    #[test]
    fn only_posts_slow_time_after_time_move_the_writes_off_the_io_thread() {
        let (fast, slow) = (Duration::from_micros(20), Duration::from_micros(900));
        let mut posts = SlowPosts::default();
        // The first write to each new peer opens its mapping: a fan-out.
        for peer in ["a", "b", "c", "d"] {
            assert!(!posts.blocking(peer, slow), "first write to {peer}");
        }
        for i in 0..100 {
            let took = if i % 10 == 0 { slow } else { fast };
            assert!(!posts.blocking("a", took), "a stray slow post ({i})");
        }
        assert!(!posts.blocking("b", slow) && !posts.blocking("a", fast));
        assert!(!posts.blocking("c", slow) && !posts.blocking("d", fast));
        assert!(posts.blocking("a", slow), "three of the last eight");
        // A transport slow on every large post, fast on a short last chunk.
        let mut posts = SlowPosts::default();
        assert!(!posts.blocking("a", slow));
        assert!(!posts.blocking("a", slow) && !posts.blocking("a", fast));
        assert!(!posts.blocking("a", slow));
        assert!(posts.blocking("a", slow));
    }
}
