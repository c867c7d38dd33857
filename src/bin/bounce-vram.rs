//! VRAM transfers between two processes, through BOUNCE or UCX: the GPU
//! tests and the GPU benchmark of nixl-bounce in one binary (the GPU machine
//! has no cargo, so it runs this prebuilt; see docs/gpu.md).
//!
//! The initiator process re-executes itself as the target (`serve`, driven
//! over stdin/stdout). Both sides compute the same seeded plans and
//! patterns; the target checks its own VRAM byte-exact after each WRITE;
//! after each READ (the initiator reads the target's VRAM into its own) the
//! initiator checks its VRAM and the target that its source is unchanged.
//!
//!   bounce-vram test  [--device N] [--target-device N] [--param K=V]...
//!   bounce-vram bench [--backend BOUNCE|UCX] [--label L] [--param K=V]...
//!                     [--counts 1024,4096,16384] [--sizes 4096] [--iters N]
//!                     [--concurrent 128] [--json PATH] [--op write|read]
//!                     [--gap-us N]
//!                     (--gap-us: an idle pause before each request, outside
//!                     the timing, as between a real client's requests)
//!                     (--op read: the initiator READs the target's buffer; the
//!                     target is the data owner)
//!   bounce-vram faults [--device N] [--target-device N] [--param K=V]...
//!   bounce-vram mapping [--device N] [--target-device N] [--buffer BYTES]
//!                     [--iters N] [--json PATH]
//!                     (no NIXL transfer: what a CUDA IPC mapping of the
//!                     target's buffer allows; cuMemcpyDtoDAsync and the copy
//!                     kernel, contiguous and scattered, local->local against
//!                     local->peer and peer->local through the mapping)
//!
//! Same-host peers take the peer-mapped path by default (one kernel through
//! a CUDA IPC mapping of the target's buffer); `--param
//! enable_peer_map=false` tests and measures the bounce path instead. Each
//! case checks from the counters which path carried it (`peer`, `bounce`
//! or `ucx`).
//!
//! `faults` runs the fault drills with VRAM arenas on both sides (2 MiB
//! chunks, 16 MiB arenas unless given): a WRITE released during gather,
//! write and scatter (stages held by failpoints), and the target killed
//! mid-transfer; each checks the request ends within its bound, both arenas
//! drain with every byte accounted for, nothing outside the destinations
//! changed, and the next WRITE is byte-exact.
//!
//! Without a CUDA driver every command prints `SKIP: ...` and exits 0.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaEvent, CudaStream};
use nixl_bounce::copy::cuda::{CudaDevice, CudaRuntime};
use nixl_bounce::copy::peer::{PeerCopier, PeerMapping, PeerTable, IPC_HANDLE_LEN};
use nixl_bounce::dataplane::vram::DeviceArena;
use nixl_sys::{
    Agent, MemType, OptArgs, Params, RegistrationHandle, XferDescList, XferOp, XferRequest,
    XferStatus,
};

const TAG: &str = "@@VR ";
const TIMEOUT: Duration = Duration::from_secs(60);

// ---- deterministic plans and patterns ------------------------------------------

struct SplitMix(u64);
impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
        v
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut r = SplitMix(seed ^ 0x5eed);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&r.next().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// One or more plans, as both processes rebuild them from a command line:
/// `parts` plans of `n` moves each, part `t` over slots
/// `[t*slots, (t+1)*slots)` with seed `seed + t`.
fn plans(parts: usize, n: usize, size: usize, slots: usize, seed: u64, mixed: bool) -> Vec<Plan> {
    (0..parts)
        .map(|t| plan(n, size, slots, t * slots * size, seed + t as u64, mixed))
        .collect()
}

/// The destination buffer after applying `plans` from source pattern `sseed`
/// over destination pattern `dseed`.
fn expected(len: usize, plans: &[Plan], sseed: u64, dseed: u64) -> Vec<u8> {
    let src = pattern(len, sseed);
    let mut want = pattern(len, dseed);
    for p in plans {
        for &(s, d, l) in &p.moves {
            want[d..d + l].copy_from_slice(&src[s..s + l]);
        }
    }
    want
}

/// `n` moves of `size` bytes: source block i -> destination block, both
/// scattered over `slots` blocks of `size` starting at `base` (bytes) of each
/// buffer. Mixed mode varies the length per descriptor (1..=size).
#[derive(Clone)]
struct Plan {
    moves: Vec<(usize, usize, usize)>, // (src off, dst off, len)
}

fn plan(n: usize, size: usize, slots: usize, base: usize, seed: u64, mixed: bool) -> Plan {
    let mut r = SplitMix(seed);
    let src = r.perm(slots);
    let dst = r.perm(slots);
    let moves = (0..n)
        .map(|i| {
            let len = if mixed {
                1 + (r.next() as usize % size)
            } else {
                size
            };
            (base + src[i] * size, base + dst[i] * size, len)
        })
        .collect();
    Plan { moves }
}

// ---- NIXL plumbing -------------------------------------------------------------

fn die(msg: String) -> ! {
    eprintln!("bounce-vram: {msg}");
    std::process::exit(1)
}

fn agent(name: &str, backend: &str, params: &[(String, String)]) -> Result<Agent, String> {
    let a = Agent::new(name).map_err(|e| format!("Agent::new: {e}"))?;
    let (_m, defaults) = a
        .get_plugin_params(backend)
        .map_err(|e| format!("plugin params of {backend}: {e}"))?;
    let mut p: Params = defaults.clone().map_err(|e| format!("params: {e}"))?;
    for (k, v) in params {
        p.set(k, v).map_err(|e| format!("param {k}: {e}"))?;
    }
    a.create_backend(backend, &p)
        .map_err(|e| format!("create_backend({backend}): {e}"))?;
    Ok(a)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}

fn xfer_list(
    base: usize,
    dev: u64,
    items: impl Iterator<Item = (usize, usize)>,
) -> XferDescList<'static> {
    let mut l = XferDescList::new(MemType::Vram).expect("descriptor list");
    for (off, len) in items {
        l.add_desc(base + off, len, dev);
    }
    l
}

/// Posts `req`, naming the failure.
fn post(a: &Agent, req: &XferRequest) -> Result<(), String> {
    a.post_xfer_req(req, None)
        .map(drop)
        .map_err(|e| format!("post: {e}"))
}

/// Posts `req` and waits for it; returns the time from post to completion.
fn post_and_wait(a: &Agent, req: &XferRequest) -> Result<Duration, String> {
    let t0 = Instant::now();
    post(a, req)?;
    wait(a, req)?;
    Ok(t0.elapsed())
}

fn wait(a: &Agent, req: &XferRequest) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        match a.get_xfer_status(req) {
            Ok(XferStatus::Success) => return Ok(()),
            Ok(XferStatus::InProgress) => {}
            Err(e) => return Err(format!("transfer failed: {e}")),
        }
        if t0.elapsed() > TIMEOUT {
            return Err("transfer still running after 60 s".into());
        }
        std::hint::spin_loop();
    }
}

fn plugin_counters(name: &str) -> BTreeMap<String, u64> {
    nixl_bounce::stats::plugin_stats(name)
        .map(|s| s.counters)
        .unwrap_or_default()
}

/// Which path carried the requests counted between two snapshots of the
/// initiator's counters (and, for the bounce path's READ, the owner's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
enum Path {
    Peer,
    Bounce,
    Ucx,
}

impl Path {
    fn of(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> Path {
        if since(after, before, "peer_map_succeeded") > 0 {
            Path::Peer
        } else if since(after, before, "bounce_succeeded") > 0 {
            Path::Bounce
        } else {
            Path::Ucx
        }
    }
    fn name(self) -> &'static str {
        match self {
            Path::Peer => "peer",
            Path::Bounce => "bounce",
            Path::Ucx => "ucx",
        }
    }
}

// ---- the target process --------------------------------------------------------

