//! Shared helpers of the `tests/bounce_*.rs` suites (`support::bounce`).
//!
//! - agents with a chosen NIXL thread-sync mode (the harness' `Node::new`
//!   uses the C API's default, which serialises nothing);
//! - metadata exchange (both ways or one way);
//! - the plugin's counters (`plugin_stats`) as a map, with deltas;
//! - assertions that a transfer did (or did not) take the bounce path;
//! - plans shifted into disjoint slices of one buffer, combined expectations;
//! - bounded waits over several requests at once.
#![allow(dead_code)]

use super::*;
use nixl_sys::{Agent, AgentConfig, ThreadSync, XferOp, XferRequest, XferStatus};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub const BLOCK: usize = 4096;
pub const KIB: usize = 1024;
pub const MIB: usize = 1024 * 1024;

/// Single-host tests bind the control socket to 127.0.0.1.
pub const LOOPBACK: (&str, &str) = ("control_bind_loopback", "true");
/// The arena between two processes of this host with its chunk writes by
/// cross-memory attach: the CMA path on, its own route gated off, 4 MiB
/// chunks, control bound to loopback.
pub const CMA_CHUNK_WRITES: [(&str, &str); 4] = [
    LOOPBACK,
    ("enable_cma", "true"),
    ("cma_min_descriptor_count", "1000000000"),
    ("max_chunk_size_bytes", "4MiB"),
];
/// The chunk writes counted with the path off: none, unless the
/// environment turns the CMA path on (as the fault drills by hand do).
pub fn assert_no_cma_writes(n: u64) {
    if std::env::var_os("NIXL_BOUNCE_ENABLE_CMA").is_none() {
        assert_eq!(n, 0, "chunk writes by CMA with the path off");
    }
}
/// The NIXL-notification control channel.
pub const NOTIF_CONTROL: (&str, &str) = ("use_nixl_notifications", "true");
/// Control messages over ZMQ instead of the default TCP sockets the IO
/// thread owns (`control::tcp`).
pub const ZMQ_CONTROL: (&str, &str) = ("direct_tcp_control", "false");

// ---------------------------------------------------------------------------
// Counters
// ---------------------------------------------------------------------------

/// A snapshot of one engine's counters; a missing counter reads as 0.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub agent: String,
    pub map: BTreeMap<String, u64>,
    pub poisoned: Option<String>,
}

impl Counters {
    pub fn get(&self, k: &str) -> u64 {
        self.map.get(k).copied().unwrap_or(0)
    }
    /// `self[k] - before[k]` (counters are monotonic).
    pub fn since(&self, before: &Counters, k: &str) -> u64 {
        self.get(k).saturating_sub(before.get(k))
    }
    /// One line listing the counters that changed since `before`.
    pub fn diff(&self, before: &Counters) -> String {
        let mut out = Vec::new();
        for (k, v) in &self.map {
            let b = before.get(k);
            if *v != b {
                out.push(format!("{k}+{}", v.saturating_sub(b)));
            }
        }
        format!("{}: [{}]", self.agent, out.join(" "))
    }
}

/// The counters of `agent`'s BOUNCE engine in the loaded plugin.
#[track_caller]
pub fn stats(agent: &str) -> Counters {
    let s = nixl_bounce::stats::plugin_stats(agent)
        .unwrap_or_else(|e| panic!("plugin_stats({agent}): {e}"));
    Counters {
        agent: agent.to_string(),
        map: s.counters,
        poisoned: s.poisoned,
    }
}

