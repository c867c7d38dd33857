//! Transfer harness around `nixl-sys` (feature `harness`, on by default),
//! shared by the integration tests (`tests/support/mod.rs` re-exports it)
//! and the binaries (`bounce-demo`, `bench`). The plugin does not use it.
//!
//! What it provides:
//! - `preload_capi`: makes `libnixl_capi.so` resolvable without
//!   `LD_LIBRARY_PATH` by loading it by absolute path first;
//! - `DramBuffer`: page-aligned DRAM with guard zones on both sides;
//! - deterministic seeded patterns and scattered block plans;
//! - agent/backend construction, metadata exchange, post + bounded wait,
//!   notifications, byte-exact verification that also checks every byte
//!   outside the destination blocks;
//! - [`child`]: the line protocol to a peer process a test or benchmark
//!   starts.

pub mod child;

use nixl_sys::{
    Agent, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap, OptArgs,
    Params, RegistrationHandle, XferDescList, XferOp, XferRequest, XferStatus,
};
use std::alloc::{alloc, dealloc, Layout};
use std::fmt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub const PAGE: usize = 4096;
pub const DEFAULT_BLOCK: usize = 4096;
/// Default bound for any wait on the runtime (transfer completion, notification).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Timeout for waits, overridable with `NIXL_BOUNCE_TEST_TIMEOUT_S`.
pub fn wait_timeout() -> Duration {
    std::env::var("NIXL_BOUNCE_TEST_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_TIMEOUT)
}

// ---------------------------------------------------------------------------
// Locating the runtime
// ---------------------------------------------------------------------------

/// Directory that holds `libnixl_capi.so`: `NIXL_BOUNCE_LIB_DIR`, else the
/// parent of `NIXL_PLUGIN_DIR` (the wheel layout: `<libs>/plugins`), else
/// `<repo>/.nixl/site/.nixl_cu13.mesonpy.libs` relative to `repo_root`.
pub fn capi_dir(repo_root: Option<&Path>) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Ok(d) = std::env::var("NIXL_BOUNCE_LIB_DIR") {
        candidates.push(PathBuf::from(d));
    }
    if let Ok(d) = std::env::var("NIXL_PLUGIN_DIR") {
        if let Some(p) = Path::new(&d).parent() {
            candidates.push(p.to_path_buf());
        }
    }
    if let Some(root) = repo_root {
        candidates.push(root.join(".nixl/site/.nixl_cu13.mesonpy.libs"));
    }
    candidates
        .into_iter()
        .find(|d| d.join("libnixl_capi.so").is_file())
}

static SUITE_DEFAULTS: AtomicBool = AtomicBool::new(false);

/// Makes the agents this process creates from now on take the test suites'
/// defaults (the CMA path off for BOUNCE, [`backend_params`]); the
/// integration tests' support module calls it before loading NIXL.
pub fn use_suite_defaults() {
    SUITE_DEFAULTS.store(true, Ordering::Relaxed);
}

/// Load `libnixl_capi.so` by absolute path (RTLD_GLOBAL) so that nixl-sys'
/// later `dlopen("libnixl_capi.so")` finds the already-loaded object by its
/// soname. Returns the path loaded, or an error string. Harmless if
/// `LD_LIBRARY_PATH` already resolves it.
pub fn preload_capi(repo_root: Option<&Path>) -> Result<PathBuf, String> {
    let dir = capi_dir(repo_root).ok_or_else(|| {
        "libnixl_capi.so not found (set NIXL_PLUGIN_DIR / NIXL_BOUNCE_LIB_DIR, or run scripts/setup.sh)"
            .to_string()
    })?;
    let path = dir.join("libnixl_capi.so");
    crate::nixl_capi::load_global(&path)
        .map_err(|e| format!("dlopen({}) failed: {e}", path.display()))?;
    if nixl_sys::is_stub() {
        return Err(format!(
            "{} was loaded but nixl-sys still cannot resolve libnixl_capi.so",
            path.display()
        ));
    }
    Ok(path)
}