fn serve(args: &Args) {
    let cuda = CudaRuntime::probe().unwrap_or_else(|e| die(e));
    let dev = cuda.device(args.target_device).unwrap_or_else(|e| die(e));
    let buf = DeviceArena::new(&dev, args.buffer).unwrap_or_else(|e| die(e));
    let name = format!("vram-target-{}", std::process::id());
    let a = agent(&name, &args.backend, &args.params).unwrap_or_else(|e| die(e));
    // Kept, and dropped before the agent (declared after it): a forgotten
    // registration keeps the agent alive past QUIT, so its engine would
    // never end (and never write its NIXL_BOUNCE_TRACE timeline).
    let _registration = a
        .register_memory(&buf, None)
        .unwrap_or_else(|e| die(format!("register: {e}")));
    let md = a
        .get_local_md()
        .unwrap_or_else(|e| die(format!("metadata: {e}")));
    let reply = |s: String| {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "{TAG}{s}");
        let _ = o.flush();
    };
    reply(format!("MD {} {} {}", name, buf.base(), hex(&md)));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["FILL", seed] => {
                let seed: u64 = seed.parse().unwrap_or(0);
                match buf.write(0, &pattern(args.buffer, seed)) {
                    Ok(()) => reply("OK".into()),
                    Err(e) => reply(format!("ERR {e}")),
                }
            }
            ["CHECK", parts, n, size, slots, pseed, sseed, dseed, mixed] => {
                let p = |s: &str| s.parse::<usize>().unwrap_or(0);
                let ps = plans(
                    p(parts),
                    p(n),
                    p(size),
                    p(slots),
                    p(pseed) as u64,
                    *mixed == "1",
                );
                let want = expected(args.buffer, &ps, p(sseed) as u64, p(dseed) as u64);
                let mut got = vec![0u8; args.buffer];
                match buf.read(0, &mut got) {
                    Err(e) => reply(format!("ERR {e}")),
                    Ok(()) => match got.iter().zip(&want).position(|(a, b)| a != b) {
                        None => reply("OK".into()),
                        Some(i) => reply(format!(
                            "ERR first wrong byte at offset {i}: {} != {}",
                            got[i], want[i]
                        )),
                    },
                }
            }
            ["CHECK_OUTSIDE", parts, n, size, slots, pseed, dseed, mixed] => {
                let p = |s: &str| s.parse::<usize>().unwrap_or(0);
                let ps = plans(
                    p(parts),
                    p(n),
                    p(size),
                    p(slots),
                    p(pseed) as u64,
                    *mixed == "1",
                );
                let mut got = vec![0u8; args.buffer];
                match buf.read(0, &mut got) {
                    Err(e) => reply(format!("ERR {e}")),
                    Ok(()) => {
                        // The fill everywhere, except what the destinations
                        // now hold (unspecified after a failed request).
                        let mut want = pattern(args.buffer, p(dseed) as u64);
                        for plan in &ps {
                            for &(_, d, l) in &plan.moves {
                                want[d..d + l].copy_from_slice(&got[d..d + l]);
                            }
                        }
                        match got.iter().zip(&want).position(|(a, b)| a != b) {
                            None => reply("OK".into()),
                            Some(i) => reply(format!(
                                "ERR byte {i} outside every destination changed: {} != {}",
                                got[i], want[i]
                            )),
                        }
                    }
                }
            }
            // The IPC export of the allocation holding the buffer
            // (`mapping`): base, length, handle, GPU UUID, buffer base.
            ["IPC"] => {
                match nixl_bounce::copy::peer::export_allocation(args.target_device, buf.base()) {
                    Ok((base, len, handle, uuid)) => reply(format!(
                        "OK {base} {len} {} {} {}",
                        hex(&handle),
                        hex(&uuid),
                        buf.base()
                    )),
                    Err(e) => reply(format!("ERR exporting the target buffer: {e}")),
                }
            }
            ["STATS"] => reply(format!(
                "OK {}",
                serde_json::to_string(&plugin_counters(&name)).unwrap_or_default()
            )),
            ["QUIT"] => break,
            _ => reply(format!("ERR unknown command {line:?}")),
        }
    }
}

struct Target {
    child: Child,
    stdin: ChildStdin,
    lines: std::io::Lines<BufReader<ChildStdout>>,
    name: String,
    base: usize,
    metadata: Vec<u8>,
}

impl Target {
    /// Starts the target process with `failpoints` (`NIXL_BOUNCE_FAILPOINTS`).
    fn spawn(args: &Args, failpoints: &str) -> Result<Target, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(exe);
        cmd.arg("serve")
            .args(args.forward())
            .env(FAILPOINTS, failpoints)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("spawning the target: {e}"))?;
        let stdin = child.stdin.take().expect("piped");
        let lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let mut t = Target {
            child,
            stdin,
            lines,
            name: String::new(),
            base: 0,
            metadata: Vec::new(),
        };
        let first = t.reply()?;
        let w: Vec<&str> = first.split_whitespace().collect();
        if w.len() != 4 || w[0] != "MD" {
            return Err(format!("unexpected first line from the target: {first:?}"));
        }
        t.name = w[1].to_string();
        t.base = w[2]
            .parse()
            .map_err(|_| "bad base address from the target".to_string())?;
        t.metadata = unhex(w[3]);
        Ok(t)
    }

    fn reply(&mut self) -> Result<String, String> {
        for line in self.lines.by_ref() {
            let line = line.map_err(|e| e.to_string())?;
            if let Some(rest) = line.strip_prefix(TAG) {
                return Ok(rest.to_string());
            }
        }
        Err("the target exited".into())
    }

    fn cmd(&mut self, line: &str) -> Result<String, String> {
        writeln!(self.stdin, "{line}").map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        let r = self.reply()?;
        if let Some(err) = r.strip_prefix("ERR") {
            return Err(err.trim().to_string());
        }
        Ok(r.trim_start_matches("OK").trim().to_string())
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "QUIT");
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
    }
}

// ---- the initiator -------------------------------------------------------------

/// Fields drop in order: the registration (deregisters), the agent (its
/// engine and IO thread stop), the target process, and only then the buffer.
struct Initiator {
    _registration: RegistrationHandle,
    agent: Agent,
    target: Target,
    name: String,
    buf: DeviceArena,
    dev: u64,
    target_name: String,
}

const FAILPOINTS: &str = "NIXL_BOUNCE_FAILPOINTS";

impl Initiator {
    fn new(args: &Args) -> Result<Initiator, String> {
        Self::with_failpoints(args, "", "")
    }