/// The counters of `agent`'s engine once `key` has grown by `n` since
/// `before`, or as they are when `wait` runs out. A READ's owner ends its
/// serve at the reader's last ACK, which crosses the control channel a
/// moment after the reader completed (and after the notification, which
/// takes NIXL's own path), so its counters may lag the reader's.
#[track_caller]
pub fn stats_once(agent: &str, before: &Counters, key: &str, n: u64, wait: Duration) -> Counters {
    let t0 = Instant::now();
    loop {
        let now = stats(agent);
        if now.since(before, key) >= n || t0.elapsed() > wait {
            return now;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Counters as one JSON object line (for child processes to print).
pub fn stats_json(agent: &str) -> String {
    let c = stats(agent);
    serde_json::to_string(&c.map).expect("json")
}

pub fn counters_from_json(agent: &str, json: &str) -> Counters {
    Counters {
        agent: agent.to_string(),
        map: serde_json::from_str(json).unwrap_or_else(|e| panic!("counters JSON {json:?}: {e}")),
        poisoned: None,
    }
}

/// The initiating side (the sender of a WRITE, the reader of a READ) took
/// the bounce path for exactly `n` more transfers, all succeeded, at least
/// `n` chunks were counted under `chunk_counter` (its own half of the
/// work), nothing fell back and the arena is not poisoned.
#[track_caller]
fn assert_initiator_bounced(before: &Counters, after: &Counters, n: u64, chunk_counter: &str) {
    let d = after.diff(before);
    assert_eq!(
        after.since(before, "bounce_submitted"),
        n,
        "bounce_submitted; {d}"
    );
    assert_eq!(
        after.since(before, "bounce_succeeded"),
        n,
        "bounce_succeeded; {d}"
    );
    assert_eq!(
        after.since(before, "bounce_failed"),
        0,
        "bounce_failed; {d}"
    );
    assert!(
        after.since(before, chunk_counter) >= n,
        "{chunk_counter}; {d}"
    );
    for f in after.map.keys().filter(|k| k.starts_with("fallback_")) {
        assert_eq!(after.since(before, f), 0, "{f} rose: {d}");
    }
    assert!(after.poisoned.is_none(), "poisoned: {:?}", after.poisoned);
}

/// The sender side took the bounce path for exactly `n` more WRITEs, all
/// succeeded (and wrote chunks), and nothing fell back.
#[track_caller]
pub fn assert_sender_bounced(before: &Counters, after: &Counters, n: u64) {
    assert_initiator_bounced(before, after, n, "chunks_written");
}

/// The reader's side of `n` more bounce READs: submitted, succeeded,
/// scattered, nothing fell back.
#[track_caller]
pub fn assert_reader_bounced(before: &Counters, after: &Counters, n: u64) {
    assert_initiator_bounced(before, after, n, "chunks_scattered");
}

/// The receiver side scattered at least `chunks` chunks and refused none.
#[track_caller]
pub fn assert_receiver_scattered(before: &Counters, after: &Counters, chunks: u64) {
    let d = after.diff(before);
    assert!(
        after.since(before, "chunks_scattered") >= chunks,
        "chunks_scattered; {d}"
    );
    // A chunk written into a standing slot (claimed by its WANT) has no
    // grant of its own.
    assert!(
        after.since(before, "grants") + after.since(before, "bounce_standing_taken") >= chunks,
        "grants; {d}"
    );
    assert_eq!(
        after.since(before, "scatter_refused"),
        0,
        "scatter_refused; {d}"
    );
    assert!(after.poisoned.is_none(), "poisoned: {:?}", after.poisoned);
}

/// The sender did NOT take the bounce path for its last `n` transfers, and
/// `reason` rose by `n`.
#[track_caller]
pub fn assert_fell_back(before: &Counters, after: &Counters, n: u64, reason: &str) {
    assert_fell_back_any(before, after, n, &[reason]);
}

/// Like [`assert_fell_back`], with any one of `reasons` accepted.
#[track_caller]
pub fn assert_fell_back_any(before: &Counters, after: &Counters, n: u64, reasons: &[&str]) {
    let d = after.diff(before);
    assert_eq!(
        after.since(before, "bounce_submitted"),
        0,
        "bounce_submitted; {d}"
    );
    assert_eq!(
        after.since(before, "chunks_written"),
        0,
        "chunks_written; {d}"
    );
    let rose: u64 = reasons.iter().map(|r| after.since(before, r)).sum();
    assert_eq!(rose, n, "none of {reasons:?} rose by {n}; {d}");
}

// ---------------------------------------------------------------------------
// Agents
// ---------------------------------------------------------------------------

/// A BOUNCE node on an agent created with `sync` (`Rw` lets NIXL call the
/// engine from several threads at once; `Strict` serialises the agent).
pub fn node_with(name: &str, extra: &[(&str, &str)], sync: ThreadSync) -> Result<Node, String> {
    let cfg = AgentConfig {
        thread_sync: sync,
        ..AgentConfig::default()
    };
    let agent = Agent::new_configured(name, &cfg)
        .map_err(|e| format!("Agent::new_configured({name}): {e:?}"))?;
    let params = backend_params(&agent, "BOUNCE", extra)?;
    let backend = agent
        .create_backend("BOUNCE", &params)
        .map_err(|e| format!("create_backend(BOUNCE, {extra:?}): {e:?}"))?;
    Ok(Node {
        name: name.to_string(),
        backend_name: "BOUNCE".into(),
        backend,
        agent,
    })
}

/// An endpoint (node + one registered, patterned buffer).
#[track_caller]
pub fn endpoint(
    prefix: &str,
    extra: &[(&str, &str)],
    len: usize,
    seed: u64,
    sync: ThreadSync,
) -> Endpoint {
    let node = node_with(&unique_name(prefix), extra, sync).or_fail(&format!("create {prefix}"));
    let buf = DramBuffer::with_pattern(len, seed);
    let reg = node
        .register(&buf)
        .or_fail(&format!("register {prefix}'s buffer"));
    Endpoint {
        reg: Some(reg),
        buf,
        node,
    }
}

/// `a` loads `b`'s metadata.
#[track_caller]
pub fn load(a: &Node, b: &Node) {
    let n = a
        .load_md(&b.local_md().or_fail("local md"))
        .or_fail(&format!("{} loads {}", a.name, b.name));
    assert_eq!(n, b.name);
}

/// Both load each other's metadata.
#[track_caller]
pub fn pair_up(a: &Node, b: &Node) {
    load(a, b);
    load(b, a);
}

/// `extra` with LOOPBACK added.
pub fn with_loopback<'a>(extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut v = vec![LOOPBACK];
    v.extend_from_slice(extra);
    v
}

// ---------------------------------------------------------------------------
// Plans in slices
// ---------------------------------------------------------------------------

/// A scattered plan of `n` blocks whose source lies in the slice starting at
/// `src_base` (`src_blocks` blocks) and destination in the slice starting at
/// `dst_base` (`dst_blocks` blocks) of their buffers.
pub fn plan_in(
    n: usize,
    block: usize,
    src_base: usize,
    src_blocks: usize,
    dst_base: usize,
    dst_blocks: usize,
    seed: u64,
) -> Plan {
    let mut p = Plan::scattered(n, block, src_blocks, dst_blocks, seed);
    for o in &mut p.src {
        *o += src_base;
    }
    for o in &mut p.dst {
        *o += dst_base;
    }
    p
}

/// What a destination holds after all `(plan, source bytes)` were applied.
/// The plans' destinations must be disjoint.
pub fn expected_after(dst_before: &[u8], writes: &[(&Plan, &[u8])]) -> Vec<u8> {
    let mut out = dst_before.to_vec();
    for (p, src) in writes {
        for (s, d) in p.src.iter().zip(&p.dst) {
            out[*d..*d + p.block].copy_from_slice(&src[*s..*s + p.block]);
        }
    }
    out
}

/// Byte-exact check of a whole destination against `expected_after`.
pub fn verify_all(
    what: &str,
    dst: &DramBuffer,
    expected: &[u8],
    writes: &[(&Plan, &[u8])],
) -> Result<(), String> {
    verify_bytes(dst.as_slice(), expected, |off| {
        for (i, (p, _)) in writes.iter().enumerate() {
            if let Some(k) = p.dst.iter().position(|d| off >= *d && off < *d + p.block) {
                return format!("inside destination block of descriptor {k} of write {i}");
            }
        }
        "OUTSIDE every destination block".into()
    })
    .map_err(|e| format!("{what}: {e}"))?;
    dst.check_guards().map_err(|e| format!("{what}: {e}"))
}

// ---------------------------------------------------------------------------
// Waiting
// ---------------------------------------------------------------------------

/// Poll one request once: Ok(true) when done.
pub fn poll(node: &Node, req: &XferRequest) -> Result<bool, String> {
    match node.agent.get_xfer_status(req) {
        Ok(XferStatus::Success) => Ok(true),
        Ok(XferStatus::InProgress) => Ok(false),
        Err(e) => Err(format!("get_xfer_status: {e} ({e:?})")),
    }
}

/// Post a request (no wait).
pub fn post(node: &Node, req: &XferRequest) -> Result<(), String> {
    node.agent
        .post_xfer_req(req, None)
        .map(|_| ())
        .map_err(|e| format!("post_xfer_req: {e} ({e:?})"))
}

/// Drain the notifications `node` has received, as (agent, message).
pub fn take_notifs(node: &Node) -> Result<Vec<(String, Vec<u8>)>, String> {
    node.take_notifs()
}

/// Sleep-free short pause between polls.
pub fn pause(spins: &mut u64) {
    *spins += 1;
    if (*spins).is_multiple_of(256) {
        std::thread::sleep(Duration::from_micros(100));
    } else {
        std::thread::yield_now();
    }
}

/// Deadline helper: panics with `what` once `limit` has passed since `t0`.
#[track_caller]
pub fn check_deadline(t0: Instant, limit: Duration, what: &dyn Fn() -> String) {
    if t0.elapsed() > limit {
        panic!("timed out after {limit:?}: {}", what());
    }
}

/// Resident set size of this process in bytes (from /proc/self/statm).
pub fn rss_bytes() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

// ---------------------------------------------------------------------------
// Published handshake
// ---------------------------------------------------------------------------

/// The BOUNCE handshake inside an agent's metadata blob. NIXL carries the
/// backend's connection info and each registered region's public data
/// verbatim; the handshake is in the connection info (`NXBOUNCE`) or, when
/// the arena is set up at the first registration, in the public data of a
/// region (`NXBPUBLC`). Found by magic, cut to exact length (layouts in
/// `engine::conn_info`). Panics when there is none.
pub fn handshake_of(agent_md: &[u8]) -> nixl_bounce::proto::wire::Handshake {
    try_handshake_of(agent_md).unwrap_or_else(|e| panic!("{e}"))
}

fn le_u32(b: &[u8], o: usize) -> Option<usize> {
    b.get(o..o + 4)
        .map(|x| u32::from_le_bytes(x.try_into().unwrap()) as usize)
}

/// Every occurrence of `magic` in `hay`.
fn find_all<'a>(hay: &'a [u8], magic: &'a [u8]) -> impl Iterator<Item = usize> + 'a {
    hay.windows(magic.len())
        .enumerate()
        .filter(move |(_, w)| *w == magic)
        .map(|(i, _)| i)
}

/// The handshake, or why there is none (no BOUNCE metadata, or no region
/// and no connection info offering a bounce path).
pub fn try_handshake_of(agent_md: &[u8]) -> Result<nixl_bounce::proto::wire::Handshake, String> {
    use nixl_bounce::engine::conn_info::{ConnInfo, PublicData, MAGIC, PUBLIC_MAGIC};
    use nixl_bounce::proto::wire::Handshake;
    let mut seen = Vec::new();
    for at in find_all(agent_md, MAGIC) {
        let rest = &agent_md[at..];
        let Some(md_len) = le_u32(rest, 10) else {
            continue;
        };
        let Some(hs_len) = le_u32(rest, 14 + md_len) else {
            continue;
        };
        let Some(blob) = rest.get(..18 + md_len + hs_len) else {
            continue;
        };
        match ConnInfo::decode(blob) {
            // Handshakes travel with regions, never in the connection info.
            Ok(_) => seen.push("connection info (no handshake there)".to_string()),
            Err(e) => seen.push(format!("connection info: {e}")),
        }
    }
    for at in find_all(agent_md, PUBLIC_MAGIC) {
        let rest = &agent_md[at..];
        let Some(md_len) = le_u32(rest, 10) else {
            continue;
        };
        let Some(bb_len) = le_u32(rest, 14 + md_len) else {
            continue;
        };
        // Version 2 adds a length-prefixed peer-map block, version 3 a
        // CMA block.
        let mut end = 18 + md_len + bb_len;
        let version = rest
            .get(8..10)
            .map_or(0, |v| u16::from_le_bytes([v[0], v[1]]));
        let mut truncated = false;
        for _ in 2..=version {
            let Some(block_len) = le_u32(rest, end) else {
                truncated = true;
                break;
            };
            end += 4 + block_len;
        }
        if truncated {
            continue;
        }
        let Some(blob) = rest.get(..end) else {
            continue;
        };
        match PublicData::decode(blob) {
            Ok(PublicData {
                bounce: Some(b), ..
            }) if !b.handshake.is_empty() => {
                return Handshake::decode(&b.handshake).map_err(|e| format!("handshake: {e}"))
            }
            Ok(_) => seen.push("a region without a bounce path".to_string()),
            Err(e) => seen.push(format!("region data: {e}")),
        }
    }
    Err(format!("the agent offers no bounce path (seen: {seen:?})"))
}

/// A prepared READ of `plan` from `owner`'s buffer (the plan's source) into
/// `reader`'s buffer (the plan's destination).
pub fn read_request(
    reader: &Endpoint,
    owner: &Endpoint,
    plan: &Plan,
    notif: Option<&[u8]>,
) -> nixl_sys::XferRequest {
    reader
        .node
        .create_xfer(
            XferOp::Read,
            plan,
            reader.buf.addr(),
            owner.buf.addr(),
            &owner.node.name.clone(),
            notif,
        )
        .or_fail("create_xfer_req(READ)")
}

/// A prepared WRITE of `plan` from `a`'s buffer into `b`'s buffer.
pub fn write_request(a: &Endpoint, b: &Endpoint, plan: &Plan) -> XferRequest {
    a.node
        .create_xfer(
            XferOp::Write,
            plan,
            a.buf.addr(),
            b.buf.addr(),
            &b.node.name.clone(),
            None,
        )
        .or_fail("create_xfer_req")
}

/// A timeline's steps: (step, request, chunk) -> first time, in ns.
pub type TraceSteps = std::collections::HashMap<(String, u64, Option<u32>), u64>;

/// The steps in a timeline file (`NIXL_BOUNCE_TRACE`). Each submission
/// must carry `bytes`.
pub fn trace_steps(path: &std::path::Path, bytes: usize) -> TraceSteps {
    let text = std::fs::read_to_string(path).expect("read a trace file");
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("t_ns\tstep\trequest\tchunk\tbytes"),
        "{path:?}"
    );
    let mut steps = std::collections::HashMap::new();
    for line in lines {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f.len(), 5, "{line:?}");
        if f[1] == "submit" {
            assert_eq!(f[4], bytes.to_string(), "the request's bytes");
        }
        let t: u64 = f[0].parse().expect("t_ns");
        let key = (
            f[1].to_string(),
            f[2].parse().expect("request"),
            f[3].parse().ok(),
        );
        steps.entry(key).or_insert(t);
    }
    steps
}