// ---------------------------------------------------------------------------
// Deterministic randomness and patterns
// ---------------------------------------------------------------------------

use crate::splitmix::mix;
/// The crate's one PRNG (layouts and orders of the tests' plans).
pub use crate::splitmix::SplitMix64 as Rng;

const PATTERN_TABLE: usize = 64 * 1024;

/// Fill `buf` with the pattern of `seed`. The byte at offset `i` depends on
/// `(seed, i)` only, so any process can recompute the pattern of a peer.
///
/// Built to be fast even in unoptimised test builds: a 64 KiB pseudo-random
/// table per seed; each 4 KiB page of `buf` is a copy of the table taken at a
/// pseudo-random offset, then stamped in its first 16 bytes with a hash of
/// (seed, page index) and the page index. So every page is distinct, every
/// seed gives different bytes, and a block moved to the wrong place shows.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let key = mix(seed.wrapping_mul(0xd134_2543_de82_ef95) ^ 0x5851_f42d_4c95_7f2d);
    let mut table = vec![0u8; PATTERN_TABLE + PAGE];
    for (w, c) in table.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&mix(key ^ (w as u64).wrapping_mul(0xa076_1d64_78bd_642f)).to_le_bytes());
    }
    for (page, chunk) in buf.chunks_mut(PAGE).enumerate() {
        let h = mix(key ^ (page as u64).wrapping_add(0xe703_7ed1_a0b4_28db));
        let off = (h as usize % (PATTERN_TABLE / 8)) * 8;
        let n = chunk.len();
        chunk.copy_from_slice(&table[off..off + n]);
        let mut stamp = [0u8; 16];
        stamp[..8].copy_from_slice(&h.to_le_bytes());
        stamp[8..].copy_from_slice(&(page as u64 ^ key.rotate_left(17)).to_le_bytes());
        let k = n.min(16);
        chunk[..k].copy_from_slice(&stamp[..k]);
    }
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(&mut v, seed);
    v
}

// ---------------------------------------------------------------------------
// DRAM buffers
// ---------------------------------------------------------------------------

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Unique-ish name for an agent: `<prefix>-<pid>-<n>`.
pub fn unique_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    )
}

const GUARD_BYTE: u8 = 0xA5;

/// Page-aligned DRAM region of `len` bytes, with one guard page of
/// `GUARD_BYTE` on each side (not registered) to catch out-of-bounds writes.
pub struct DramBuffer {
    base: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer is plain heap memory owned by this value.
unsafe impl Send for DramBuffer {}
unsafe impl Sync for DramBuffer {}

impl DramBuffer {
    pub fn new(len: usize) -> Self {
        assert!(len > 0);
        let total = len.div_ceil(PAGE) * PAGE + 2 * PAGE;
        let layout = Layout::from_size_align(total, PAGE).expect("layout");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc(layout) };
        let base = NonNull::new(raw).expect("out of memory");
        // SAFETY: fresh allocation of `total` bytes.
        unsafe { std::ptr::write_bytes(raw, GUARD_BYTE, total) };
        DramBuffer { base, len, layout }
    }

    pub fn with_pattern(len: usize, seed: u64) -> Self {
        let mut b = Self::new(len);
        fill_pattern(b.as_mut_slice(), seed);
        b
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn addr(&self) -> usize {
        self.data_ptr() as usize
    }
    fn data_ptr(&self) -> *mut u8 {
        // SAFETY: PAGE < total allocation size.
        unsafe { self.base.as_ptr().add(PAGE) }
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: [PAGE, PAGE+len) lies inside the allocation. Remote writers
        // only touch it while no Rust reference is being read (callers wait
        // for completion first).
        unsafe { std::slice::from_raw_parts(self.data_ptr(), self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, with unique access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.data_ptr(), self.len) }
    }
    pub fn fill_pattern(&mut self, seed: u64) {
        fill_pattern(self.as_mut_slice(), seed)
    }

    /// Check that the guard bytes on both sides are untouched.
    pub fn check_guards(&self) -> Result<(), String> {
        let total = self.layout.size();
        // SAFETY: the whole allocation is readable.
        let all = unsafe { std::slice::from_raw_parts(self.base.as_ptr(), total) };
        let front = &all[..PAGE];
        let back = &all[PAGE + self.len..];
        if let Some(i) = front.iter().position(|&b| b != GUARD_BYTE) {
            return Err(format!(
                "guard zone BEFORE the buffer was modified at {} bytes before it",
                PAGE - i
            ));
        }
        if let Some(i) = back.iter().position(|&b| b != GUARD_BYTE) {
            return Err(format!(
                "guard zone AFTER the buffer was modified at {} bytes after its end",
                i
            ));
        }
        Ok(())
    }
}

impl Drop for DramBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { dealloc(self.base.as_ptr(), self.layout) }
    }
}