    /// With failpoints for this process's engine and for the target's.
    fn with_failpoints(args: &Args, mine: &str, target: &str) -> Result<Initiator, String> {
        let cuda = CudaRuntime::probe()?;
        let dev = cuda.device(args.device)?;
        let buf = DeviceArena::new(&dev, args.buffer)?;
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let name = format!(
            "vram-init-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        // Read once, when the engine is created.
        std::env::set_var(FAILPOINTS, mine);
        let agent = agent(&name, &args.backend, &args.params);
        std::env::remove_var(FAILPOINTS);
        let agent = agent?;
        let registration = agent
            .register_memory(&buf, None)
            .map_err(|e| format!("register: {e}"))?;
        let target = Target::spawn(args, target)?;
        let loaded = agent
            .load_remote_md(&target.metadata)
            .map_err(|e| format!("loading the target's metadata: {e}"))?;
        if loaded != target.name {
            return Err(format!("loaded {loaded:?}, expected {:?}", target.name));
        }
        Ok(Initiator {
            _registration: registration,
            agent,
            name,
            dev: args.device as u64,
            buf,
            target_name: loaded,
            target,
        })
    }

    fn request(&self, plan: &Plan, notif: Option<&[u8]>) -> Result<XferRequest, String> {
        self.request_op(XferOp::Write, plan, notif)
    }

    /// A WRITE of `plan` from this buffer into the target's, or a READ of it
    /// from the target's buffer (moves: source offset, destination offset).
    fn request_op(
        &self,
        op: XferOp,
        plan: &Plan,
        notif: Option<&[u8]>,
    ) -> Result<XferRequest, String> {
        type Spans = Vec<(usize, usize)>; // (offset, length)
        let (local, remote): (Spans, Spans) = match op {
            XferOp::Write => plan.moves.iter().map(|&(s, d, l)| ((s, l), (d, l))).unzip(),
            XferOp::Read => plan.moves.iter().map(|&(s, d, l)| ((d, l), (s, l))).unzip(),
        };
        let l = xfer_list(self.buf.base() as usize, self.dev, local.into_iter());
        let r = xfer_list(self.target.base, self.target_device(), remote.into_iter());
        let mut opt = OptArgs::new().map_err(|e| e.to_string())?;
        if let Some(m) = notif {
            opt.set_has_notification(true).map_err(|e| e.to_string())?;
            opt.set_notification_message(m).map_err(|e| e.to_string())?;
        }
        self.agent
            .create_xfer_req(op, &l, &r, &self.target_name, Some(&opt))
            .map_err(|e| {
                format!(
                    "create_xfer_req ({op:?}, {} descriptors): {e}",
                    plan.moves.len()
                )
            })
    }

    fn target_device(&self) -> u64 {
        TARGET_DEVICE.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One verified WRITE; returns its duration.
    fn checked_write(
        &mut self,
        n: usize,
        size: usize,
        seed: u64,
        mixed: bool,
        args: &Args,
    ) -> Result<Duration, String> {
        let slots = args.buffer / size;
        let p = plan(n, size, slots, 0, seed, mixed);
        let (sseed, dseed) = (seed * 2 + 1, seed * 2 + 2);
        let n = p.moves.len();
        self.buf.write(0, &pattern(args.buffer, sseed))?;
        self.target.cmd(&format!("FILL {dseed}"))?;
        let req = self.request(&p, None)?;
        let dt = post_and_wait(&self.agent, &req)?;
        drop(req);
        self.target.cmd(&format!(
            "CHECK 1 {n} {size} {slots} {seed} {sseed} {dseed} {}",
            u8::from(mixed)
        ))?;
        Ok(dt)
    }
}

impl Initiator {
    /// One verified READ of the target's VRAM into this process's; returns
    /// its duration.
    fn checked_read(
        &mut self,
        n: usize,
        size: usize,
        seed: u64,
        mixed: bool,
        args: &Args,
    ) -> Result<Duration, String> {
        let slots = args.buffer / size;
        let p = plan(n, size, slots, 0, seed, mixed);
        let (sseed, dseed) = (seed * 2 + 1, seed * 2 + 2);
        self.target.cmd(&format!("FILL {sseed}"))?;
        self.buf.write(0, &pattern(args.buffer, dseed))?;
        let req = self.request_op(XferOp::Read, &p, None)?;
        let dt = post_and_wait(&self.agent, &req)?;
        drop(req);
        let want = expected(args.buffer, std::slice::from_ref(&p), sseed, dseed);
        let mut got = vec![0u8; args.buffer];
        self.buf.read(0, &mut got)?;
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            return Err(format!(
                "READ destination: first wrong byte at offset {i}: {} != {}",
                got[i], want[i]
            ));
        }
        // The source is unchanged (no plan: the pattern itself).
        self.target
            .cmd(&format!("CHECK 0 0 {size} {slots} 0 0 {sseed} 0"))?;
        Ok(dt)
    }
}

static TARGET_DEVICE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

// ---- commands ------------------------------------------------------------------

fn run_tests(args: &Args) -> bool {
    let mut passed = 0;
    let mut failed = 0;
    let mut check = |name: &str, r: Result<String, String>| match r {
        Ok(detail) => {
            passed += 1;
            println!("test {name} ... ok {detail}");
        }
        Err(e) => {
            failed += 1;
            println!("test {name} ... FAILED: {e}");
        }
    };
    match Initiator::new(args) {
        Err(e) => check("setup", Err(e)),
        Ok(mut init) => {
            let writes = [
                (1, 4096, false),
                (1024, 4096, false),
                (16384, 4096, false),
                (4096, 16384, true),
            ];
            let reads = [
                (1024, 4096, false),
                (16384, 4096, false),
                (4096, 16384, true),
            ];
            let cases = writes
                .iter()
                .map(|&c| (XferOp::Write, c))
                .chain(reads.iter().map(|&c| (XferOp::Read, c)));
            for (i, (op, (n, size, mixed))) in cases.enumerate() {
                if i == writes.len() {
                    // Between the WRITEs and the READs.
                    let r = concurrent(&mut init, args);
                    check("concurrent_threads", r);
                }
                // One descriptor is below the arena's routing gate (at least
                // 256 on VRAM); the peer-mapped path takes any count.
                let want = match args.expected_path() {
                    Path::Bounce if n < 256 => Path::Ucx,
                    p => p,
                };
                let r = checked_case(&mut init, op, n, size, mixed, want, args);
                let name = match op {
                    XferOp::Read => "read",
                    _ => "write",
                };
                check(
                    &format!("{name}_{n}x{size}{}", if mixed { "_mixed" } else { "" }),
                    r,
                );
            }
        }
    }
    println!("\n{passed} passed, {failed} failed");
    failed == 0
}

/// One byte-exact WRITE or READ of `n` x `size` (a fresh random plan), and
/// whether it took the path expected: the peer-mapped path (the target's
/// bounce path untouched), the bounce path on both sides (for a READ the
/// owner must have served it) or UCX.
fn checked_case(
    init: &mut Initiator,
    op: XferOp,
    n: usize,
    size: usize,
    mixed: bool,
    want: Path,
    args: &Args,
) -> Result<String, String> {
    let before = plugin_counters(&init.name);
    let served_before = target_counters(&mut init.target);
    let dt = match op {
        XferOp::Read => init.checked_read(n, size, 50 + n as u64, mixed, args)?,
        _ => init.checked_write(n, size, 7 + n as u64, mixed, args)?,
    };
    let after = plugin_counters(&init.name);
    let served = target_counters(&mut init.target);
    let path = Path::of(&before, &after);
    let peer = since(&after, &before, "peer_map_succeeded");
    let bounced = since(&after, &before, "bounce_succeeded");
    let owner_served = since(&served, &served_before, "reads_served");
    let target_scattered = since(&served, &served_before, "chunks_scattered");
    let exact = match path {
        Path::Peer => peer == 1 && bounced == 0 && owner_served == 0 && target_scattered == 0,
        Path::Bounce => bounced == 1 && (op != XferOp::Read || owner_served == 1),
        Path::Ucx => true,
    };
    if path != want || !exact {
        return Err(format!(
            "expected the {} path, took {}: initiator {after:?}, target {served:?}",
            want.name(),
            path.name()
        ));
    }
    Ok(format!(
        "({:.3} ms, {})",
        dt.as_secs_f64() * 1e3,
        path.name()
    ))
}

// ---- fault drills --------------------------------------------------------------

/// Arena bytes held by anything (flows, staging, orphans, quarantine).
fn arena_held(c: &BTreeMap<String, u64>) -> u64 {
    [
        "arena_flow_bytes",
        "arena_local_bytes",
        "arena_orphan_bytes",
        "arena_quarantine_bytes",
    ]
    .iter()
    .map(|k| c.get(*k).copied().unwrap_or(0))
    .sum()
}

fn arena_total(c: &BTreeMap<String, u64>) -> u64 {
    let get = |k: &str| c.get(k).copied().unwrap_or(0);
    get("arena_free_bytes") + get("arena_reserve_bytes") + arena_held(c)
}

fn since(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>, k: &str) -> u64 {
    let get = |m: &BTreeMap<String, u64>| m.get(k).copied().unwrap_or(0);
    get(after).saturating_sub(get(before))
}

/// Polls `cond` every millisecond up to `bound`; returns how long it took.
fn wait_until(
    bound: Duration,
    what: &str,
    mut cond: impl FnMut() -> bool,
) -> Result<Duration, String> {
    let t0 = Instant::now();
    while !cond() {
        if t0.elapsed() > bound {
            return Err(format!("{what}: not within {bound:?}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(t0.elapsed())
}

/// The bytes of every arena an agent's counters sum: one of `capacity` per
/// bounce instance (a GPU's own and its host-staged one).
fn all_arenas(c: &BTreeMap<String, u64>, capacity: u64) -> u64 {
    capacity * c.get("bounce_instances").copied().unwrap_or(1).max(1)
}

/// Both arenas hold nothing and every byte is accounted for; returns how
/// long that took.
fn arenas_idle(init: &mut Initiator, capacity: u64) -> Result<Duration, String> {
    let name = init.name.clone();
    let t = &mut init.target;
    let dt = wait_until(Duration::from_secs(10), "arenas idle", || {
        arena_held(&plugin_counters(&name)) == 0 && arena_held(&target_counters(t)) == 0
    })?;
    for c in [plugin_counters(&name), target_counters(&mut init.target)] {
        let expected = all_arenas(&c, capacity);
        if arena_total(&c) != expected {
            return Err(format!(
                "arena bytes not conserved ({expected} expected): {c:?}"
            ));
        }
    }
    Ok(dt)
}

/// The drill's WRITE: 16,384 x 4 KiB scattered over the buffers.
const DRILL_N: usize = 16384;
const DRILL_SIZE: usize = 4096;

/// A WRITE released (cancelled) once `stage` is reached, the stage held by
/// failpoints (`mine` for this process, `target` for the target's).
fn cancel_drill(args: &Args, stage: &str, mine: &str, target: &str) -> Result<String, String> {
    let capacity = args.arena_capacity();
    let mut init = Initiator::with_failpoints(args, mine, target)?;
    let slots = args.buffer / DRILL_SIZE;
    let (seed, sseed, dseed) = (31u64, 63u64, 64u64);
    let p = plan(DRILL_N, DRILL_SIZE, slots, 0, seed, false);
    init.buf.write(0, &pattern(args.buffer, sseed))?;
    init.target.cmd(&format!("FILL {dseed}"))?;
    let (b0, t0) = (
        plugin_counters(&init.name),
        target_counters(&mut init.target),
    );
    let req = init.request(&p, None)?;
    post(&init.agent, &req)?;
    let name = init.name.clone();
    let tgt = &mut init.target;
    wait_until(Duration::from_secs(20), stage, || {
        let (b, t) = (plugin_counters(&name), target_counters(tgt));
        match stage {
            "gather" => b.get("arena_local_bytes").copied().unwrap_or(0) > 0,
            "write" => since(&t, &t0, "grants") > 0 && since(&b, &b0, "gather_ns") > 0,
            _ => since(&b, &b0, "chunks_written") > 0,
        }
    })?;
    let t_release = Instant::now();
    drop(req);
    let released = t_release.elapsed();
    let terminal = wait_until(
        Duration::from_secs(10),
        "cancelled request terminal",
        || since(&plugin_counters(&name), &b0, "bounce_cancels") == 1,
    )?;
    let idle = arenas_idle(&mut init, capacity)?;
    init.target.cmd(&format!(
        "CHECK_OUTSIDE 1 {DRILL_N} {DRILL_SIZE} {slots} {seed} {dseed} 0"
    ))?;
    init.checked_write(4096, DRILL_SIZE, 41, false, args)?;
    arenas_idle(&mut init, capacity)?;
    Ok(format!(
        "(release {:.3} ms, terminal {:.1} ms, arenas idle {:.1} ms after)",
        released.as_secs_f64() * 1e3,
        terminal.as_secs_f64() * 1e3,
        idle.as_secs_f64() * 1e3
    ))
}

/// The target killed (SIGKILL) mid-transfer: the request fails within its
/// bound, this arena drains, and a new target is served byte-exact.
fn killed_target_drill(args: &Args) -> Result<String, String> {
    let capacity = args.arena_capacity();
    let mut init = Initiator::new(args)?;
    let slots = args.buffer / DRILL_SIZE;
    let p = plan(DRILL_N, DRILL_SIZE, slots, 0, 51, false);
    init.buf.write(0, &pattern(args.buffer, 52))?;
    let b0 = plugin_counters(&init.name);
    let req = init.request(&p, None)?;
    post(&init.agent, &req)?;
    let name = init.name.clone();
    wait_until(Duration::from_secs(20), "a chunk written", || {
        since(&plugin_counters(&name), &b0, "chunks_written") > 0
    })?;
    init.target.child.kill().map_err(|e| format!("kill: {e}"))?;
    let _ = init.target.child.wait();
    let t0 = Instant::now();
    let outcome = loop {
        match init.agent.get_xfer_status(&req) {
            Ok(XferStatus::Success) => break Ok(()),
            Ok(XferStatus::InProgress) if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_micros(200))
            }
            Ok(XferStatus::InProgress) => return Err("still running 10 s after the kill".into()),
            Err(e) => break Err(e.to_string()),
        }
    };
    let failed_in = t0.elapsed();
    drop(req);
    if outcome.is_ok() {
        return Err("a WRITE to a killed target succeeded".into());
    }
    let idle = wait_until(Duration::from_secs(10), "arena idle", || {
        arena_held(&plugin_counters(&name)) == 0
    })?;
    let c = plugin_counters(&name);
    let expected = all_arenas(&c, capacity);
    if arena_total(&c) != expected {
        return Err(format!(
            "arena bytes not conserved ({expected} expected): {c:?}"
        ));
    }
    // A new target.
    let dead = init.target_name.clone();
    let _ = init.agent.invalidate_remote_md(&dead);
    init.target = Target::spawn(args, "")?;
    init.target_name = init
        .agent
        .load_remote_md(&init.target.metadata)
        .map_err(|e| format!("loading the new target's metadata: {e}"))?;
    init.checked_write(4096, DRILL_SIZE, 53, false, args)?;
    Ok(format!(
        "(failed {:.1} ms after the kill, arena idle {:.1} ms after)",
        failed_in.as_secs_f64() * 1e3,
        idle.as_secs_f64() * 1e3
    ))
}

/// Waits up to 10 s for `req` to end; its outcome as text.
fn terminal(a: &Agent, req: &XferRequest) -> Result<&'static str, String> {
    let t0 = Instant::now();
    loop {
        match a.get_xfer_status(req) {
            Ok(XferStatus::Success) => return Ok("completed"),
            Ok(XferStatus::InProgress) if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_micros(200))
            }
            Ok(XferStatus::InProgress) => return Err("still running after 10 s".into()),
            Err(_) => return Ok("failed"),
        }
    }
}

