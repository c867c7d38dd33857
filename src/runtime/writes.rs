//! Chunk writes: each posted through the data plane (one write from this
//! arena into the peer's), then polled until NIXL reports it complete at
//! the target.
//!
//! Two ways to run them behind one interface, [`ChunkWriter`]:
//! - **On the IO thread** (a device arena, by default): the post only
//!   queues work (a CUDA IPC copy, an RDMA write), so the reactor posts and
//!   polls the write itself, between its other events. No hand-off: the
//!   post starts as soon as the gather is seen finished, and the DATA
//!   message leaves on the turn that sees the write done.
//! - **On the writer thread** (a host arena): UCX over TCP sends inside the
//!   post call, which on the IO thread would stall every control message
//!   and the next gather for the whole write.
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
use crate::dataplane::{ChunkWrite, DataPlane, PeerArena, WriteState};
use crate::proto::ChunkRef;

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
    Failed(ChunkRef, String),
}

/// How long a write posted on the IO thread is polled without pause;
/// after that (a slow transport, a large chunk across hosts) the reactor
/// pauses [`SLOW_WRITE_PAUSE`] between polls, as the writer thread does.
const FAST_WRITE: Duration = Duration::from_millis(1);
/// The pause between polls of a write older than [`FAST_WRITE`].
pub(super) const SLOW_WRITE_PAUSE: Duration = Duration::from_micros(20);

pub(super) enum ChunkWriter {
    /// Posted and polled by the IO thread.
    Here {
        /// `None` only once left to the process (see `Drop`).
        data: Option<DataPlane>,
        pending: Vec<(ChunkRef, ChunkWrite, Instant)>,
        shared: Arc<Shared>,
    },
    /// Handed to the writer thread, outcomes back over a queue.
    Thread {
        jobs: Option<Sender<WriteJob>>,
        done: Receiver<WriteOutcome>,
        handle: Option<JoinHandle<()>>,
    },
}

/// Posts one write, counting the post's time.
fn post(data: &DataPlane, shared: &Shared, j: &WriteJob) -> Result<ChunkWrite, String> {
    let t = Instant::now();
    let posted = data.post_write(&j.arena, j.local, j.remote, j.len);
    shared
        .counters
        .write_post_ns
        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    posted
}

/// Polls `pending` once each; the finished ones leave it, their outcomes
/// passed to `report`. Returns whether any finished.
fn poll_pending<T>(
    data: &DataPlane,
    pending: &mut Vec<(ChunkRef, ChunkWrite, T)>,
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
    /// Writes posted on the calling (IO) thread.
    pub(super) fn here(data: DataPlane, shared: Arc<Shared>) -> ChunkWriter {
        ChunkWriter::Here {
            data: Some(data),
            pending: Vec::new(),
            shared,
        }
    }

    /// Writes posted by a writer thread named `name`, which wakes the
    /// reactor with each outcome. `spin`: how long it polls for the next
    /// job before it blocks; `delay`: a failpoint's pause before each post.
    pub(super) fn thread(
        name: String,
        data: DataPlane,
        shared: Arc<Shared>,
        spin: Duration,
        delay: Duration,
    ) -> std::io::Result<ChunkWriter> {
        let (jobs_tx, jobs_rx) = mpsc::channel::<WriteJob>();
        let (done_tx, done_rx) = mpsc::channel::<WriteOutcome>();
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || write_worker(data, jobs_rx, done_tx, shared, spin, delay))?;
        Ok(ChunkWriter::Thread {
            jobs: Some(jobs_tx),
            done: done_rx,
            handle: Some(handle),
        })
    }

    /// Posts `job` (here) or hands it over (thread). Err: it was not posted
    /// and never will be. A post that fails on the writer thread comes back
    /// from [`poll`](Self::poll) instead.
    pub(super) fn post(&mut self, job: WriteJob) -> Result<(), String> {
        match self {
            ChunkWriter::Here {
                data: Some(data),
                pending,
                shared,
            } => {
                let w = post(data, shared, &job)?;
                pending.push((job.chunk, w, Instant::now()));
                Ok(())
            }
            ChunkWriter::Here { data: None, .. } => Err("shutting down".into()),
            ChunkWriter::Thread { jobs: Some(tx), .. } => tx
                .send(job)
                .map_err(|_| "the writer thread is gone".to_string()),
            ChunkWriter::Thread { jobs: None, .. } => Err("shutting down".into()),
        }
    }

    /// The writes that ended since the last call, in `out`.
    pub(super) fn poll(&mut self, out: &mut Vec<WriteOutcome>) {
        match self {
            ChunkWriter::Here {
                data: Some(data),
                pending,
                ..
            } => {
                poll_pending(data, pending, |o| out.push(o));
            }
            ChunkWriter::Here { data: None, .. } => {}
            ChunkWriter::Thread { done, .. } => out.extend(done.try_iter()),
        }
    }

    /// How the IO thread should pause while writes it posted run: `None`
    /// when none does (it may sleep in the control channel), zero while the
    /// oldest is recent (poll again at once), else [`SLOW_WRITE_PAUSE`].
    pub(super) fn pause(&self) -> Option<Duration> {
        match self {
            ChunkWriter::Here { pending, .. } => {
                let oldest = pending.iter().map(|p| p.2).min()?;
                Some(if oldest.elapsed() < FAST_WRITE {
                    Duration::ZERO
                } else {
                    SLOW_WRITE_PAUSE
                })
            }
            ChunkWriter::Thread { .. } => None,
        }
    }

    /// Takes no more writes. The writer thread finishes what it holds
    /// (within the quiescence bound) and is joined; writes still running
    /// here are left to the process when this is dropped.
    pub(super) fn close(&mut self) {
        if let ChunkWriter::Thread { jobs, handle, .. } = self {
            *jobs = None;
            if let Some(h) = handle.take() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for ChunkWriter {
    fn drop(&mut self) {
        if let ChunkWriter::Here { data, pending, .. } = self {
            if let Some(d) = data.as_ref() {
                poll_pending(d, pending, |_| {});
            }
            if !pending.is_empty() {
                // A write the transport may still run reads the arena:
                // keep its handle and the arena's registration alive
                // rather than release them under it (the reactor has
                // already poisoned the arena, or a forgotten peer's write
                // was reported stuck).
                tracing::error!(
                    "{} chunk writes never finished; leaving them to the process",
                    pending.len()
                );
                std::mem::forget(std::mem::take(pending));
                std::mem::forget(data.take());
            }
        }
    }
}

/// The writer thread: posts chunk writes and polls them to completion, off
/// the IO thread, and wakes the reactor with each outcome.
fn write_worker(
    data: DataPlane,
    jobs: Receiver<WriteJob>,
    done: Sender<WriteOutcome>,
    shared: Arc<Shared>,
    spin: Duration,
    // Failpoint delay before each post (zero normally).
    delay: Duration,
) {
    precise_timers();
    let waker = shared.waker.clone();
    let jobs = Mutex::new(jobs);
    let mut pending: Vec<(ChunkRef, ChunkWrite, ())> = Vec::new();
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
            match jobs.lock().expect("write jobs").try_recv() {
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
                Ok(w) => pending.push((j.chunk, w, ())),
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