impl fmt::Debug for DramBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DramBuffer({:#x}, {} bytes)", self.addr(), self.len)
    }
}

impl MemoryRegion for DramBuffer {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.data_ptr()
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for DramBuffer {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

// ---------------------------------------------------------------------------
// Scattered plans
// ---------------------------------------------------------------------------

/// Which blocks move: descriptor `k` moves `block` bytes from offset
/// `src[k]` of the source buffer to offset `dst[k]` of the destination.
#[derive(Clone, Debug)]
pub struct Plan {
    pub block: usize,
    pub src: Vec<usize>,
    pub dst: Vec<usize>,
}

/// Number of blocks a buffer needs so that `n` descriptors leave some
/// blocks untouched (25% spare, at least 2).
pub fn blocks_for(n: usize) -> usize {
    n + (n / 4).max(2)
}

impl Plan {
    /// `n` descriptors of `block` bytes: a random subset of the source's
    /// `src_blocks` blocks in random order, to a random subset of the
    /// destination's `dst_blocks` blocks in another random order.
    pub fn scattered(
        n: usize,
        block: usize,
        src_blocks: usize,
        dst_blocks: usize,
        seed: u64,
    ) -> Self {
        assert!(n <= src_blocks && n <= dst_blocks);
        let mut rng = Rng::new(seed);
        let mut s: Vec<usize> = (0..src_blocks).collect();
        let mut d: Vec<usize> = (0..dst_blocks).collect();
        rng.shuffle(&mut s);
        rng.shuffle(&mut d);
        Plan {
            block,
            src: s[..n].iter().map(|b| b * block).collect(),
            dst: d[..n].iter().map(|b| b * block).collect(),
        }
    }

    /// The same plan for a buffer pair both of `blocks_for(n)` blocks.
    pub fn standard(n: usize, block: usize, seed: u64) -> Self {
        let b = blocks_for(n);
        Self::scattered(n, block, b, b, seed)
    }

    pub fn len(&self) -> usize {
        self.src.len()
    }
    pub fn is_empty(&self) -> bool {
        self.src.is_empty()
    }
    pub fn bytes(&self) -> usize {
        self.src.len() * self.block
    }

    /// What the destination must hold afterwards.
    pub fn expected(&self, dst_before: &[u8], src: &[u8]) -> Vec<u8> {
        let mut out = dst_before.to_vec();
        for (s, d) in self.src.iter().zip(&self.dst) {
            out[*d..*d + self.block].copy_from_slice(&src[*s..*s + self.block]);
        }
        out
    }

    /// Byte-exact check of the whole destination: the destination blocks
    /// hold the source blocks, every other byte is unchanged.
    pub fn verify(&self, dst_after: &[u8], dst_before: &[u8], src: &[u8]) -> Result<(), String> {
        let expected = self.expected(dst_before, src);
        verify_bytes(dst_after, &expected, |off| {
            self.dst
                .iter()
                .position(|d| off >= *d && off < *d + self.block)
                .map(|k| format!("inside destination block of descriptor {k}"))
                .unwrap_or_else(|| "OUTSIDE every destination block".to_string())
        })
    }
}

/// Compare two buffers; on mismatch describe the first differing offset.
pub fn verify_bytes(
    actual: &[u8],
    expected: &[u8],
    describe: impl Fn(usize) -> String,
) -> Result<(), String> {
    if actual.len() != expected.len() {
        return Err(format!(
            "length {} != expected {}",
            actual.len(),
            expected.len()
        ));
    }
    if actual == expected {
        return Ok(());
    }
    let first = actual
        .iter()
        .zip(expected)
        .position(|(a, e)| a != e)
        .unwrap();
    let count = actual.iter().zip(expected).filter(|(a, e)| a != e).count();
    Err(format!(
        "{count} byte(s) differ; first at offset {first} ({}): got {:#04x}, expected {:#04x}",
        describe(first),
        actual[first],
        expected[first]
    ))
}

pub fn xfer_list(
    base: usize,
    offsets: &[usize],
    len: usize,
) -> Result<XferDescList<'static>, NixlError> {
    let mut l = XferDescList::new(MemType::Dram)?;
    for o in offsets {
        l.add_desc(base + o, len, 0);
    }
    Ok(l)
}

// ---------------------------------------------------------------------------
// Agents
// ---------------------------------------------------------------------------

fn err(ctx: &str, e: NixlError) -> String {
    format!("{ctx}: {e} ({e:?})")
}

/// The plugin's default parameters with `extra` set on top.
pub fn backend_params(
    agent: &Agent,
    backend: &str,
    extra: &[(&str, &str)],
) -> Result<Params, String> {
    let (_mems, defaults) = agent
        .get_plugin_params(backend)
        .map_err(|e| err(&format!("get_plugin_params({backend})"), e))?;
    let mut p = defaults.clone().map_err(|e| err("Params::clone", e))?;
    // The test suites' two agents (or two processes) share one host, where
    // the CMA path would carry every DRAM transfer the bounce arena's tests
    // are about: there it is off unless a test asks for it (tests/bounce_cma.rs)
    // or the environment sets it. The binaries (demo, bench) keep the
    // product's default.
    if SUITE_DEFAULTS.load(Ordering::Relaxed)
        && backend == "BOUNCE"
        && !extra.iter().any(|(k, _)| *k == "enable_cma")
        && std::env::var_os("NIXL_BOUNCE_ENABLE_CMA").is_none()
    {
        p.set("enable_cma", "false")
            .map_err(|e| err("Params::set", e))?;
    }
    for (k, v) in extra {
        p.set(k, v).map_err(|e| err("Params::set", e))?;
    }
    Ok(p)
}

/// An agent with exactly one backend.
pub struct Node {
    pub name: String,
    pub backend_name: String,
    pub backend: Backend,
    pub agent: Agent,
}

impl Node {
    pub fn new(name: &str, backend: &str, extra: &[(&str, &str)]) -> Result<Self, String> {
        let agent = Agent::new(name).map_err(|e| err(&format!("Agent::new({name})"), e))?;
        let params = backend_params(&agent, backend, extra)?;
        let be = agent
            .create_backend(backend, &params)
            .map_err(|e| err(&format!("create_backend({backend})"), e))?;
        Ok(Node {
            name: name.to_string(),
            backend_name: backend.to_string(),
            backend: be,
            agent,
        })
    }

