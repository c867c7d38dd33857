//! Running one configuration through one variant: requests on disjoint
//! slices, warm-up, timed batches, verification of the first and last
//! batch, plugin counters and CPU use.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use nixl_bounce::stats::Snapshot;
use nixl_sys::{Agent, XferDescList, XferOp, XferRequest, XferStatus};

use crate::cli::{Op, Options, Poll};
use crate::mem::BenchMemory;
use crate::sysinfo::{CpuSample, CpuUse};
use crate::variant::Variant;
use nixl_bounce::harness::{blocks_for, pattern, verify_bytes, Plan, Rng};

/// One configuration of the sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub count: usize,
    pub size: usize,
    pub inflight: usize,
}

impl Shape {
    /// Bytes of one request's slice: the blocks it moves plus 25% spare
    /// blocks that must stay untouched.
    pub fn slice_len(&self) -> usize {
        blocks_for(self.count) * self.size
    }
    /// Bytes per side for all requests in flight.
    pub fn buffer_len(&self) -> usize {
        self.slice_len() * self.inflight
    }
    pub fn request_bytes(&self) -> usize {
        self.count * self.size
    }
}

/// A seed derived from a list of distinguishing numbers.
pub fn seed(parts: &[u64]) -> u64 {
    parts.iter().fold(0x243f_6a88_85a3_08d3, |acc, p| {
        Rng::new(acc ^ p.wrapping_mul(0x9e37_79b9_7f4a_7c15)).next_u64()
    })
}

/// What came out of one (configuration, variant).
#[derive(Clone)]
pub struct Measured {
    /// Per-request latency, post -> completion seen, in ms.
    pub latencies_ms: Vec<f64>,
    /// Wall time of each timed batch (first post -> last completion), in ms.
    pub batch_ms: Vec<f64>,
    pub warmup: usize,
    /// First and last timed batch, byte-exact.
    pub verified: Result<(), String>,
    pub cpu: CpuUse,
    pub bounce: Option<BounceCheck>,
}

/// Whether BOUNCE really took the bounce path, from the plugin's counters.
#[derive(Clone)]
pub struct BounceCheck {
    /// "yes", "no (<reason>)", "partial (...)" or "unknown (...)".
    pub used: String,
    pub ok: bool,
    /// Whether BOUNCE's routing gate (`min_descriptor_count`,
    /// `max_average_descriptor_size_bytes`) admits this configuration: a
    /// fallback it predicts is flagged but is not an error.
    pub expected: bool,
    /// Requests posted (warm-up included) while the counters were watched.
    pub posted: u64,
    pub chunks_per_request: Option<f64>,
    pub init_delta: BTreeMap<String, u64>,
    pub target_delta: BTreeMap<String, u64>,
}

impl Measured {
    /// Adds another round's measurements of the same configuration.
    pub fn merge(&mut self, other: Measured) {
        self.latencies_ms.extend(other.latencies_ms);
        self.batch_ms.extend(other.batch_ms);
        self.warmup += other.warmup;
        if self.verified.is_ok() {
            self.verified = other.verified;
        }
        self.cpu.merge(&other.cpu);
        self.bounce = match (self.bounce.take(), other.bounce) {
            (Some(a), Some(b)) => Some(a.merge(b)),
            (a, b) => a.or(b),
        };
    }
}

impl BounceCheck {
    fn merge(self, other: BounceCheck) -> BounceCheck {
        let sum = |mut a: BTreeMap<String, u64>, b: BTreeMap<String, u64>| {
            for (k, v) in b {
                *a.entry(k).or_default() += v;
            }
            a
        };
        let posted = self.posted + other.posted;
        let init_delta = sum(self.init_delta, other.init_delta);
        let target_delta = sum(self.target_delta, other.target_delta);
        let chunks = chunks_written(&init_delta, &target_delta);
        BounceCheck {
            used: if self.ok { other.used } else { self.used },
            ok: self.ok && other.ok,
            expected: self.expected,
            posted,
            chunks_per_request: (posted > 0 && self.chunks_per_request.is_some())
                .then(|| chunks as f64 / posted as f64),
            init_delta,
            target_delta,
        }
    }
}

pub enum Failure {
    /// The configuration could not run; the variant is still usable.
    Setup(String),
    /// A batch failed or timed out: requests may still be in flight, so the
    /// variant must not be used (or torn down) any more.
    Batch(String),
}

