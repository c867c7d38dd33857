//! An optional timeline of every request's steps, for finding where a
//! transfer's time goes (`NIXL_BOUNCE_TRACE=<directory>`).
//!
//! The IO thread records each step it takes or sees, with the host's
//! monotonic clock (one clock for every process of a host, so a sender's
//! and a receiver's timelines line up): a request's submission, each
//! control message sent and received, each gather, chunk write and
//! scatter started and seen finished, the completion. Steps carry the
//! request id that travels in the messages (the sender's, for a WRITE),
//! so both sides of a request share it (a READ's data owner serves it
//! under an id of its own, and records the serve's steps under the
//! reader's). When the reactor ends, the
//! timeline is written to `<directory>/<agent>-<pid>.tsv`;
//! `bench/trace_report.py` lines the files up and prints each step's
//! median time from submission.
//!
//! Off (the default) it costs one branch per step. On, the IO thread
//! appends to a vector (at most [`MAX_EVENTS`]; later steps are dropped).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use crate::proto::{RegionHandle, RequestId};

/// The environment variable naming the directory.
pub const ENV: &str = "NIXL_BOUNCE_TRACE";
/// Steps kept per reactor (24 bytes each).
pub const MAX_EVENTS: usize = 1 << 22;

/// One step of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// The client's thread queued the request for the IO thread (after
    /// its preparation, when that waits for the first post).
    Queued,
    Submit,
    /// A control message sent, by wire type code.
    Send(u8),
    /// A control message received, by wire type code.
    Recv(u8),
    GatherStart,
    /// A copy's launch returned (alone or in a group): the time between
    /// its start and this is the IO thread's hold, table and launch.
    GatherLaunched,
    GatherDone,
    WritePost,
    WriteDone,
    ScatterStart,
    ScatterLaunched,
    ScatterDone,
    Complete,
}

impl Step {
    fn name(self) -> String {
        // READ_DATA for `ReadData`, as the wire format names them; a
        // WANT_STANDING is a WANT.
        let msg = |ty: u8| match crate::proto::wire::MessageType::try_from(ty) {
            Err(_) => format!("type{ty}"),
            Ok(crate::proto::wire::MessageType::WantStanding) => "WANT".into(),
            Ok(t) => {
                let mut name = String::new();
                for (i, c) in format!("{t:?}").chars().enumerate() {
                    if i > 0 && c.is_ascii_uppercase() {
                        name.push('_');
                    }
                    name.push(c.to_ascii_uppercase());
                }
                name
            }
        };
        match self {
            Step::Queued => "queued".into(),
            Step::Submit => "submit".into(),
            Step::Send(ty) => format!("send_{}", msg(ty)),
            Step::Recv(ty) => format!("recv_{}", msg(ty)),
            Step::GatherStart => "gather_start".into(),
            Step::GatherLaunched => "gather_launched".into(),
            Step::GatherDone => "gather_done".into(),
            Step::WritePost => "write_post".into(),
            Step::WriteDone => "write_done".into(),
            Step::ScatterStart => "scatter_start".into(),
            Step::ScatterLaunched => "scatter_launched".into(),
            Step::ScatterDone => "scatter_done".into(),
            Step::Complete => "complete".into(),
        }
    }
}

struct Event {
    t_ns: u64,
    step: Step,
    request: u64,
    chunk: u32,
    /// The request's bytes (its submission's step only).
    bytes: u64,
}

pub(super) struct Trace {
    path: PathBuf,
    events: Vec<Event>,
    /// The request and chunk each running scatter belongs to.
    scatters: HashMap<RegionHandle, (RequestId, u32)>,
}

/// The host's monotonic clock, in ns.
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Trace {
    /// A timeline for the reactor of agent `name`, if [`ENV`] names a
    /// directory.
    pub(super) fn from_env(name: &str) -> Option<Trace> {
        let dir = std::env::var_os(ENV).filter(|d| !d.is_empty())?;
        let agent: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = PathBuf::from(dir).join(format!("{agent}-{}.tsv", std::process::id()));
        Some(Trace {
            path,
            events: Vec::with_capacity(1 << 16),
            scatters: HashMap::new(),
        })
    }

    pub(super) fn record(&mut self, step: Step, request: RequestId, chunk: Option<u32>) {
        self.push(step, request, chunk, 0);
    }

    /// A request submitted, of `bytes` bytes, queued by the client's
    /// thread at `queued_ns` ([`monotonic_ns`]).
    pub(super) fn submitted(&mut self, request: RequestId, bytes: u64, queued_ns: u64) {
        self.push_at(queued_ns, Step::Queued, request, None, 0);
        self.push(Step::Submit, request, None, bytes);
    }

    fn push(&mut self, step: Step, request: RequestId, chunk: Option<u32>, bytes: u64) {
        self.push_at(monotonic_ns(), step, request, chunk, bytes);
    }

    fn push_at(
        &mut self,
        t_ns: u64,
        step: Step,
        request: RequestId,
        chunk: Option<u32>,
        bytes: u64,
    ) {
        if self.events.len() < MAX_EVENTS {
            self.events.push(Event {
                t_ns,
                step,
                request: request.0,
                chunk: chunk.unwrap_or(u32::MAX),
                bytes,
            });
        }
    }

    pub(super) fn scatter_started(&mut self, region: RegionHandle, request: RequestId, chunk: u32) {
        self.scatters.insert(region, (request, chunk));
        self.record(Step::ScatterStart, request, Some(chunk));
    }

    /// The scatter into `region` launched, or (`done`) was seen finished,
    /// which ends its entry.
    pub(super) fn scatter_step(&mut self, region: RegionHandle, done: bool) {
        let (step, known) = if done {
            (Step::ScatterDone, self.scatters.remove(&region))
        } else {
            (Step::ScatterLaunched, self.scatters.get(&region).copied())
        };
        if let Some((request, chunk)) = known {
            self.record(step, request, Some(chunk));
        }
    }

    /// Writes the timeline: `t_ns`, step, request, chunk (empty when the
    /// step is the whole request's), bytes (the request's, at its
    /// submission; else 0), one step a line.
    fn write(&self) -> std::io::Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&self.path)?);
        writeln!(out, "t_ns\tstep\trequest\tchunk\tbytes")?;
        for e in &self.events {
            let chunk = match e.chunk {
                u32::MAX => String::new(),
                c => c.to_string(),
            };
            writeln!(
                out,
                "{}\t{}\t{}\t{chunk}\t{}",
                e.t_ns,
                e.step.name(),
                e.request,
                e.bytes
            )?;
        }
        out.flush()
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        match self.write() {
            Ok(()) => {
                tracing::info!(path = %self.path.display(), steps = self.events.len(), "trace written")
            }
            Err(e) => tracing::warn!(path = %self.path.display(), "writing the trace: {e}"),
        }
    }
}