    pub fn register(&self, buf: &DramBuffer) -> Result<RegistrationHandle, String> {
        let mut opt = OptArgs::new().map_err(|e| err("OptArgs::new", e))?;
        opt.add_backend(&self.backend)
            .map_err(|e| err("OptArgs::add_backend", e))?;
        self.agent
            .register_memory(buf, Some(&opt))
            .map_err(|e| err(&format!("register_memory({buf:?})"), e))
    }

    pub fn local_md(&self) -> Result<Vec<u8>, String> {
        self.agent
            .get_local_md()
            .map_err(|e| err("get_local_md", e))
    }

    pub fn load_md(&self, md: &[u8]) -> Result<String, String> {
        self.agent
            .load_remote_md(md)
            .map_err(|e| err("load_remote_md", e))
    }

    pub fn opt_args(&self, notif: Option<&[u8]>) -> Result<OptArgs, String> {
        let mut opt = OptArgs::new().map_err(|e| err("OptArgs::new", e))?;
        opt.add_backend(&self.backend)
            .map_err(|e| err("OptArgs::add_backend", e))?;
        if let Some(m) = notif {
            opt.set_has_notification(true)
                .map_err(|e| err("set_has_notification", e))?;
            opt.set_notification_message(m)
                .map_err(|e| err("set_notification_message", e))?;
        }
        Ok(opt)
    }