/// Runs `shape` through `variant` with `src`/`dst` (both at least
/// `shape.buffer_len()` long). `ids` distinguish the patterns of this run
/// from every other (configuration, variant) so that stale data can never
/// verify.
pub fn run_shape(
    o: &Options,
    variant: &Variant,
    shape: Shape,
    ids: (u64, u64),
    src: &mut dyn BenchMemory,
    dst: &mut dyn BenchMemory,
) -> Result<Measured, Failure> {
    let (shape_id, variant_id) = ids;
    let slice = shape.slice_len();
    if src.len() < shape.buffer_len() || dst.len() < shape.buffer_len() {
        return Err(Failure::Setup(format!(
            "buffers of {} B are too small for {} B",
            src.len().min(dst.len()),
            shape.buffer_len()
        )));
    }
    let plans: Vec<Plan> = (0..shape.inflight)
        .map(|k| {
            if variant.spec.contiguous {
                Plan {
                    block: shape.request_bytes(),
                    src: vec![0],
                    dst: vec![0],
                }
            } else {
                // The layout depends on the configuration and slot only: every
                // variant moves exactly the same blocks.
                Plan::standard(
                    shape.count,
                    shape.size,
                    seed(&[o.seed, 1, shape_id, k as u64]),
                )
            }
        })
        .collect();

    let stats_before = variant.bounce_stats().transpose().map_err(Failure::Setup)?;
    let reqs = plans
        .iter()
        .enumerate()
        .map(|(k, plan)| create_request(o.op, variant, plan, src, dst, k * slice))
        .collect::<Result<Vec<_>, _>>()
        .map_err(Failure::Setup)?;
    let agent = &variant.init.agent;

    let mut scratch = Vec::new();
    let mut warm_ms = Vec::new();
    for _ in 0..o.warmup {
        let wall =
            run_batch(agent, &reqs, o.timeout, o.poll, &mut scratch).map_err(Failure::Batch)?;
        warm_ms.push(wall.as_secs_f64() * 1e3);
    }

    let mut m = Measured {
        latencies_ms: Vec::new(),
        batch_ms: Vec::new(),
        warmup: o.warmup,
        verified: Ok(()),
        cpu: CpuUse::default(),
        bounce: None,
    };
    let started = Instant::now();
    let budget_ms = o.config_budget.as_secs_f64() * 1e3;
    let mut batch = 0usize;
    loop {
        // Decide before the batch whether it is the last one, so that the
        // last timed batch is also a verified one.
        let done_ms = started.elapsed().as_secs_f64() * 1e3;
        let history = if m.batch_ms.is_empty() {
            &warm_ms
        } else {
            &m.batch_ms
        };
        let estimate = if history.is_empty() {
            0.0
        } else {
            history.iter().sum::<f64>() / history.len() as f64
        };
        let last = batch + 1 >= o.iters
            || (batch + 1 >= o.min_iters && done_ms + 2.0 * estimate > budget_ms);
        let verify = batch == 0 || last;
        let phase = if batch == 0 { 0 } else { 1 };
        let seeds: Vec<(u64, u64)> = (0..shape.inflight)
            .map(|k| {
                let k = k as u64;
                (
                    seed(&[o.seed, 2, shape_id, variant_id, k, phase, 0]),
                    seed(&[o.seed, 2, shape_id, variant_id, k, phase, 1]),
                )
            })
            .collect();
        if verify {
            for (k, (s, d)) in seeds.iter().enumerate() {
                src.fill(k * slice, slice, *s);
                dst.fill(k * slice, slice, *d);
            }
        }
        let before = CpuSample::take();
        let wall = run_batch(agent, &reqs, o.timeout, o.poll, &mut m.latencies_ms)
            .map_err(Failure::Batch)?;
        let after = CpuSample::take();
        m.cpu.add(&before, &after);
        m.batch_ms.push(wall.as_secs_f64() * 1e3);
        if verify && m.verified.is_ok() {
            m.verified = verify_slices(&plans, &seeds, slice, src, dst)
                .map_err(|e| format!("timed batch {batch}: {e}"));
        }
        batch += 1;
        if last {
            break;
        }
    }
    drop(reqs);
    if m.verified.is_ok() {
        m.verified = src.check_guards().and_then(|_| dst.check_guards());
    }
    if let Some(before) = stats_before {
        let posted = ((o.warmup + batch) * shape.inflight) as u64;
        m.bounce = Some(match variant.bounce_stats().expect("a BOUNCE variant") {
            Ok(after) => bounce_check(
                &before,
                &after,
                posted,
                routing_expects_bounce(variant, shape),
            ),
            Err(e) => BounceCheck {
                used: format!("unknown ({e})"),
                ok: false,
                expected: routing_expects_bounce(variant, shape),
                posted,
                chunks_per_request: None,
                init_delta: BTreeMap::new(),
                target_delta: BTreeMap::new(),
            },
        });
    }
    Ok(m)
}

