//! The copy workers: gathers and scatters taken off the reactor, run or
//! launched, and reported back.

use super::*;

/// A gather or scatter to carry out: which, where, and the application
/// range it touches.
pub(super) struct CopyWork {
    pub(super) id: CopyId,
    pub(super) direction: Direction,
    pub(super) span: RegionSpan,
    pub(super) runs: Runs,
    /// The application range it touches, released when the copy is over.
    pub(super) in_use: InUse,
}

pub(super) struct CopyJob {
    pub(super) work: CopyWork,
    /// Launch it and hand it back to the reactor to poll
    /// ([`CopyEngine::try_launch`]) when the engine can; else (or when no
    /// execution context is free) copy it here, blocking.
    pub(super) launch: bool,
    pub(super) queued_at: Instant,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum CopyId {
    Gather(ChunkRef),
    Scatter(RegionHandle),
}

impl CopyId {
    pub(super) fn direction(&self) -> Direction {
        match self {
            CopyId::Gather(_) => Direction::Gather,
            CopyId::Scatter(_) => Direction::Scatter,
        }
    }
}

pub(super) struct CopyDone {
    pub(super) id: CopyId,
    pub(super) result: Result<(), crate::copy::CopyError>,
    /// Queued -> started, and started -> finished.
    pub(super) queued: Duration,
    pub(super) ran: Duration,
}

/// A copy launched (a CUDA kernel is queued and an event marks its end), by
/// the IO thread or a copy worker, and polled by the IO thread instead of a
/// worker blocking on its stream.
pub(super) struct Launched {
    pub(super) id: CopyId,
    pub(super) copy: Box<dyn crate::copy::LaunchedCopy>,
    pub(super) in_use: InUse,
    /// The other copies launched together with this one
    /// ([`CopyEngine::try_launch_together`]): they end with it.
    pub(super) together: Vec<(CopyId, InUse)>,
    /// Queued (for a worker) -> started.
    pub(super) queued: Duration,
    pub(super) started: Instant,
}

/// What a copy worker reports: a copy it ran, or one it launched.
pub(super) enum WorkerReport {
    Done(CopyDone),
    Launched(Launched),
}

/// Takes the next job from `jobs`: polls for up to `spin` first (the next
/// chunk of a live transfer usually follows within microseconds, and a
/// sleeping thread takes tens of microseconds to wake), then blocks.
/// `None` once the sending side is gone.
pub(super) fn next_job<T>(jobs: &Mutex<Receiver<T>>, spin: Duration) -> Option<T> {
    use std::sync::mpsc::TryRecvError;
    if !spin.is_zero() {
        let until = Instant::now() + spin;
        loop {
            match jobs.locked().try_recv() {
                Ok(j) => return Some(j),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) if Instant::now() >= until => break,
                Err(TryRecvError::Empty) => std::thread::yield_now(),
            }
        }
    }
    jobs.locked().recv().ok()
}

pub(super) fn copy_worker(
    jobs: Arc<Mutex<Receiver<CopyJob>>>,
    done: Sender<WorkerReport>,
    copier: Arc<dyn CopyEngine>,
    waker: crate::control::Waker,
    targets: Arc<ScatterTargets>,
    spin: Duration,
    // Failpoint delays of gathers and scatters (zero normally).
    (gather_delay, scatter_delay): (Duration, Duration),
) {
    let failed = |direction, panic: String| crate::copy::CopyError {
        direction,
        reason: format!("the copy engine panicked: {panic}"),
        quiesced: false,
    };
    loop {
        let Some(CopyJob {
            work: job,
            launch,
            queued_at,
        }) = next_job(&jobs, spin)
        else {
            return; // the reactor is gone
        };
        let delay = match job.id {
            CopyId::Gather(_) => gather_delay,
            CopyId::Scatter(_) => scatter_delay,
        };
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let started = Instant::now();
        let queued = started.duration_since(queued_at);
        // Launched here, polled by the reactor: this worker only fills the
        // table and launches (the host's share of a large copy).
        let launched = if launch {
            crate::boundary::catch(|| copier.try_launch(job.direction, job.span, &job.runs))
                .unwrap_or_else(|panic| Some(Err(failed(job.direction, panic))))
        } else {
            None
        };
        let report = match launched {
            Some(Ok(copy)) => WorkerReport::Launched(Launched {
                id: job.id,
                copy,
                in_use: job.in_use,
                together: Vec::new(),
                queued,
                started,
            }),
            // Refused or failed to launch, or (None) no context free or an
            // engine that cannot launch: copied here, blocking.
            launched => {
                let result = match launched {
                    Some(Err(e)) => Err(e),
                    _ => crate::boundary::catch(|| copier.copy(job.direction, job.span, &job.runs))
                        .unwrap_or_else(|panic| Err(failed(job.direction, panic))),
                };
                // A copy that failed without quiescing may still touch the
                // memory: keep it marked (deregistration then reports it)
                // rather than lie.
                if result.as_ref().map_or_else(|e| e.quiesced, |_| true) {
                    targets.release(job.in_use);
                }
                WorkerReport::Done(CopyDone {
                    id: job.id,
                    result,
                    queued,
                    ran: started.elapsed(),
                })
            }
        };
        if done.send(report).is_err() {
            return;
        }
        waker();
    }
}