    /// Create a transfer request moving the plan's blocks between a local
    /// buffer at `local_base` and the remote agent's buffer at `remote_base`.
    /// For WRITE the local buffer is the plan's source; for READ it is the
    /// plan's destination.
    pub fn create_xfer(
        &self,
        op: XferOp,
        plan: &Plan,
        local_base: usize,
        remote_base: usize,
        remote: &str,
        notif: Option<&[u8]>,
    ) -> Result<XferRequest, String> {
        let (lo, ro) = match op {
            XferOp::Write => (&plan.src, &plan.dst),
            XferOp::Read => (&plan.dst, &plan.src),
        };
        let local = xfer_list(local_base, lo, plan.block).map_err(|e| err("XferDescList", e))?;
        let remote_l =
            xfer_list(remote_base, ro, plan.block).map_err(|e| err("XferDescList", e))?;
        let opt = self.opt_args(notif)?;
        self.agent
            .create_xfer_req(op, &local, &remote_l, remote, Some(&opt))
            .map_err(|e| {
                err(
                    &format!("create_xfer_req({op:?}, {} descs, to {remote})", plan.len()),
                    e,
                )
            })
    }

    /// Post `req` and poll it to completion within `timeout`. Returns the
    /// elapsed time from post to completion.
    pub fn post_and_wait(&self, req: &XferRequest, timeout: Duration) -> Result<Duration, String> {
        let t0 = Instant::now();
        let in_progress = self
            .agent
            .post_xfer_req(req, None)
            .map_err(|e| err("post_xfer_req", e))?;
        if in_progress {
            self.wait_xfer(req, t0, timeout)?;
        }
        Ok(t0.elapsed())
    }