/// The peer-mapped path (no arena): the target killed while a 16,384 x 4
/// KiB WRITE into its mapped memory runs, and another WRITE posted after
/// the kill. Each request ends within its bound, this process lives on,
/// forgetting the dead target closes its mapping, and a new target is
/// served byte-exact through its own mapping.
fn peer_killed_target_drill(args: &Args) -> Result<String, String> {
    let mut a = args.clone();
    a.params.retain(|(k, _)| k != "enable_peer_map");
    let mut init = Initiator::new(&a)?;
    let slots = a.buffer / DRILL_SIZE;
    let p = plan(DRILL_N, DRILL_SIZE, slots, 0, 61, false);
    init.buf.write(0, &pattern(a.buffer, 62))?;
    let before = plugin_counters(&init.name);
    let first = init.request(&p, None)?;
    let second = init.request(&p, None)?;
    post(&init.agent, &first)?;
    init.target.child.kill().map_err(|e| format!("kill: {e}"))?;
    let _ = init.target.child.wait();
    let o1 = terminal(&init.agent, &first)?;
    let o2 = match post(&init.agent, &second) {
        Ok(()) => terminal(&init.agent, &second)?,
        Err(_) => "refused at post",
    };
    drop((first, second));
    let after = plugin_counters(&init.name);
    if since(&after, &before, "peer_map_submitted") == 0 {
        return Err(format!(
            "the drill did not take the peer-mapped path: {after:?}"
        ));
    }
    let dead = init.target_name.clone();
    init.agent
        .invalidate_remote_md(&dead)
        .map_err(|e| format!("forgetting the dead target: {e}"))?;
    init.target = Target::spawn(&a, "")?;
    init.target_name = init
        .agent
        .load_remote_md(&init.target.metadata)
        .map_err(|e| format!("loading the new target's metadata: {e}"))?;
    let b2 = plugin_counters(&init.name);
    init.checked_write(4096, DRILL_SIZE, 63, false, &a)?;
    if Path::of(&b2, &plugin_counters(&init.name)) != Path::Peer {
        return Err("the new target was not served through its mapping".into());
    }
    Ok(format!(
        "(copy running at the kill: {o1}; posted after it: {o2})"
    ))
}

fn run_faults(args: &Args) -> bool {
    let mut failed = 0;
    type Drill = fn(&Args) -> Result<String, String>;
    let drills: [(&str, Drill); 5] = [
        ("cancel_during_gather", |a| {
            cancel_drill(a, "gather", "delay_gather_ms=300", "")
        }),
        ("cancel_during_write", |a| {
            cancel_drill(a, "write", "delay_write_ms=300", "")
        }),
        ("cancel_during_scatter", |a| {
            cancel_drill(a, "scatter", "", "delay_scatter_ms=300")
        }),
        ("target_killed_mid_transfer", killed_target_drill),
        ("peer_mapped_target_killed", peer_killed_target_drill),
    ];
    let total = drills.len();
    for (name, drill) in drills {
        match drill(args) {
            Ok(detail) => println!("test {name} ... ok {detail}"),
            Err(e) => {
                failed += 1;
                println!("test {name} ... FAILED: {e}");
            }
        }
    }
    println!("\n{} passed, {failed} failed", total - failed);
    failed == 0
}