fn desc_list(
    mem: &dyn BenchMemory,
    base: usize,
    offsets: &[usize],
    len: usize,
) -> Result<XferDescList<'static>, String> {
    let mut l = XferDescList::new(mem.mem_type()).map_err(|e| format!("XferDescList::new: {e}"))?;
    for off in offsets {
        l.add_desc(base + off, len, mem.device_id());
    }
    Ok(l)
}

/// A request moving `plan` from `src` to `dst`: a WRITE by the initiator
/// (which holds `src`), or a READ by it (it holds `dst`).
fn create_request(
    op: Op,
    variant: &Variant,
    plan: &Plan,
    src: &dyn BenchMemory,
    dst: &dyn BenchMemory,
    slice_offset: usize,
) -> Result<XferRequest, String> {
    let s = desc_list(src, src.addr() + slice_offset, &plan.src, plan.block)?;
    let d = desc_list(dst, dst.addr() + slice_offset, &plan.dst, plan.block)?;
    let (xop, local, remote) = match op {
        Op::Write => (XferOp::Write, &s, &d),
        Op::Read => (XferOp::Read, &d, &s),
    };
    let opt = variant.init.opt_args(None)?;
    variant
        .init
        .agent
        .create_xfer_req(xop, local, remote, &variant.target.name, Some(&opt))
        .map_err(|e| {
            format!(
                "create_xfer_req({op:?}, {} x {} B): {e} ({e:?})",
                plan.len(),
                plan.block
            )
        })
}

/// Posts every request back-to-back, then polls them all to completion.
/// Appends each request's latency (ms) to `latencies_ms`; returns the wall
/// time from the first post to the last completion.
fn run_batch(
    agent: &Agent,
    reqs: &[XferRequest],
    timeout: Duration,
    poll: Poll,
    latencies_ms: &mut Vec<f64>,
) -> Result<Duration, String> {
    let t0 = Instant::now();
    let mut posted = Vec::with_capacity(reqs.len());
    let mut done: Vec<Option<Instant>> = vec![None; reqs.len()];
    for (i, r) in reqs.iter().enumerate() {
        posted.push(Instant::now());
        match agent.post_xfer_req(r, None) {
            Ok(true) => {}
            Ok(false) => done[i] = Some(Instant::now()),
            Err(e) => return Err(format!("post_xfer_req of request {i}: {e} ({e:?})")),
        }
    }
    let mut left = done.iter().filter(|d| d.is_none()).count();
    let mut rounds = 0u64;
    while left > 0 {
        for (i, r) in reqs.iter().enumerate() {
            if done[i].is_some() {
                continue;
            }
            match agent.get_xfer_status(r) {
                Ok(XferStatus::Success) => {
                    done[i] = Some(Instant::now());
                    left -= 1;
                }
                Ok(XferStatus::InProgress) => {}
                Err(e) => return Err(format!("request {i} failed: {e} ({e:?})")),
            }
        }
        if left > 0 {
            if t0.elapsed() > timeout {
                return Err(format!(
                    "{left} of {} requests still in progress after {timeout:?} ({rounds} polling rounds); giving up",
                    reqs.len()
                ));
            }
            poll.pause(rounds);
            rounds += 1;
        }
    }
    let mut last = t0;
    for (p, d) in posted.iter().zip(&done) {
        let d = d.expect("every request completed");
        latencies_ms.push((d - *p).as_secs_f64() * 1e3);
        last = last.max(d);
    }
    Ok(last - t0)
}

/// Byte-exact check of every slice: destination blocks hold the source
/// blocks, every other destination byte is unchanged, the source is intact.
fn verify_slices(
    plans: &[Plan],
    seeds: &[(u64, u64)],
    slice: usize,
    src: &dyn BenchMemory,
    dst: &dyn BenchMemory,
) -> Result<(), String> {
    for (k, (plan, (s, d))) in plans.iter().zip(seeds).enumerate() {
        let src_now = src.read(k * slice, slice);
        verify_bytes(&src_now, &pattern(slice, *s), |_| "source".into())
            .map_err(|e| format!("request {k}: source slice changed: {e}"))?;
        plan.verify(&dst.read(k * slice, slice), &pattern(slice, *d), &src_now)
            .map_err(|e| format!("request {k}: destination slice wrong: {e}"))?;
    }
    Ok(())
}