    pub fn wait_xfer(
        &self,
        req: &XferRequest,
        t0: Instant,
        timeout: Duration,
    ) -> Result<(), String> {
        let mut spins = 0u64;
        loop {
            match self.agent.get_xfer_status(req) {
                Ok(XferStatus::Success) => return Ok(()),
                Ok(XferStatus::InProgress) => {}
                Err(e) => return Err(err("get_xfer_status", e)),
            }
            if t0.elapsed() > timeout {
                return Err(format!(
                    "transfer still in progress after {:?} ({spins} polls): giving up",
                    timeout
                ));
            }
            spins += 1;
            if spins.is_multiple_of(1024) {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Drains the notifications received so far, as (agent, message).
    pub fn take_notifs(&self) -> Result<Vec<(String, Vec<u8>)>, String> {
        let mut map = NotificationMap::new().map_err(|e| err("NotificationMap::new", e))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(|e| err("get_notifications", e))?;
        let agents: Vec<String> = map
            .agents()
            .filter_map(|a| a.ok().map(|s| s.to_string()))
            .collect();
        let mut out = Vec::new();
        for a in agents {
            let n = map
                .get_notifications_size(&a)
                .map_err(|e| err("notifs size", e))?;
            for i in 0..n {
                let b = map
                    .get_notification_bytes(&a, i)
                    .map_err(|e| err("notif bytes", e))?;
                out.push((a.clone(), b));
            }
        }
        Ok(out)
    }

    /// Wait until a notification equal to `msg` from agent `from` arrives.
    /// Other notifications seen meanwhile are returned in the error message.
    pub fn wait_notif(&self, from: &str, msg: &[u8], timeout: Duration) -> Result<(), String> {
        let t0 = Instant::now();
        let mut seen: Vec<(String, Vec<u8>)> = Vec::new();
        loop {
            for (a, b) in self.take_notifs()? {
                if a == from && b == msg {
                    return Ok(());
                }
                seen.push((a, b));
            }
            if t0.elapsed() > timeout {
                let seen: Vec<String> = seen
                    .iter()
                    .map(|(a, b)| format!("{a}: {:?}", String::from_utf8_lossy(b)))
                    .collect();
                return Err(format!(
                    "no notification {:?} from {from} within {timeout:?}; other notifications seen: {seen:?}",
                    String::from_utf8_lossy(msg)
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// A node plus one registered buffer.
pub struct Endpoint {
    // Field order matters: the registration is dropped (deregistered) before
    // the buffer is freed, and before the agent.
    pub reg: Option<RegistrationHandle>,
    pub buf: DramBuffer,
    pub node: Node,
}

impl Endpoint {
    pub fn new(
        prefix: &str,
        backend: &str,
        extra: &[(&str, &str)],
        len: usize,
        seed: u64,
    ) -> Result<Self, String> {
        let node = Node::new(&unique_name(prefix), backend, extra)?;
        let buf = DramBuffer::with_pattern(len, seed);
        let reg = node.register(&buf)?;
        Ok(Endpoint {
            reg: Some(reg),
            buf,
            node,
        })
    }
    pub fn name(&self) -> &str {
        &self.node.name
    }
}

/// Two endpoints in this process that know each other's metadata.
pub struct LocalPair {
    pub init: Endpoint,
    pub target: Endpoint,
}

impl LocalPair {
    pub fn new(backend: &str, extra: &[(&str, &str)], len: usize) -> Result<Self, String> {
        let init = Endpoint::new("init", backend, extra, len, 1)?;
        let target = Endpoint::new("target", backend, extra, len, 2)?;
        let tn = init.node.load_md(&target.node.local_md()?)?;
        if tn != target.name() {
            return Err(format!(
                "load_remote_md returned {tn:?}, expected {:?}",
                target.name()
            ));
        }
        let inn = target.node.load_md(&init.node.local_md()?)?;
        if inn != init.name() {
            return Err(format!(
                "load_remote_md returned {inn:?}, expected {:?}",
                init.name()
            ));
        }
        Ok(LocalPair { init, target })
    }

    /// Fill both buffers with fresh seeded patterns, run `op` for `plan`
    /// (initiator = `init`), wait, then verify the destination byte-exact
    /// (and the guard zones). With `notif`, also wait for it at the target.
    pub fn run(
        &mut self,
        op: XferOp,
        plan: &Plan,
        seeds: (u64, u64),
        notif: Option<&[u8]>,
    ) -> Result<Duration, String> {
        self.init.buf.fill_pattern(seeds.0);
        self.target.buf.fill_pattern(seeds.1);
        let init_before = self.init.buf.as_slice().to_vec();
        let target_before = self.target.buf.as_slice().to_vec();
        let req = self.init.node.create_xfer(
            op,
            plan,
            self.init.buf.addr(),
            self.target.buf.addr(),
            &self.target.node.name.clone(),
            notif,
        )?;
        let dt = self.init.node.post_and_wait(&req, wait_timeout())?;
        if let Some(m) = notif {
            self.target
                .node
                .wait_notif(&self.init.node.name, m, wait_timeout())?;
        }
        drop(req);
        let (what, src_before, dst_before, dst_after, src_after) = match op {
            XferOp::Write => (
                "WRITE",
                &init_before,
                &target_before,
                self.target.buf.as_slice(),
                self.init.buf.as_slice(),
            ),
            XferOp::Read => (
                "READ",
                &target_before,
                &init_before,
                self.init.buf.as_slice(),
                self.target.buf.as_slice(),
            ),
        };
        plan.verify(dst_after, dst_before, src_before)
            .map_err(|e| {
                format!(
                    "{what} of {} x {} B: destination wrong: {e}",
                    plan.len(),
                    plan.block
                )
            })?;
        verify_bytes(src_after, src_before, |_| "source buffer".into())
            .map_err(|e| format!("{what}: source buffer changed: {e}"))?;
        self.init.buf.check_guards()?;
        self.target.buf.check_guards()?;
        Ok(dt)
    }
}

pub fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

pub fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err("odd hex length".into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}