/// Eight threads each post a 1024-descriptor WRITE into their own slice of
/// the target buffer at once; the target checks the whole buffer afterwards.
fn concurrent(init: &mut Initiator, args: &Args) -> Result<String, String> {
    let (threads, size, seed, sseed, dseed) = (8usize, 4096usize, 99u64, 201u64, 202u64);
    let per = args.buffer / size / threads;
    let n = per.min(1024);
    let ps = plans(threads, n, size, per, seed, false);
    init.buf.write(0, &pattern(args.buffer, sseed))?;
    init.target.cmd(&format!("FILL {dseed}"))?;
    let before = plugin_counters(&init.name);
    let t0 = Instant::now();
    let init_ref = &*init;
    std::thread::scope(|s| -> Result<(), String> {
        let handles: Vec<_> = ps
            .iter()
            .map(|p| {
                s.spawn(move || -> Result<(), String> {
                    let req = init_ref.request(p, None)?;
                    post_and_wait(&init_ref.agent, &req).map(drop)
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| "a submit thread panicked".to_string())??;
        }
        Ok(())
    })?;
    let dt = t0.elapsed();
    init.target.cmd(&format!(
        "CHECK {threads} {n} {size} {per} {seed} {sseed} {dseed} 0"
    ))?;
    let after = plugin_counters(&init.name);
    let peer = since(&after, &before, "peer_map_succeeded");
    let bounced = since(&after, &before, "bounce_succeeded");
    let want = args.expected_path();
    let carried = match want {
        Path::Peer => peer,
        Path::Bounce => bounced,
        Path::Ucx => threads as u64 - peer - bounced,
    };
    if carried != threads as u64 {
        return Err(format!(
            "expected the {} path for all {threads}: {peer} peer-mapped, {bounced} bounced",
            want.name()
        ));
    }
    Ok(format!(
        "({threads} threads x {n} x 4 KiB in {:.3} ms, {peer} peer-mapped, {bounced} bounced)",
        dt.as_secs_f64() * 1e3
    ))
}

#[derive(serde::Serialize)]
struct Row {
    label: String,
    backend: String,
    descriptors: usize,
    size: usize,
    inflight: usize,
    iterations: usize,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    gbps: f64,
    /// Accelerated (peer-mapped or bounce), as older JSON files say.
    bounce_path: bool,
    path: Path,
    /// Median time to prepare the request (`createXferReq`), not in p50.
    prep_p50_ms: f64,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn run_bench(args: &Args) -> bool {
    let mut init = match Initiator::new(args) {
        Ok(i) => i,
        Err(e) => die(e),
    };
    let mut rows = Vec::new();
    for &size in &args.sizes {
        for &n in &args.counts {
            if n * size * 2 > args.buffer {
                eprintln!("skip {n} x {size}: buffer too small");
                continue;
            }
            if let Err(e) = init.checked_write(n, size, 1000 + n as u64, false, args) {
                die(format!("{n} x {size}: verification failed: {e}"));
            }
            let slots = args.buffer / size;
            let p = plan(n, size, slots, 0, 5000 + n as u64, false);
            let before = plugin_counters(&init.name);
            let target_before = target_counters(&mut init.target);
            let mut times = Vec::new();
            let mut preps = Vec::new();
            for _ in 0..args.iters {
                if args.gap_us > 0 {
                    std::thread::sleep(Duration::from_micros(args.gap_us));
                }
                let t0 = Instant::now();
                let req = init
                    .request_op(args.op, &p, None)
                    .unwrap_or_else(|e| die(e));
                preps.push(t0.elapsed().as_secs_f64() * 1e3);
                let dt = post_and_wait(&init.agent, &req).unwrap_or_else(|e| die(e));
                times.push(dt.as_secs_f64() * 1e3);
            }
            preps.sort_by(f64::total_cmp);
            let after = plugin_counters(&init.name);
            let target_after = target_counters(&mut init.target);
            times.sort_by(f64::total_cmp);
            let p50 = percentile(&times, 0.5);
            let bytes = (n * size) as f64;
            let path = Path::of(&before, &after);
            let bounced = path == Path::Bounce;
            rows.push(Row {
                label: args.label.clone(),
                backend: args.backend.clone(),
                descriptors: n,
                size,
                inflight: 1,
                iterations: args.iters,
                p50_ms: p50,
                p90_ms: percentile(&times, 0.9),
                p99_ms: percentile(&times, 0.99),
                gbps: bytes / (p50 * 1e-3) / 1e9,
                bounce_path: path != Path::Ucx,
                path,
                prep_p50_ms: percentile(&preps, 0.5),
            });
            print_row(rows.last().expect("row"));
            if path == Path::Peer {
                let per =
                    |k: &str| since(&after, &before, k) as f64 / args.iters.max(1) as f64 / 1e6;
                println!(
                    "    peer-mapped prepare (in the plugin): {:.3} ms, of it table fill {:.3} ms, upload {:.3} ms",
                    per("peer_map_prepare_ns"),
                    per("peer_map_fill_ns"),
                    per("peer_map_upload_ns"),
                );
            }
            if bounced {
                // The side that gathers and writes: the initiator of a
                // WRITE, the target (data owner) of a READ.
                match args.op {
                    XferOp::Read => {
                        println!(
                            "    (READ: gather and write on the owner, scatter on the reader)"
                        );
                        print_breakdown(
                            args.iters,
                            &target_before,
                            &target_after,
                            &before,
                            &after,
                            true,
                        )
                    }
                    _ => print_breakdown(
                        args.iters,
                        &before,
                        &after,
                        &target_before,
                        &target_after,
                        false,
                    ),
                }
            }
        }
    }
    // `concurrent` requests of 1024 x 4 KiB in flight at once, disjoint.
    let (size, n) = (4096, 1024);
    if let Some(per) = (args.buffer / size).checked_div(args.concurrent) {
        if per >= n {
            let plans: Vec<Plan> = (0..args.concurrent)
                .map(|i| plan(n, size, per, i * per * size, 7000 + i as u64, false))
                .collect();
            for round in 0..3 {
                let before = plugin_counters(&init.name);
                let reqs: Vec<XferRequest> = plans
                    .iter()
                    .map(|p| init.request_op(args.op, p, None).unwrap_or_else(|e| die(e)))
                    .collect();
                let t0 = Instant::now();
                for r in &reqs {
                    post(&init.agent, r).unwrap_or_else(|e| die(e));
                }
                let mut done = vec![None; reqs.len()];
                while done.iter().any(Option::is_none) {
                    for (i, r) in reqs.iter().enumerate() {
                        if done[i].is_none() {
                            match init.agent.get_xfer_status(r) {
                                Ok(XferStatus::Success) => {
                                    done[i] = Some(t0.elapsed().as_secs_f64() * 1e3)
                                }
                                Ok(XferStatus::InProgress) => {}
                                Err(e) => die(format!("concurrent request {i} failed: {e}")),
                            }
                        }
                    }
                    if t0.elapsed() > TIMEOUT {
                        die("concurrent requests still running after 60 s".into());
                    }
                }
                let wall = t0.elapsed().as_secs_f64() * 1e3;
                let path = Path::of(&before, &plugin_counters(&init.name));
                let mut times: Vec<f64> = done.into_iter().flatten().collect();
                times.sort_by(f64::total_cmp);
                if round == 2 {
                    rows.push(Row {
                        label: args.label.clone(),
                        backend: args.backend.clone(),
                        descriptors: n,
                        size,
                        inflight: args.concurrent,
                        iterations: 1,
                        p50_ms: percentile(&times, 0.5),
                        p90_ms: percentile(&times, 0.9),
                        p99_ms: percentile(&times, 0.99),
                        gbps: (args.concurrent * n * size) as f64 / (wall * 1e-3) / 1e9,
                        bounce_path: path != Path::Ucx,
                        path,
                        prep_p50_ms: f64::NAN,
                    });
                    print_row(rows.last().expect("row"));
                }
            }
        }
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>(),
            "gpu": CudaRuntime::probe().ok().and_then(|c| c.device(args.device).ok()).map(|d| d.name().to_string()),
            "rows": rows,
        });
        if let Err(e) = std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap_or_default())
        {
            eprintln!("writing {path}: {e}");
        }
    }
    let stats = init.target.cmd("STATS").unwrap_or_default();
    eprintln!("target counters: {stats}");
    true
}

fn target_counters(t: &mut Target) -> BTreeMap<String, u64> {
    t.cmd("STATS")
        .ok()
        .and_then(|j| serde_json::from_str(&j).ok())
        .unwrap_or_default()
}