fn delta(before: &Snapshot, after: &Snapshot) -> BTreeMap<String, u64> {
    after
        .counters
        .iter()
        .filter_map(|(k, v)| {
            let d = v.saturating_sub(before.counters.get(k).copied().unwrap_or(0));
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

/// What BOUNCE's routing gate should decide for `shape`, from the
/// parameters the backend was created with.
fn routing_expects_bounce(variant: &Variant, shape: Shape) -> bool {
    let get = |k: &str| {
        variant
            .params
            .get(k)
            .and_then(|v| nixl_bounce::config::parse_bytes(v).ok())
    };
    let min_count = get("min_descriptor_count").unwrap_or(0);
    let max_avg = get("max_average_descriptor_size_bytes").unwrap_or(u64::MAX);
    let enabled = variant
        .params
        .get("enable")
        .is_none_or(|v| nixl_bounce::config::parse_bool(v).unwrap_or(true));
    enabled && shape.count as u64 >= min_count && shape.size as u64 <= max_avg
}

fn bounce_check(
    before: &(Snapshot, Snapshot),
    after: &(Snapshot, Snapshot),
    posted: u64,
    expected: bool,
) -> BounceCheck {
    let init_delta = delta(&before.0, &after.0);
    let target_delta = delta(&before.1, &after.1);
    let get = |k: &str| init_delta.get(k).copied().unwrap_or(0);
    let fallback = init_delta
        .iter()
        .filter(|(k, _)| k.starts_with("fallback_"))
        .max_by_key(|(_, v)| **v);
    // BOUNCE's own paths, whichever took it (the arena, CMA, peer-mapped).
    let (submitted, succeeded) = (
        get("bounce_submitted") + get("cma_submitted") + get("peer_map_submitted"),
        get("bounce_succeeded") + get("cma_succeeded") + get("peer_map_succeeded"),
    );
    let (used, ok) = if submitted == posted && succeeded == posted && fallback.is_none() {
        ("yes".to_string(), true)
    } else if submitted == 0 {
        let why = fallback.map_or("no bounce submission counted".to_string(), |(k, _)| {
            k.clone()
        });
        (format!("no ({why})"), false)
    } else {
        (
            format!("partial ({submitted} submitted, {succeeded} succeeded of {posted} posted)"),
            false,
        )
    };
    let chunks = chunks_written(&init_delta, &target_delta);
    BounceCheck {
        used,
        ok,
        expected,
        posted,
        chunks_per_request: (posted > 0 && submitted > 0).then(|| chunks as f64 / posted as f64),
        init_delta,
        target_delta,
    }
}

/// Chunks written by either agent (the initiator writes a WRITE's, the
/// target, the data owner, a READ's).
fn chunks_written(init: &BTreeMap<String, u64>, target: &BTreeMap<String, u64>) -> u64 {
    let get = |m: &BTreeMap<String, u64>| m.get("chunks_written").copied().unwrap_or(0);
    get(init) + get(target)
}

/// The copies the bounce path makes, done here with one thread: the time
/// to gather one request's blocks from `src` into a contiguous staging
/// buffer, and to scatter them from it into `dst`. Returns (gather, scatter)
/// per-request times in ms.
pub fn memcpy_model(
    o: &Options,
    shape: Shape,
    shape_id: u64,
    src: &dyn BenchMemory,
    dst: &mut dyn BenchMemory,
) -> (Vec<f64>, Vec<f64>) {
    let plan = Plan::standard(shape.count, shape.size, seed(&[o.seed, 1, shape_id, 0]));
    let mut staging = vec![0u8; shape.request_bytes()];
    staging.fill(1);
    assert_eq!(
        dst.mem_type(),
        nixl_sys::MemType::Dram,
        "the memcpy model runs on host memory only"
    );
    let src_view = src.read(0, shape.slice_len());
    let src_base = src_view.as_ptr();
    let dst_base = dst.addr() as *mut u8;
    let (mut gather, mut scatter) = (Vec::new(), Vec::new());
    let started = Instant::now();
    for i in 0..o.warmup + o.iters {
        let t = Instant::now();
        for (k, off) in plan.src.iter().enumerate() {
            // SAFETY: `off + block` lies inside the source slice and
            // `k * block + block` inside `staging`; the regions are distinct.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src_base.add(*off),
                    staging.as_mut_ptr().add(k * plan.block),
                    plan.block,
                )
            }
        }
        let g = t.elapsed();
        let t = Instant::now();
        for (k, off) in plan.dst.iter().enumerate() {
            // SAFETY: as above for the destination slice (no transfer is in
            // flight while the model runs).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    staging.as_ptr().add(k * plan.block),
                    dst_base.add(*off),
                    plan.block,
                )
            }
        }
        let s = t.elapsed();
        std::hint::black_box(&staging);
        if i >= o.warmup {
            gather.push(g.as_secs_f64() * 1e3);
            scatter.push(s.as_secs_f64() * 1e3);
            if gather.len() >= o.min_iters && started.elapsed() > o.config_budget {
                break;
            }
        }
    }
    (gather, scatter)
}