/// A fresh directory named in `NIXL_BOUNCE_TRACE` while this lives (set it
/// before the engines start, read it after they end); the variable is unset
/// and the directory removed however the test ends.
pub struct TraceDir(std::path::PathBuf);

impl TraceDir {
    pub fn new() -> TraceDir {
        let dir = std::env::temp_dir().join(format!("nixl-bounce-trace-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("trace directory");
        std::env::set_var("NIXL_BOUNCE_TRACE", &dir);
        TraceDir(dir)
    }

    /// The two engines' timelines, the side that submitted first.
    pub fn sides(&self, bytes: usize) -> (TraceSteps, TraceSteps) {
        let files: Vec<_> = std::fs::read_dir(&self.0)
            .expect("list the trace directory")
            .map(|e| e.expect("entry").path())
            .collect();
        assert_eq!(files.len(), 2, "one timeline per engine: {files:?}");
        let mut steps: Vec<_> = files.iter().map(|f| trace_steps(f, bytes)).collect();
        let submitter = steps
            .iter()
            .position(|s| s.keys().any(|k| k.0 == "submit"))
            .expect("a submission");
        let first = steps.swap_remove(submitter);
        let other = steps.pop().expect("the other side");
        (first, other)
    }
}

impl Drop for TraceDir {
    fn drop(&mut self) {
        std::env::remove_var("NIXL_BOUNCE_TRACE");
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