/// Where a bounce request's time goes, averaged per request from the
/// runtime's counters (sums over operations, so overlapping phases can add up
/// to more than the request time).
fn print_breakdown(
    iters: usize,
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    tbefore: &BTreeMap<String, u64>,
    tafter: &BTreeMap<String, u64>,
    read: bool,
) {
    let d = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>, k: &str| {
        a.get(k)
            .copied()
            .unwrap_or(0)
            .saturating_sub(b.get(k).copied().unwrap_or(0))
    };
    let per = |ns: u64| ns as f64 / iters.max(1) as f64 / 1e6;
    let chunks = d(after, before, "chunks_written") as f64 / iters.max(1) as f64;
    let i = |k: &str| per(d(after, before, k));
    let t = |k: &str| per(d(tafter, tbefore, k));
    // The request lives on the initiator: the writer of a WRITE, the
    // reader (the "target" side here) of a READ.
    let total = if read {
        t("request_ns")
    } else {
        i("request_ns")
    };
    println!(
        "    per request: total {:.3} ms | chunks {:.1} | gather {:.3} ms (launch {:.3}, device wait {:.3}) | copy queue {:.3} ms | write {:.3} ms (post {:.3}) | scatter (target) {:.3} ms (launch {:.3}, device wait {:.3}) | target queue {:.3} ms",
        total,
        chunks,
        i("gather_ns"),
        i("gpu_gather_launch_ns"),
        i("gpu_gather_wait_ns"),
        i("copy_queue_ns"),
        i("write_ns"),
        i("write_post_ns"),
        t("scatter_ns"),
        t("gpu_scatter_launch_ns"),
        t("gpu_scatter_wait_ns"),
        t("copy_queue_ns"),
    );
    if !read {
        // Both round trips are timed by the writer of a WRITE only.
        println!(
            "    control per request: submit -> first GRANT {:.3} ms | DATA -> ACK {:.3} ms (sum over chunks, includes the target's scatter)",
            i("grant_wait_ns"),
            i("ack_wait_ns"),
        );
    }
    let both = |k: &str| i(k) + t(k);
    println!(
        "    GPU launch steps, both sides: prepare {:.3} ms | table fill {:.3} ms | upload call {:.3} ms | launch + event {:.3} ms",
        both("gpu_launch_prepare_ns"),
        both("gpu_launch_fill_ns"),
        both("gpu_launch_upload_ns"),
        both("gpu_launch_call_ns"),
    );
    // Timed only with NIXL_BOUNCE_TIME_KERNELS set.
    let (gk, sk) = (i("gpu_gather_kernel_ns"), t("gpu_scatter_kernel_ns"));
    let (gu, su) = (i("gpu_gather_upload_ns"), t("gpu_scatter_upload_ns"));
    if gk > 0.0 || sk > 0.0 {
        println!(
            "    kernels' own time (CUDA events): gather {gk:.3} ms (upload to start {gu:.3}) | scatter (target) {sk:.3} ms (upload to start {su:.3})"
        );
    }
}

fn print_row(r: &Row) {
    println!(
        "{:<14} {:>6} x {:>6} B  inflight {:>4}  p50 {:>9.3} ms  p90 {:>9.3}  p99 {:>9.3}  {:>8.2} GB/s  {}  (prepare p50 {:.3} ms)",
        r.label,
        r.descriptors,
        r.size,
        r.inflight,
        r.p50_ms,
        r.p90_ms,
        r.p99_ms,
        r.gbps,
        r.path.name(),
        r.prep_p50_ms,
    );
}

// ---- mapping probe -------------------------------------------------------------
//
// What a CUDA IPC mapping of another process's VRAM allows (issue 16): no
// NIXL transfer, only this process's copies between two local buffers and
// through the mapping of the target's buffer, each timed against the same
// copy between the two local buffers.

/// One measured (case, direction) of `mapping`.
#[derive(serde::Serialize)]
struct MapRow {
    /// `memcpy` (one cuMemcpyDtoDAsync), `kernel` (the pair kernel, its
    /// table as the engine would make it), or `kernel-upload` /
    /// `kernel-inline` (the table uploaded / the launch's parameter).
    method: &'static str,
    descriptors: usize,
    size: usize,
    /// `local->local`, `local->peer` (writes the target's buffer through
    /// the mapping) or `peer->local` (reads it).
    direction: &'static str,
    iterations: usize,
    /// What p10/p50/p90 measure: `cuda-events` around the memcpy on its
    /// stream, or `wall` (host time from the launch call to the completion
    /// seen by polling).
    timer: &'static str,
    p10_us: f64,
    p50_us: f64,
    p90_us: f64,
    /// Bytes moved per second at p50.
    gbps: f64,
    /// Host wall time from the call to the completion seen (both methods).
    wall_p50_us: f64,
    /// The table's preparation (`prepare_pairs`), p50 over the runs: the
    /// table-form rows only.
    prepare_p50_us: Option<f64>,
}

const MAP_WARMUPS: usize = 3;
const MIB: usize = 1 << 20;

/// Two buffers of this process and the target's through the mapping, each
/// `len` bytes, and the host patterns every check loads as source and
/// destination. Fields drop in order: the mapping (waits for the copies
/// through it) before the copier's last reference, the events and stream
/// before the buffers.
struct Probe {
    mapping: Arc<PeerMapping>,
    copier: Arc<PeerCopier>,
    start: CudaEvent,
    end: CudaEvent,
    stream: Arc<CudaStream>,
    a: DeviceArena,
    b: DeviceArena,
    /// This process's address of the target's buffer.
    peer: u64,
    len: usize,
    dev: Arc<CudaDevice>,
    src_host: Vec<u8>,
    dst_host: Vec<u8>,
}

impl Probe {
    /// (name, source, destination) of the three directions.
    fn directions(&self) -> [(&'static str, u64, u64); 3] {
        [
            ("local->local", self.a.base(), self.b.base()),
            ("local->peer", self.a.base(), self.peer),
            ("peer->local", self.peer, self.b.base()),
        ]
    }

    /// The mappings a copy between `src` and `dst` goes through.
    fn maps(&self, src: u64, dst: u64) -> &[Arc<PeerMapping>] {
        if src == self.peer || dst == self.peer {
            std::slice::from_ref(&self.mapping)
        } else {
            &[]
        }
    }

    /// `len` bytes from the start of one of the three buffers.
    fn check_span(&self, addr: u64, len: usize) -> Result<(), String> {
        let ours = [self.a.base(), self.b.base(), self.peer].contains(&addr);
        if !ours || len > self.len {
            return Err(format!(
                "{len} bytes at {addr:#x}: not inside a probe buffer"
            ));
        }
        Ok(())
    }

    /// Loads `data` at `addr`, then waits for the context (a copy from
    /// pageable memory may return before its DMA ended).
    fn upload(&self, addr: u64, data: &[u8]) -> Result<(), String> {
        self.check_span(addr, data.len())?;
        self.dev.bind()?;
        // SAFETY: the destination lies inside a buffer of this process or
        // the open mapping of the target's (checked just above).
        unsafe { result::memcpy_htod_sync(addr, data) }
            .map_err(|e| format!("cuMemcpyHtoD of {} bytes to {addr:#x}: {e}", data.len()))?;
        self.dev
            .context()
            .synchronize()
            .map_err(|e| format!("cuCtxSynchronize after an upload: {e}"))
    }

    fn download(&self, addr: u64, out: &mut [u8]) -> Result<(), String> {
        self.check_span(addr, out.len())?;
        self.dev.bind()?;
        // SAFETY: the source lies inside a buffer of this process or the
        // open mapping of the target's (checked just above); every copy
        // into it ended (each is waited for).
        unsafe { result::memcpy_dtoh_sync(out, addr) }
            .map_err(|e| format!("cuMemcpyDtoH of {} bytes from {addr:#x}: {e}", out.len()))
    }

    /// Loads the source and destination patterns, runs `copy` once and
    /// checks the whole destination buffer byte-exact against the host
    /// reference of `moves` (source offset, destination offset, length).
    fn verify(
        &self,
        src: u64,
        dst: u64,
        moves: &[(usize, usize, usize)],
        copy: impl FnOnce() -> Result<(f64, f64), String>,
    ) -> Result<(), String> {
        self.upload(src, &self.src_host)?;
        self.upload(dst, &self.dst_host)?;
        copy()?;
        let mut want = self.dst_host.clone();
        for &(s, d, l) in moves {
            want[d..d + l].copy_from_slice(&self.src_host[s..s + l]);
        }
        let mut got = vec![0u8; self.len];
        self.download(dst, &mut got)?;
        if got == want {
            return Ok(());
        }
        let i = got.iter().zip(&want).position(|(x, y)| x != y).unwrap_or(0);
        Err(format!(
            "not byte-exact: first wrong byte at destination offset {i}: {} != {}",
            got[i], want[i]
        ))
    }

    /// One cuMemcpyDtoDAsync of `len` bytes on the probe's stream between
    /// CUDA events: (event time, host wall time to the end event) in us.
    fn memcpy(&self, src: u64, dst: u64, len: usize) -> Result<(f64, f64), String> {
        self.check_span(src, len)?;
        self.check_span(dst, len)?;
        let t0 = Instant::now();
        self.start
            .record(&self.stream)
            .map_err(|e| format!("cuEventRecord before the memcpy: {e}"))?;
        // SAFETY: both ranges lie inside the probe's buffers (checked
        // above), which outlive the copy: it is waited for before this
        // returns, on every path.
        let queued = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream.cu_stream()) }
            .result()
            .and_then(|()| self.end.record(&self.stream));
        if let Err(e) = queued {
            let waited = self.stream.synchronize();
            return Err(format!(
                "cuMemcpyDtoDAsync of {len} bytes {src:#x} -> {dst:#x}: {e} (waiting for the stream: {waited:?})"
            ));
        }
        self.end
            .synchronize()
            .map_err(|e| format!("cuEventSynchronize after the memcpy: {e}"))?;
        let wall = t0.elapsed().as_secs_f64() * 1e6;
        let ms = self
            .start
            .elapsed_ms(&self.end)
            .map_err(|e| format!("cuEventElapsedTime: {e}"))?;
        Ok((f64::from(ms) * 1e3, wall))
    }

    /// The pair table of `moves` (all `size` bytes) from `src` to `dst`.
    fn table(
        &self,
        moves: &[(usize, usize, usize)],
        size: usize,
        src: u64,
        dst: u64,
    ) -> Result<PeerTable, String> {
        for &(s, d, l) in moves {
            if l != size || s + l > self.len || d + l > self.len {
                return Err(format!("copy {s} -> {d} of {l} bytes: not a probe copy"));
            }
        }
        self.copier
            .prepare_pairs(moves.len(), size as u64, Instant::now(), |out| {
                for (pair, &(s, d, _)) in out.chunks_exact_mut(2).zip(moves) {
                    pair[0] = src + s as u64;
                    pair[1] = dst + d as u64;
                }
                Ok(true)
            })?
            .ok_or_else(|| "the copier declined the pair table".to_string())
    }

    /// Verifies one run of `once`, then runs it MAP_WARMUPS + `iters` times
    /// and summarizes the last `iters` (`once` returns (timed us, wall us):
    /// CUDA events for `memcpy`, wall time for `kernel`).
    fn case(
        &self,
        method: &'static str,
        moves: &[(usize, usize, usize)],
        size: usize,
        (direction, src, dst): (&'static str, u64, u64),
        iters: usize,
        mut once: impl FnMut() -> Result<(f64, f64), String>,
    ) -> Result<MapRow, String> {
        let n = moves.len();
        let timer = if method == "memcpy" {
            "cuda-events"
        } else {
            "wall"
        };
        let what = format!("{method} {n}x{} {direction}", human(size));
        self.verify(src, dst, moves, &mut once)
            .map_err(|e| format!("{what}: {e}"))?;
        let mut timed = Vec::new();
        let mut wall = Vec::new();
        for i in 0..MAP_WARMUPS + iters.max(1) {
            let (t, w) = once().map_err(|e| format!("{what}: {e}"))?;
            if i >= MAP_WARMUPS {
                timed.push(t);
                wall.push(w);
            }
        }
        timed.sort_by(f64::total_cmp);
        wall.sort_by(f64::total_cmp);
        let p50 = percentile(&timed, 0.5);
        let row = MapRow {
            method,
            descriptors: n,
            size,
            direction,
            iterations: timed.len(),
            timer,
            p10_us: percentile(&timed, 0.1),
            p50_us: p50,
            p90_us: percentile(&timed, 0.9),
            gbps: (n * size) as f64 / p50 / 1e3,
            wall_p50_us: percentile(&wall, 0.5),
            prepare_p50_us: None,
        };
        println!(
            "mapping: {method} {n}x{} {direction} p50 {:.1} us ({:.1} GB/s) p10 {:.1} p90 {:.1} us [{timer}; wall p50 {:.1} us]",
            human(size),
            row.p50_us,
            row.gbps,
            row.p10_us,
            row.p90_us,
            row.wall_p50_us,
        );
        Ok(row)
    }
}

/// One launch of `table` to its completion seen by polling: (wall us,
/// wall us).
fn launch_and_wait(table: &mut PeerTable, maps: &[Arc<PeerMapping>]) -> Result<(f64, f64), String> {
    let t0 = Instant::now();
    let launch = table.launch(maps)?;
    loop {
        if let Some(r) = launch.poll() {
            r?;
            let us = t0.elapsed().as_secs_f64() * 1e6;
            return Ok((us, us));
        }
        if t0.elapsed() > TIMEOUT {
            return Err("the copy kernel still runs after 60 s".into());
        }
        std::hint::spin_loop();
    }
}

fn human(bytes: usize) -> String {
    nixl_bounce::config::format_bytes(bytes as u64)
}

fn run_mapping(args: &Args) -> bool {
    if let Err(e) = mapping_probe(args) {
        die(format!("mapping: {e}"));
    }
    true
}

fn mapping_probe(args: &Args) -> Result<(), String> {
    let len = args.buffer;
    // Declared first, dropped last: the target's buffer outlives the
    // mapping of it.
    let mut target = Target::spawn(args, "")?;
    let reply = target.cmd("IPC")?;
    let w: Vec<&str> = reply.split_whitespace().collect();
    let &[alloc_base, alloc_len, handle, uuid, buf_base] = w.as_slice() else {
        return Err(format!("unexpected IPC reply from the target: {reply:?}"));
    };
    let num = |s: &str, what: &str| {
        s.parse::<u64>()
            .map_err(|_| format!("bad {what} {s:?} in the target's IPC reply"))
    };
    let (alloc_base, alloc_len) = (num(alloc_base, "base")?, num(alloc_len, "length")?);
    let buf_base = num(buf_base, "buffer base")?;
    let handle: [u8; IPC_HANDLE_LEN] = unhex(handle)
        .try_into()
        .map_err(|_| format!("bad IPC handle {handle:?} from the target"))?;
    let uuid: [u8; 16] = unhex(uuid)
        .try_into()
        .map_err(|_| format!("bad GPU UUID {uuid:?} from the target"))?;
    let dev = CudaRuntime::probe()?.device(args.device)?;
    let copier = PeerCopier::for_device(args.device, 1)?;
    let mapping = Arc::new(PeerMapping::open(
        &copier, &uuid, alloc_base, alloc_len, &handle, false,
    )?);
    let peer = buf_base
        .checked_sub(alloc_base)
        .and_then(|off| mapping.address(off, len as u64))
        .ok_or_else(|| {
            format!("the target's buffer at {buf_base:#x} ({len} bytes) is not inside its exported allocation ({alloc_len} bytes at {alloc_base:#x})")
        })?;
    let ctx = dev.context();
    let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let event = || {
        ctx.new_event(timed)
            .map_err(|e| format!("cuEventCreate: {e}"))
    };
    let probe = Probe {
        start: event()?,
        end: event()?,
        stream: ctx
            .new_stream()
            .map_err(|e| format!("cuStreamCreate: {e}"))?,
        a: DeviceArena::new(&dev, len)?,
        b: DeviceArena::new(&dev, len)?,
        peer,
        len,
        mapping,
        copier,
        src_host: pattern(len, 0x3a11),
        dst_host: pattern(len, 0x3a12),
        dev: dev.clone(),
    };
    println!(
        "mapping: {len}-byte buffers, initiator GPU {} ({}), target GPU {}; {} runs after {MAP_WARMUPS} warm-ups",
        args.device,
        dev.name(),
        args.target_device,
        args.iters.max(1)
    );
    // (a) cuMemcpyDtoDAsync and (b) the pair kernel over one contiguous
    // copy; (c) the pair kernel over scattered blocks, random distinct
    // slots of the whole buffer on both sides (as vLLM's KV blocks).
    type Moves = Vec<(usize, usize, usize)>;
    let mut cases: Vec<(&'static str, Moves, usize)> = Vec::new();
    for (n, size) in [
        (1, 64 * MIB),
        (1, 256 * MIB),
        (16384, 4096),
        (4096, 16384),
        (32768, 8192),
        (1024, 4096),
    ] {
        if n * size > len {
            eprintln!(
                "mapping: skip {n}x{}: --buffer {len} too small",
                human(size)
            );
        } else if n == 1 {
            cases.push(("memcpy", vec![(0, 0, size)], size));
            cases.push(("kernel", vec![(0, 0, size)], size));
        } else {
            let seed = 0x5ca7 + (n + size) as u64;
            cases.push((
                "kernel",
                plan(n, size, len / size, 0, seed, false).moves,
                size,
            ));
        }
    }
    let mut rows = Vec::new();
    for (method, moves, size) in &cases {
        for d in probe.directions() {
            let (_, src, dst) = d;
            let row = if *method == "memcpy" {
                probe.case(method, moves, *size, d, args.iters, || {
                    probe.memcpy(src, dst, *size)
                })
            } else {
                let mut table = probe.table(moves, *size, src, dst)?;
                let maps = probe.maps(src, dst);
                probe.case(method, moves, *size, d, args.iters, || {
                    launch_and_wait(&mut table, maps)
                })
            };
            rows.push(row?);
        }
    }
    // (d) Where a small table goes: uploaded or the launch's parameter;
    // 4 KiB blocks written into the peer.
    let (_, src, dst) = probe.directions()[1];
    for n in [64usize, 256, 512, 1024, 2040, 4096] {
        if n * 4096 > len {
            eprintln!("mapping: skip {n}x4KiB: --buffer {len} too small");
            continue;
        }
        let moves = plan(n, 4096, len / 4096, 0, 0x7ab1 + n as u64, false).moves;
        for limit in [0, usize::MAX] {
            probe.copier.set_inline_limit(limit);
            // Each preparation timed up to its table, not its drop (an
            // uploaded table's drop records an event).
            let mut prepares = Vec::new();
            for i in 0..MAP_WARMUPS + args.iters.max(1) {
                let t = Instant::now();
                let table = probe.table(&moves, 4096, src, dst)?;
                let us = t.elapsed().as_secs_f64() * 1e6;
                drop(table);
                if i >= MAP_WARMUPS {
                    prepares.push(us);
                }
            }
            prepares.sort_by(f64::total_cmp);
            let mut table = probe.table(&moves, 4096, src, dst)?;
            let method = if table.inline() {
                "kernel-inline"
            } else {
                "kernel-upload"
            };
            let maps = probe.maps(src, dst);
            let mut row = probe.case(
                method,
                &moves,
                4096,
                probe.directions()[1],
                args.iters,
                || launch_and_wait(&mut table, maps),
            )?;
            row.prepare_p50_us = Some(percentile(&prepares, 0.5));
            println!(
                "mapping: {method} {n}x4KiB prepare p50 {:.1} us",
                row.prepare_p50_us.unwrap_or(0.0)
            );
            rows.push(row);
        }
    }
    probe.copier.set_inline_limit(usize::MAX);
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>(),
            "gpu": dev.name(),
            "device": args.device,
            "target_device": args.target_device,
            "buffer_bytes": len,
            "warmups": MAP_WARMUPS,
            "rows": rows,
        });
        let text =
            serde_json::to_string_pretty(&doc).map_err(|e| format!("serializing the rows: {e}"))?;
        std::fs::write(path, text).map_err(|e| format!("writing {path}: {e}"))?;
    }
    Ok(())
}

// ---- arguments -----------------------------------------------------------------

#[derive(Clone)]
struct Args {
    command: String,
    backend: String,
    label: String,
    params: Vec<(String, String)>,
    device: usize,
    target_device: usize,
    buffer: usize,
    counts: Vec<usize>,
    sizes: Vec<usize>,
    iters: usize,
    concurrent: usize,
    json: Option<String>,
    expect_fallback: bool,
    /// Parameters for the target process only (e.g. `enable=false`).
    target_params: Vec<(String, String)>,
    /// What `bench` measures: WRITEs to the target, or READs from it.
    op: XferOp,
    /// `bench`: idle microseconds before each request (outside the timing).
    gap_us: u64,
}

impl Args {
    fn parse() -> Args {
        let mut it = std::env::args().skip(1);
        let mut a = Args {
            command: it.next().unwrap_or_else(|| "help".into()),
            backend: "BOUNCE".into(),
            label: String::new(),
            params: vec![("control_bind_loopback".into(), "true".into())],
            device: 0,
            target_device: 0,
            buffer: 1 << 30,
            counts: vec![1024, 4096, 16384],
            sizes: vec![4096],
            iters: 20,
            concurrent: 128,
            json: None,
            expect_fallback: false,
            op: XferOp::Write,
            target_params: Vec::new(),
            gap_us: 0,
        };
        let list = |s: String| {
            s.split(',')
                .filter_map(|x| x.trim().parse().ok())
                .collect::<Vec<usize>>()
        };
        while let Some(flag) = it.next() {
            let mut val = || {
                it.next()
                    .unwrap_or_else(|| die(format!("{flag} needs a value")))
            };
            match flag.as_str() {
                "--backend" => a.backend = val(),
                "--label" => a.label = val(),
                "--param" => {
                    let kv = val();
                    let (k, v) = kv
                        .split_once('=')
                        .unwrap_or_else(|| die(format!("--param {kv}: not K=V")));
                    a.params.retain(|(key, _)| key != k);
                    a.params.push((k.into(), v.into()));
                }
                "--device" => a.device = val().parse().unwrap_or(0),
                "--target-device" => a.target_device = val().parse().unwrap_or(0),
                "--buffer" => a.buffer = val().parse().unwrap_or(1 << 30),
                "--counts" => a.counts = list(val()),
                "--sizes" => a.sizes = list(val()),
                "--iters" => a.iters = val().parse().unwrap_or(20),
                "--concurrent" => a.concurrent = val().parse().unwrap_or(0),
                "--json" => a.json = Some(val()),
                "--expect-fallback" => a.expect_fallback = true,
                "--gap-us" => a.gap_us = val().parse().unwrap_or(0),
                "--op" => {
                    a.op = match val().as_str() {
                        "write" => XferOp::Write,
                        "read" => XferOp::Read,
                        other => die(format!("--op {other}: expected write or read")),
                    }
                }
                "--target-param" => {
                    let kv = val();
                    let (k, v) = kv
                        .split_once('=')
                        .unwrap_or_else(|| die(format!("--target-param {kv}: not K=V")));
                    a.target_params.push((k.into(), v.into()));
                }
                other => die(format!("unknown option {other}")),
            }
        }
        if a.backend != "BOUNCE" {
            a.params.retain(|(k, _)| k != "control_bind_loopback");
        }
        if a.command == "faults" {
            // The drills hold the bounce path's stages (so not the
            // peer-mapped path); small chunks and arenas: a drill's WRITE is
            // 32 chunks, running when the fault hits.
            for (k, v) in [
                ("max_chunk_size_bytes", "2MiB"),
                ("arena_size_bytes", "16MiB"),
                ("enable_peer_map", "false"),
            ] {
                if !a.params.iter().any(|(key, _)| key == k) {
                    a.params.push((k.into(), v.into()));
                }
            }
        }
        if a.label.is_empty() {
            a.label = a.backend.clone();
        }
        a
    }

    /// The path an eligible transfer should take with these parameters.
    fn expected_path(&self) -> Path {
        let off = |list: &[(String, String)], key: &str| {
            list.iter()
                .any(|(k, v)| k == key && matches!(v.as_str(), "false" | "0" | "off" | "no"))
        };
        if self.backend != "BOUNCE"
            || self.expect_fallback
            || off(&self.params, "enable")
            || off(&self.target_params, "enable")
        {
            Path::Ucx
        } else if off(&self.params, "enable_peer_map")
            || off(&self.target_params, "enable_peer_map")
        {
            Path::Bounce
        } else {
            Path::Peer
        }
    }

    /// The usable arena capacity these parameters give.
    fn arena_capacity(&self) -> u64 {
        let size = self
            .params
            .iter()
            .find(|(k, _)| k == "arena_size_bytes")
            .and_then(|(_, v)| nixl_bounce::config::parse_bytes(v).ok())
            .unwrap_or(256 << 20);
        1u64 << (63 - size.leading_zeros())
    }

    /// The options the target process needs.
    fn forward(&self) -> Vec<String> {
        let mut v = vec![
            "--backend".into(),
            self.backend.clone(),
            "--buffer".into(),
            self.buffer.to_string(),
            "--target-device".into(),
            self.target_device.to_string(),
        ];
        for (k, val) in &self.params {
            if self.target_params.iter().any(|(tk, _)| tk == k) {
                continue;
            }
            v.push("--param".into());
            v.push(format!("{k}={val}"));
        }
        for (k, val) in &self.target_params {
            v.push("--param".into());
            v.push(format!("{k}={val}"));
        }
        v
    }
}

fn main() {
    let args = Args::parse();
    TARGET_DEVICE.store(
        args.target_device as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    if args.command == "help" || args.command == "--help" {
        println!(
            "{}",
            include_str!("bounce-vram.rs")
                .lines()
                .take_while(|l| l.starts_with("//!"))
                .map(|l| l.trim_start_matches("//!").trim_start())
                .collect::<Vec<_>>()
                .join("\n")
        );
        return;
    }
    if let Err(e) = CudaRuntime::probe().and_then(|c| c.device(args.device).map(|_| ())) {
        println!("SKIP: no usable CUDA device ({e})");
        return;
    }
    let ok = match args.command.as_str() {
        "serve" => {
            serve(&args);
            true
        }
        "test" => run_tests(&args),
        "bench" => run_bench(&args),
        "faults" => run_faults(&args),
        "mapping" => run_mapping(&args),
        other => die(format!(
            "unknown command {other} (test, bench, faults, mapping, serve)"
        )),
    };
    std::process::exit(if ok { 0 } else { 1 });
}
