//! Configuration: environment variables and backend parameters -> [`Config`].
//!
//! Every setting has an environment variable `NIXL_BOUNCE_<SUFFIX>` and a
//! backend parameter `<suffix>` (the same name in lower snake case, e.g.
//! `NIXL_BOUNCE_ARENA_SIZE_BYTES` and `arena_size_bytes`). Precedence, per
//! setting: backend parameter, then environment variable, then the default.
//! A value that cannot be parsed (or is zero where zero means nothing) is
//! skipped with a [`ConfigWarning`] and the next source is used, so a bad
//! value never silently becomes 0.
//!
//! Parsing never reads the process environment by itself: the caller passes
//! a lookup function ([`Config::resolve`]); [`Config::from_process_env`] is
//! the thin wrapper for production.
//!
//! Value syntax:
//! - byte sizes: a decimal integer with an optional binary suffix
//!   `K`/`KB`/`KiB`, `M`/`MB`/`MiB`, `G`/`GB`/`GiB` (any case, optional space;
//!   all powers of two, so `1MB` is 1048576);
//! - counts and milliseconds: decimal integers;
//! - booleans: `1`/`0`, `true`/`false`, `on`/`off`, `yes`/`no` (any case).
//!
//! # Usable arena capacity
//!
//! The arena is managed by a buddy allocator with one root block, so the
//! *usable capacity* is the largest power of two not above
//! `arena_size_bytes` (e.g. 384 MiB -> 256 MiB; the rest is left unused and
//! a warning says so). The allocation granularity must be a power of two and
//! no larger than the usable capacity. `max_chunk_size_bytes` is clamped to
//! the usable capacity (the largest block the allocator can ever hand out),
//! so a fully drained arena can always fit any chunk. A chunk cap above half
//! the usable capacity is accepted with a warning: the scheduler's local
//! reserve block (see `proto::credit`) then does not fit, and an agent that
//! both sends and receives can stall until the request timeout.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;

use thiserror::Error;

/// Prefix of every environment variable.
pub const ENV_PREFIX: &str = "NIXL_BOUNCE_";

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;

/// The validated bounce configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Master switch.
    pub enabled: bool,
    /// Shared region arena size (bytes).
    pub arena_size_bytes: u64,
    /// Buddy minimum block (allocation granularity, bytes, power of two).
    pub arena_allocation_granularity_bytes: u64,
    /// Per-chunk byte cap; clamped to the arena's usable capacity; must match
    /// the peer's (handshake-checked).
    pub max_chunk_size_bytes: u64,
    /// Per-flow in-flight cap W (pipeline depth).
    pub max_inflight_chunks_per_request: u32,
    pub min_chunks_per_request: u32,
    pub min_chunk_size_bytes: u64,
    /// Bounce arena, receiving: senders offered a standing credit.
    pub standing_credit_peers: u32,
    /// Copy execution contexts (GPU kernel concurrency cap).
    pub copy_stream_count: u32,
    /// Scatter worker thread count.
    pub scatter_worker_count: u32,
    /// Routing gate of the bounce arena for DRAM on both sides: minimum
    /// descriptor count.
    pub min_descriptor_count: u64,
    /// Routing gate of the bounce arena for DRAM: maximum average descriptor
    /// size (bytes).
    pub max_average_descriptor_size_bytes: u64,
    /// Routing gate of the bounce arena for DRAM on both sides when the
    /// peer is on another host and UCX can reach it only over TCP (this
    /// host has no RDMA device it may use): minimum descriptor count.
    pub tcp_min_descriptor_count: u64,
    /// The same gate's maximum average descriptor size (bytes).
    pub tcp_max_average_descriptor_size_bytes: u64,
    /// Routing gate of the bounce arena when both sides are VRAM: minimum
    /// descriptor count.
    pub vram_min_descriptor_count: u64,
    /// Bounce arena, VRAM on one side and DRAM on the other: minimum
    /// descriptor count.
    pub mixed_min_descriptor_count: u64,
    /// Each GPU with registered memory gets a second bounce instance whose
    /// arena is host memory pinned for it: the one its transfers with DRAM
    /// take, so their chunk writes are host to host.
    pub mixed_host_staging: bool,
    /// The mixed gate when a VRAM arena is on one side (no host-staged
    /// arena there): minimum descriptor count.
    pub mixed_unstaged_min_descriptor_count: u64,
    /// Routing gate of the bounce arena when either side is VRAM: maximum
    /// average descriptor size (bytes).
    pub vram_max_average_descriptor_size_bytes: u64,
    /// Routing gate of the peer-mapped path: minimum descriptor count.
    pub peer_map_min_descriptor_count: u64,
    /// Routing gate of the peer-mapped path: maximum average descriptor size
    /// (bytes); 0 = no limit.
    pub peer_map_max_average_descriptor_size_bytes: u64,
    pub peer_map_inline_table_max_descriptors: u64,
    /// Per-request no-progress timeout (ms).
    pub request_timeout_ms: u64,
    /// Use plain device allocation instead of fabric memory for the arena.
    pub disable_fabric_memory: bool,
    /// Launch gathers before the GRANT arrives (eager staging capped at half
    /// the arena).
    pub enable_eager_gather: bool,
    /// The IO thread launches copies after every other pending action, and
    /// reads what has arrived between two launches.
    pub copy_launches_last: bool,
    /// Control plane over NIXL notifications instead of ZMQ/TCP; must match
    /// the peer (handshake-checked).
    pub use_nixl_notifications: bool,
    /// Control plane (when not over NIXL notifications) over TCP sockets
    /// the IO thread owns, instead of ZMQ's (whose I/O thread every message
    /// crosses on each side); must match the peer (handshake-checked).
    pub direct_tcp_control: bool,
    /// Copy kernel reads its plan directly from pinned host memory
    /// (default false: the plan is uploaded with one async copy before the
    /// launch, which is faster; see `ExecPool::new`).
    pub use_zero_copy_arguments: bool,
    /// Use a library batched memcpy instead of the custom copy kernel
    /// (experimental).
    pub use_cub_copy: bool,
    /// Arena copies all of one length use the pair kernel's 16-byte table
    /// (the launch's parameter up to 2040); off by default.
    pub copy_pair_tables: bool,
    /// A single list of packed copies (a chunk's gather, a DATA's
    /// scatter) of up to 1024 copies passes its addresses as the launch's
    /// parameter (no table filled or uploaded); on by default.
    pub copy_inline_packed: bool,
    /// DEBUG ONLY: one run per descriptor instead of coalesced runs.
    pub disable_scatter_run_merging: bool,
    /// Absolute per-request deadline from submission (ms); 0 = none.
    pub request_deadline_ms: u64,
    /// A peer whose ZMQ control connection is down this long (ms) is
    /// unreachable: its requests fail and its flows are aborted; 0 = off.
    pub peer_liveness_timeout_ms: u64,
    /// Network interface for the ZMQ control socket; empty = auto-detect.
    pub control_interface: String,
    /// Bind the ZMQ control socket to 127.0.0.1 (single-host tests only).
    pub control_bind_loopback: bool,
    /// How long the IO thread, copy workers and writer keep polling after
    /// their last event while transfers are live (us); 0 = always block.
    pub busy_poll_us: u64,
    /// How long the IO thread alone keeps polling after its last event
    /// while transfers are live (us); 0 = as `busy_poll_us`.
    pub reactor_busy_poll_us: u64,
    /// Which thread posts and polls the bounce arena's chunk writes:
    /// `auto`, `io_thread`, `io_thread_when_idle` or `writer_thread` (see
    /// [`IoThreadUse`]).
    pub chunk_writes: String,
    /// Writer threads of an instance (see `chunk_writes`).
    pub chunk_writer_threads: u64,
    /// Which threads launch the bounce arena's CUDA gathers and scatters:
    /// `io_thread` (the default), `io_thread_when_idle` or `copy_workers`.
    pub copy_launches: String,
    /// The gathers (and the scatters) the IO thread launches in one pass go
    /// as one launch: one table upload, launch and event for a burst.
    pub group_copy_launches: bool,
    /// How long the IO thread reads control messages in one pass before it
    /// launches what they started and polls its copies and writes (us);
    /// 0 = until none is ready.
    pub receive_pass_us: u64,
    /// VRAM peers on the same host: one kernel moves a transfer straight
    /// between this process's memory and the peer's, mapped with CUDA IPC
    /// (the peer-mapped path); off: such transfers take the bounce path.
    pub enable_peer_map: bool,
    /// Peer-mapped path: threads that fill a large request's copy table
    /// together (the calling thread among them); 0 = auto.
    pub peer_map_prepare_threads: usize,
    /// A request is routed and prepared (descriptors checked, plan or copy
    /// table built) at its first post, as UCX does its per-descriptor work
    /// at post; off: in prepXfer.
    pub prepare_at_post: bool,
    /// A WRITE over the arena prepared at its first post sends its WANT
    /// before its descriptors are checked and packed.
    pub announce_writes: bool,
    /// DRAM peers on the same host: one copy by cross-memory attach straight
    /// between this process's memory and the peer's (the CMA path); off:
    /// such transfers take the bounce arena or UCX.
    pub enable_cma: bool,
    /// CMA path: minimum descriptor count.
    pub cma_min_descriptor_count: u64,
    /// CMA path between two processes: maximum average descriptor size
    /// (bytes); 0 = no limit. Within one process there is none.
    pub cma_max_average_descriptor_size_bytes: u64,
    /// CMA path: threads that copy one large transfer; 0 = auto.
    pub cma_threads: u64,
    /// The UCX delegate's progress-thread delay (us); 0: the application's.
    /// Above 0 the thread sleeps in poll() until UCX has events (at most
    /// 1 ms), instead of spinning a core as NIXL's default (0) does.
    pub ucx_progress_delay_us: u64,
    /// NIXL-notification control: how often (us) the channel polls for a
    /// reply while an exchange is under way; 0 = always back off.
    pub notif_poll_us: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            enabled: true,
            arena_size_bytes: 256 * MIB,
            arena_allocation_granularity_bytes: MIB,
            max_chunk_size_bytes: 32 * MIB,
            max_inflight_chunks_per_request: 8,
            min_chunks_per_request: 8,
            min_chunk_size_bytes: 4 * MIB,
            standing_credit_peers: 4,
            copy_stream_count: 8,
            scatter_worker_count: 4,
            min_descriptor_count: 1024,
            max_average_descriptor_size_bytes: 8 * KIB,
            tcp_min_descriptor_count: 256,
            tcp_max_average_descriptor_size_bytes: MIB,
            vram_min_descriptor_count: 256,
            mixed_min_descriptor_count: 64,
            mixed_host_staging: true,
            mixed_unstaged_min_descriptor_count: 512,
            vram_max_average_descriptor_size_bytes: 256 * KIB,
            peer_map_min_descriptor_count: 1,
            peer_map_max_average_descriptor_size_bytes: 0,
            peer_map_inline_table_max_descriptors: 2040,
            peer_map_prepare_threads: 0,
            enable_cma: true,
            cma_min_descriptor_count: 64,
            cma_max_average_descriptor_size_bytes: 0,
            cma_threads: 0,
            request_timeout_ms: 30_000,
            disable_fabric_memory: false,
            enable_eager_gather: true,
            copy_launches_last: false,
            use_nixl_notifications: false,
            direct_tcp_control: true,
            use_zero_copy_arguments: false,
            use_cub_copy: false,
            copy_pair_tables: false,
            copy_inline_packed: true,
            disable_scatter_run_merging: false,
            request_deadline_ms: 0,
            peer_liveness_timeout_ms: 1000,
            control_interface: String::new(),
            control_bind_loopback: false,
            busy_poll_us: 0,
            reactor_busy_poll_us: 0,
            chunk_writes: "auto".into(),
            chunk_writer_threads: 1,
            copy_launches: "io_thread".into(),
            group_copy_launches: true,
            receive_pass_us: 25,
            enable_peer_map: true,
            prepare_at_post: true,
            announce_writes: true,
            ucx_progress_delay_us: 1000,
            notif_poll_us: 10,
        }
    }
}

/// Where a value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigSource {
    /// A backend parameter (its key).
    Param(String),
    /// An environment variable (its full name).
    Env(String),
    /// A derived adjustment (the setting's key).
    Derived(String),
}

impl fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigSource::Param(k) => write!(f, "backend parameter `{k}`"),
            ConfigSource::Env(v) => write!(f, "environment variable {v}"),
            ConfigSource::Derived(k) => write!(f, "setting `{k}`"),
        }
    }
}

/// A value that was ignored or adjusted. Also logged with `tracing::warn!`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigWarning {
    /// The variable or parameter concerned.
    pub source: ConfigSource,
    /// The raw value given.
    pub value: String,
    /// What was wrong and what is used instead.
    pub message: String,
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {:?}: {}", self.source, self.value, self.message)
    }
}

/// Settings that contradict each other; the message says what to change.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// The granularity is not a power of two.
    #[error("arena_allocation_granularity_bytes ({NIXL}ARENA_ALLOCATION_GRANULARITY_BYTES) = {0} is not a power of two; set it to a power of two such as 1MiB", NIXL = ENV_PREFIX)]
    GranularityNotPowerOfTwo(u64),
    /// The granularity is below the 32-byte region alignment.
    #[error("arena_allocation_granularity_bytes = {0} is below the 32-byte region alignment; set it to at least 32 (1MiB is the default)")]
    GranularityTooSmall(u64),
    /// The granularity exceeds the arena.
    #[error("arena_allocation_granularity_bytes = {granularity} is larger than arena_size_bytes = {arena}; lower the granularity or raise {NIXL}ARENA_SIZE_BYTES", NIXL = ENV_PREFIX)]
    GranularityAboveArena {
        /// The granularity.
        granularity: u64,
        /// The arena size.
        arena: u64,
    },
    /// A setting that must be positive is zero.
    #[error("{key} must be at least 1; set {NIXL}{env} to a positive value", NIXL = ENV_PREFIX)]
    ZeroNotAllowed {
        /// The parameter key.
        key: &'static str,
        /// The environment suffix.
        env: &'static str,
    },
    /// The chunk cap is below the region alignment.
    #[error("max_chunk_size_bytes = {0} is below 32 bytes; set it to at least the allocation granularity")]
    ChunkTooSmall(u64),
    /// `chunk_writes` names no thread.
    #[error("chunk_writes = {0:?} is not one of auto, io_thread, io_thread_when_idle, writer_thread; set {NIXL}CHUNK_WRITES to one of them", NIXL = ENV_PREFIX)]
    UnknownChunkWrites(String),
    /// `copy_launches` names no thread.
    #[error("copy_launches = {0:?} is not one of io_thread, io_thread_when_idle, copy_workers; set {NIXL}COPY_LAUNCHES to one of them", NIXL = ENV_PREFIX)]
    UnknownCopyLaunches(String),
    /// More writer threads than an instance takes.
    #[error("chunk_writer_threads = {0} is above 16; set {NIXL}CHUNK_WRITER_THREADS to 1-16", NIXL = ENV_PREFIX)]
    TooManyWriters(u64),
    /// Both an interface and loopback binding were requested.
    #[error("control_interface = {0:?} and control_bind_loopback = true contradict each other; set only one of them")]
    InterfaceAndLoopback(String),
}

/// How much of a kind of work the IO thread does itself, the rest going
/// to helper threads (`chunk_writes`: the writer thread; `copy_launches`:
/// the copy workers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoThreadUse {
    /// All of it.
    Always,
    /// None of it.
    Never,
    /// When no other such work runs (a lone request's latency: no thread
    /// hand-off); under load the helpers (the IO thread is then the
    /// bottleneck).
    WhenIdle,
}

/// The kind of a setting's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// Byte size with optional binary suffix.
    Bytes,
    /// Non-negative integer.
    Count,
    /// Milliseconds.
    Millis,
    /// Boolean.
    Bool,
    /// Free text.
    Text,
}

/// One row of [`Config::describe`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingInfo {
    /// Backend parameter key.
    pub key: &'static str,
    /// Full environment variable name.
    pub env: String,
    /// Default, rendered.
    pub default: String,
    /// Value syntax.
    pub kind: ValueKind,
    /// What it does.
    pub meaning: &'static str,
}

enum Parsed {
    Bool(bool),
    Num(u64),
    Text(String),
}

struct Setting {
    key: &'static str,
    env: &'static str,
    kind: ValueKind,
    /// Zero is a meaningful value (otherwise zero falls back with a warning).
    zero_ok: bool,
    meaning: &'static str,
    set: fn(&mut Config, Parsed),
    get: fn(&Config) -> String,
}

macro_rules! setting {
    ($field:ident, $key:literal, $env:literal, $kind:ident, $zero_ok:literal, $meaning:literal) => {
        Setting {
            key: $key,
            env: $env,
            kind: ValueKind::$kind,
            zero_ok: $zero_ok,
            meaning: $meaning,
            set: |c, v| setting!(@set c.$field, v, $kind),
            get: |c| setting!(@get c.$field, $kind),
        }
    };
    (@set $target:expr, $v:ident, Bool) => { if let Parsed::Bool(b) = $v { $target = b; } };
    (@set $target:expr, $v:ident, Text) => { if let Parsed::Text(s) = $v { $target = s; } };
    (@set $target:expr, $v:ident, $other:ident) => {
        if let Parsed::Num(n) = $v { $target = n.try_into().unwrap_or($target); }
    };
    (@get $target:expr, Bytes) => { format_bytes($target) };
    (@get $target:expr, Text) => { $target.clone() };
    (@get $target:expr, $other:ident) => { $target.to_string() };
}

static SETTINGS: &[Setting] = &[
    setting!(enabled, "enable", "ENABLE", Bool, true, "Master switch of the bounce path (on: BOUNCE exists for it; off: every transfer uses UCX)."),
    setting!(arena_size_bytes, "arena_size_bytes", "ARENA_SIZE_BYTES", Bytes, false, "Shared region arena size; usable capacity is the largest power of two not above it."),
    setting!(arena_allocation_granularity_bytes, "arena_allocation_granularity_bytes", "ARENA_ALLOCATION_GRANULARITY_BYTES", Bytes, false, "Buddy minimum block (allocation granularity); power of two, >= 32."),
    setting!(max_chunk_size_bytes, "max_chunk_size_bytes", "MAX_CHUNK_SIZE_BYTES", Bytes, false, "Per-chunk byte cap (plan bin-pack cap); clamped to the arena's usable capacity; must match the peer's (handshake-checked)."),
    setting!(max_inflight_chunks_per_request, "max_inflight_chunks_per_request", "MAX_INFLIGHT_CHUNKS_PER_REQUEST", Count, false, "Per-flow in-flight cap W (pipeline depth)."),
    setting!(min_chunks_per_request, "min_chunks_per_request", "MIN_CHUNKS_PER_REQUEST", Count, false, "Bounce arena: a request is cut into at least this many chunks (none below min_chunk_size_bytes), so that its gather, write and scatter overlap; 1 = chunks of max_chunk_size_bytes only. 8 rather than 4: a large request's plan was then packed in the check's pass on the preparation threads (its parts, whole chunks then, outnumbered the helpers; slices of chunks since), about 100 us less preparation for 16,384 x 4 KiB on an H100 host, the transfer itself the same (docs/benchmarks.md); at most max_inflight_chunks_per_request chunks of a request are in flight."),
    setting!(min_chunk_size_bytes, "min_chunk_size_bytes", "MIN_CHUNK_SIZE_BYTES", Bytes, true, "Bounce arena: the smallest chunk a request is cut into for overlap (min_chunks_per_request); smaller requests are one chunk."),
    setting!(standing_credit_peers, "standing_credit_peers", "STANDING_CREDIT_PEERS", Count, true, "Bounce arena, receiving: up to this many sender peers each get a standing credit, a region of min_chunk_size_bytes in this arena (taken at start-up, kept for that peer until it gives the credit back as it forgets this agent or shuts down) that the sender writes the first chunk of its next WRITE into at once, claiming it in the WANT, instead of waiting for the GRANT's round trip; after each use it is offered again. Only with peers that advertise standing credits; 0 = none (every WRITE waits for its GRANT)."),
    setting!(copy_stream_count, "copy_stream_count", "COPY_STREAM_COUNT", Count, false, "Copy execution contexts (GPU kernel concurrency cap)."),
    setting!(scatter_worker_count, "scatter_worker_count", "SCATTER_WORKER_COUNT", Count, false, "Scatter worker thread count."),
    setting!(min_descriptor_count, "min_descriptor_count", "MIN_DESCRIPTOR_COUNT", Count, false, "Bounce arena, DRAM on both sides: minimum descriptor count (fewer go to UCX)."),
    setting!(tcp_min_descriptor_count, "tcp_min_descriptor_count", "TCP_MIN_DESCRIPTOR_COUNT", Count, false, "Bounce arena, DRAM on both sides, a peer on another host (its regions name another boot id) while this host has no RDMA device UCX may use (none in /sys/class/infiniband, or UCX_TLS leaving no RDMA transport): minimum descriptor count (fewer go to UCX, which then sends a TCP message per descriptor). Between two network namespaces of the 2-core CPU machine the arena beat those UCX transfers from 32-64 x 8 KiB; 256 leaves a margin for hosts where a TCP message costs less."),
    setting!(tcp_max_average_descriptor_size_bytes, "tcp_max_average_descriptor_size_bytes", "TCP_MAX_AVERAGE_DESCRIPTOR_SIZE_BYTES", Bytes, true, "The same gate (a peer on another host reached over TCP): maximum average descriptor bytes (larger go to UCX; 0 = no limit). Measured up to 1 MiB blocks (4 and 8 x 1 MiB: 1.5-2.7x UCX between two network namespaces); larger blocks, which UCX streams at the link's rate, stay UCX's until measured on a NIC."),
    setting!(max_average_descriptor_size_bytes, "max_average_descriptor_size_bytes", "MAX_AVERAGE_DESCRIPTOR_SIZE_BYTES", Bytes, false, "Bounce arena, DRAM on both sides: maximum average descriptor bytes (larger go to UCX)."),
    setting!(vram_min_descriptor_count, "vram_min_descriptor_count", "VRAM_MIN_DESCRIPTOR_COUNT", Count, false, "Bounce arena, VRAM on both sides: minimum descriptor count."),
    setting!(mixed_min_descriptor_count, "mixed_min_descriptor_count", "MIXED_MIN_DESCRIPTOR_COUNT", Count, false, "Bounce arena, VRAM on one side and DRAM on the other: minimum descriptor count (fewer go to UCX). Measured on the H200 with the host-staged instance (mixed_host_staging), vLLM's VRAM -> DRAM READs ran at 2.2-2.4x UCX's speed at 64 x 8 KiB, 4.1x at 128, 1.6x at 256, 13x at 16,384; without it (mixed_host_staging off, or NIXL-notification control) the gate is mixed_unstaged_min_descriptor_count. The average size limit is vram_max_average_descriptor_size_bytes."),
    setting!(mixed_unstaged_min_descriptor_count, "mixed_unstaged_min_descriptor_count", "MIXED_UNSTAGED_MIN_DESCRIPTOR_COUNT", Count, false, "Bounce arena, VRAM on one side and DRAM on the other, when the transfer cannot take host-staged arenas and a GPU's own (VRAM) arena is on one side (mixed_host_staging off on either side, NIXL-notification control, or the host-staged arena could not start): minimum descriptor count, at least mixed_min_descriptor_count (fewer go to UCX: on the H200 such READs ran at 0.72x UCX's speed at 256 x 8 KiB, 1.12x at 512, 1.25x at 1024)."),
    setting!(mixed_host_staging, "mixed_host_staging", "MIXED_HOST_STAGING", Bool, true, "VRAM with DRAM on the other side (e.g. vLLM's host KV buffer): each GPU with registered memory gets a second bounce arena, of the arena's usable capacity (arena_size_bytes rounded down to a power of two) in host memory pinned for it, and such transfers take it: the GPU's kernels gather into it and scatter from it across PCIe, and the chunk write between it and the peer's DRAM arena is host to host, where UCX moves a write between a VRAM arena and a DRAM arena of two processes by software emulation over TCP (not with use_nixl_notifications: one instance per agent there). Off: mixed transfers use the GPU's VRAM arena."),
    setting!(vram_max_average_descriptor_size_bytes, "vram_max_average_descriptor_size_bytes", "VRAM_MAX_AVERAGE_DESCRIPTOR_SIZE_BYTES", Bytes, false, "Bounce arena, VRAM on either side: maximum average descriptor bytes."),
    setting!(peer_map_min_descriptor_count, "peer_map_min_descriptor_count", "PEER_MAP_MIN_DESCRIPTOR_COUNT", Count, false, "Peer-mapped path: minimum descriptor count."),
    setting!(peer_map_max_average_descriptor_size_bytes, "peer_map_max_average_descriptor_size_bytes", "PEER_MAP_MAX_AVERAGE_DESCRIPTOR_SIZE_BYTES", Bytes, true, "Peer-mapped path: maximum average descriptor bytes; 0 = no limit."),
    setting!(peer_map_inline_table_max_descriptors, "peer_map_inline_table_max_descriptors", "PEER_MAP_INLINE_TABLE_MAX_DESCRIPTORS", Count, true, "Peer-mapped path: a copy table of at most this many equal-length descriptors is the kernel's launch parameter (no driver call when a request is prepared; its launch takes 1.5 us longer at 256 descriptors, 7 us at 2040); larger tables are uploaded; 0 = always upload; at most 2040. Applies where requests are prepared at their first post (prepare_at_post); with prepare_at_post off every table is uploaded, since the post is then the client's hot path."),
    setting!(peer_map_prepare_threads, "peer_map_prepare_threads", "PEER_MAP_PREPARE_THREADS", Count, true, "Threads that prepare a large request together, the preparing thread among them: the peer-mapped path's copy table from 16,384 descriptors (bound by one core's memory bandwidth: 7-10 ns a descriptor alone; from 8192 while the threads are awake), the bounce arena's check of both lists and its plan from 8192 descriptors (the plan when they are of one length, packed in slices of its chunks). With prepare_at_post, prepXfer wakes them for a request of 8192 descriptors or more (not one the CMA path will take), and they poll up to 300 us for its first post; 1 = the preparing thread alone (none woken); 0 = auto: half the cores, at most 8; never more than the cores."),
    setting!(request_timeout_ms, "request_timeout_ms", "REQUEST_TIMEOUT_MS", Millis, false, "Per-request no-progress timeout."),
    setting!(disable_fabric_memory, "disable_fabric_memory", "DISABLE_FABRIC_MEMORY", Bool, true, "Plain device allocation instead of fabric memory for the arena."),
    setting!(enable_eager_gather, "enable_eager_gather", "ENABLE_EAGER_GATHER", Bool, true, "Launch gathers before the GRANT arrives (overlaps the control round trip); eager staging is capped at half the shared arena and yields to waiting grants."),
    setting!(copy_launches_last, "copy_launches_last", "COPY_LAUNCHES_LAST", Bool, false, "The IO thread launches gathers and scatters only when no control message, chunk write or completion waits, and reads what has arrived between two launches (a 4096-run launch costs it 45-75 us). On the H200 a 16,384 x 4 KiB request's GRANT was then read 250 us sooner and its first write posted 80 us sooner, but end to end it measured within the spread (docs/benchmarks.md), hence off."),
    setting!(use_nixl_notifications, "use_nixl_notifications", "USE_NIXL_NOTIFICATIONS", Bool, true, "Control plane over NIXL notifications instead of ZMQ/TCP; must match the peer (handshake-checked)."),
    setting!(direct_tcp_control, "direct_tcp_control", "DIRECT_TCP_CONTROL", Bool, true, "Control plane (unless use_nixl_notifications) over TCP sockets the IO thread owns; off: over ZMQ's sockets, whose own I/O thread every message crosses on both sides (six thread wake-ups a control round trip instead of two: on the H200 under MPS the GRANT round trip measured 0.10-0.12 ms over ZMQ against 0.04-0.06 direct); the same addresses and liveness; must match the peer (handshake-checked)."),
    setting!(use_zero_copy_arguments, "use_zero_copy_arguments", "USE_ZERO_COPY_ARGUMENTS", Bool, true, "Copy kernel reads its plan directly from pinned host memory (no upload); slower than the default upload (one async copy before the launch)."),
    setting!(use_cub_copy, "use_cub_copy", "USE_CUB_COPY", Bool, true, "Library batched memcpy instead of the custom copy kernel (experimental)."),
    setting!(copy_pair_tables, "copy_pair_tables", "COPY_PAIR_TABLES", Bool, true, "The bounce arena's gathers and scatters whose copies are all of one length (real clients' blocks) take the pair kernel's table: 16 bytes a copy instead of 36 a run, and up to 2040 copies the launch's own parameter (no upload). Off by default: on the H200 it measured no gain (the fill costs the same there, the pair kernel ran slower: 1024 x 4 KiB within the spread, a 4096-block chunk 0.76-0.82 ms against 0.62-0.67; docs/benchmarks.md). Applies to run lists: packed copies (a DATA's as decoded, and the sender's plans of equal aligned blocks) always take the pair kernel, uploaded (or, up to 1024 copies launched alone, their addresses as the launch's parameter: `copy_inline_packed`), which measured faster than the runs' host passes it replaces (design.md §4)."),
    setting!(copy_inline_packed, "copy_inline_packed", "COPY_INLINE_PACKED", Bool, true, "The bounce arena's packed copies (a chunk of one length's blocks) launched as one list (a chunk's gather, a DATA's scatter) of up to 1024 copies pass their application addresses as the kernel launch's own parameter, the arena side computed on the GPU: no pair table filled, no upload call before the launch (a driver call of its own, ~9 us under MPS on an H100): the launch steps of a lone 1024 x 4 KiB request, both sides, 19-26 us against 24-37 under MPS on an H100, its p50 within the spread (docs/benchmarks.md). Off: every packed list uploads a pair table. Lists launched together (`group_copy_launches`) always upload theirs."),
    setting!(disable_scatter_run_merging, "disable_scatter_run_merging", "DISABLE_SCATTER_RUN_MERGING", Bool, true, "DEBUG ONLY: one run per descriptor instead of coalesced runs."),
    setting!(request_deadline_ms, "request_deadline_ms", "REQUEST_DEADLINE_MS", Millis, true, "Absolute per-request deadline from submission; 0 = none."),
    setting!(peer_liveness_timeout_ms, "peer_liveness_timeout_ms", "PEER_LIVENESS_TIMEOUT_MS", Millis, true, "A peer whose control channel is down this long (heartbeats every quarter of it) is unreachable: its requests fail, its flows are aborted. Over direct TCP and NIXL notifications a silent peer is noticed this long after its last answer; over ZMQ after about twice this (the ZMTP heartbeat must time out first); 0 = off."),
    setting!(control_interface, "control_interface", "CONTROL_INTERFACE", Text, true, "Network interface for the control socket (direct TCP or ZMQ); empty = auto-detect."),
    setting!(control_bind_loopback, "control_bind_loopback", "CONTROL_BIND_LOOPBACK", Bool, true, "Bind the control socket (direct TCP or ZMQ) to 127.0.0.1 (single-host tests only)."),
    setting!(busy_poll_us, "busy_poll_us", "BUSY_POLL_US", Count, true, "Microseconds the IO thread, copy workers and chunk writer keep polling after their last event while transfers are live, instead of sleeping; 0 = always sleep (default: on the H200 host 200 us made requests slower, see docs/benchmarks.md)."),
    setting!(chunk_writes, "chunk_writes", "CHUNK_WRITES", Text, true, "Which thread posts and polls the bounce arena's chunk writes: auto (a device arena's, whose post only queues a CUDA IPC copy or an RDMA write: the IO thread when no other write runs, saving a thread hand-off each way, else the writer thread, as under load the IO thread is the bottleneck; a host arena's: the writer thread, as UCX over TCP sends inside the post), io_thread (always), io_thread_when_idle (auto's rule for a device arena, for either) or writer_thread (always)."),
    setting!(chunk_writer_threads, "chunk_writer_threads", "CHUNK_WRITER_THREADS", Count, false, "Writer threads per bounce instance (1 to 16), taking chunk writes from one queue. Between two processes of one host UCX copies a host-to-host chunk write inside its post (cross-memory attach), one at a time per thread: with several writer threads and as many inner-agent workers (the UCX parameter num_workers), several copies may run at once. Not yet measured where it would pay (the 2-core CPU machine cannot show it); 1: one writer thread, as before."),
    setting!(copy_launches, "copy_launches", "COPY_LAUNCHES", Text, true, "Which threads launch the bounce arena's CUDA gathers and scatters (fill the kernel's run table, upload it, launch; the IO thread polls every launched copy's event either way): io_thread (the default), io_thread_when_idle (the IO thread while no other copy runs, else a copy worker, so that a large request's chunks and concurrent requests fill their tables in parallel) or copy_workers (always); on the H200 the workers' launches gained nothing measurable (their hand-off costs 30-35 us and the driver serialises launches; docs/benchmarks.md). Host memcpy copies always run on the copy workers."),
    setting!(group_copy_launches, "group_copy_launches", "GROUP_COPY_LAUNCHES", Bool, true, "The bounce arena's CUDA gathers (and scatters) that the IO thread launches in one pass of its loop, such as a large request's eager gathers or the scatters of DATA messages read together, go as one kernel launch when they are packed copies of one block size: one table upload, launch and event instead of one each (each costs the IO thread 5-15 us of driver calls); they then end together. A copy is held only while another of its direction is held, or launched by the IO thread and not yet seen done: the first of a burst launches at once. Off: one launch per chunk."),
    setting!(receive_pass_us, "receive_pass_us", "RECEIVE_PASS_US", Count, true, "Microseconds the IO thread reads control messages in one pass of its loop before it launches the copies they started (grouped, group_copy_launches) and polls its copies and chunk writes; then it reads on. A receiver fed DATA messages faster than it reads them otherwise held every scatter until the stream paused: on an H100, 64 MiB in 8 chunks, the later scatters waited up to ~180 us for the last DATA (docs/benchmarks.md). 0 = read until none is ready."),
    setting!(reactor_busy_poll_us, "reactor_busy_poll_us", "REACTOR_BUSY_POLL_US", Count, true, "Microseconds the IO thread alone (not the copy workers or the chunk writer) keeps polling after its last event while transfers are live, waiting for a GRANT, an ACK or a write's completion; 0 = as busy_poll_us."),
    setting!(ucx_progress_delay_us, "ucx_progress_delay_us", "UCX_PROGRESS_DELAY_US", Count, true, "Progress-thread delay of the UCX delegate (the UCX engine that carries the transfers BOUNCE does not accelerate), in us: the thread waits in poll() for UCX events, at most this long (rounded up to 1 ms); 0 = the application's own setting (NIXL's default 0 spins a core)."),
    setting!(notif_poll_us, "notif_poll_us", "NOTIF_POLL_US", Count, true, "NIXL-notification control (use_nixl_notifications): while a control exchange is under way (a message sent or received in the last 5 ms) the channel polls the inner agent for the reply this often, in us; idle, and with 0 always, it backs off from 50 us to 1 ms (NIXL has no blocking wait for notifications)."),
    setting!(enable_peer_map, "enable_peer_map", "ENABLE_PEER_MAP", Bool, true, "VRAM peers on the same host: one kernel moves an eligible transfer straight between this process's memory and the peer's, mapped with CUDA IPC (no arena, no kernel in the peer); off: such transfers take the bounce path."),
    setting!(prepare_at_post, "prepare_at_post", "PREPARE_AT_POST", Bool, true, "A request's per-descriptor work (its route, the check of both lists, the arena's plan or the peer-mapped copy table) is done at its first post and kept for its re-posts, as UCX does its own at post, so that prepXfer costs what UCX's does (a handle); errors of the descriptors are then reported by the post. Off: done in prepXfer."),
    setting!(announce_writes, "announce_writes", "ANNOUNCE_WRITES", Bool, true, "A WRITE over the bounce arena prepared at its first post (prepare_at_post), of 8192 descriptors or more of one length (checked and packed on the preparation's threads), sends its WANT (the chunks' sizes, known from the count and the length) before its descriptors are checked and its chunks packed, and each chunk is gathered and written as soon as it is packed, so that the GRANT's round trip and the first writes run under that work (16,384 x 4 KiB over the arena on an H100: 0.53-0.64 ms against 0.59-0.72); its DATA waits until every descriptor is checked, so a transfer refused by its check, or withdrawn because it takes another route after all, moves no byte into its destination. Off: the WANT follows the plan."),
    setting!(enable_cma, "enable_cma", "ENABLE_CMA", Bool, true, "DRAM peers on the same host (proven by reading a token in the peer's memory): one copy moves an eligible transfer straight between this process's memory and the peer's by cross-memory attach, 1024 descriptors a system call (a memory copy between two agents of one process); and the bounce arena's chunk writes between two host arenas on one host (mixed DRAM/VRAM transfers through a GPU's host-staged arena) go the same way, on the CMA threads (on the H200 host 16,384 x 4 KiB mixed READs took 11.5 ms against 25 with UCX's writes); off: such transfers take the bounce arena or UCX, and chunk writes go through UCX."),
    setting!(cma_min_descriptor_count, "cma_min_descriptor_count", "CMA_MIN_DESCRIPTOR_COUNT", Count, false, "CMA path: minimum descriptor count (fewer go to UCX)."),
    setting!(cma_max_average_descriptor_size_bytes, "cma_max_average_descriptor_size_bytes", "CMA_MAX_AVERAGE_DESCRIPTOR_SIZE_BYTES", Bytes, true, "CMA path between two processes: maximum average descriptor bytes (larger go to UCX); 0 = no limit, the default (on the CPU machine, one backend alive at a time, CMA ran at 1.0-1.9x UCX with vLLM's num_threads=4 and 1.5-2.1x UCX without, from 16 KiB to 1 MiB blocks); within one process there is no limit."),
    setting!(cma_threads, "cma_threads", "CMA_THREADS", Count, true, "CMA path: threads that copy one transfer (or one chunk write into a peer's host arena) of more than 256 KiB together, in parts of at least 1 MiB (smaller ones are copied in the post); 1 = in the post always; 0 = auto: the cores, at most 4."),
];

/// Renders a byte count with the largest exact binary suffix.
pub fn format_bytes(n: u64) -> String {
    if n != 0 && n.is_multiple_of(GIB) {
        format!("{}GiB", n / GIB)
    } else if n != 0 && n.is_multiple_of(MIB) {
        format!("{}MiB", n / MIB)
    } else if n != 0 && n.is_multiple_of(KIB) {
        format!("{}KiB", n / KIB)
    } else {
        n.to_string()
    }
}

/// Parses a byte size: decimal digits, optional spaces, optional binary
/// suffix (K, KB, KiB, M, MB, MiB, G, GB, GiB, B; any case).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        return Err(
            "expected a number, optionally followed by K/KB/KiB, M/MB/MiB or G/GB/GiB".into(),
        );
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{digits:?} is too large"))?;
    let mult = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => KIB,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => GIB,
        other => {
            return Err(format!(
                "unknown size suffix {other:?} (use K/KB/KiB, M/MB/MiB or G/GB/GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{t:?} overflows 64 bits"))
}

/// Parses a boolean: 1/0, true/false, on/off, yes/no (any case).
pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err("expected one of 1/0, true/false, on/off, yes/no".into()),
    }
}

fn parse_count(text: &str) -> Result<u64, String> {
    text.trim()
        .parse::<u64>()
        .map_err(|_| "expected a non-negative decimal integer".to_string())
}

impl Setting {
    fn parse(&self, raw: &str) -> Result<Parsed, String> {
        let parsed = match self.kind {
            ValueKind::Bool => Parsed::Bool(parse_bool(raw)?),
            ValueKind::Bytes => Parsed::Num(parse_bytes(raw)?),
            ValueKind::Count | ValueKind::Millis => Parsed::Num(parse_count(raw)?),
            ValueKind::Text => Parsed::Text(raw.trim().to_string()),
        };
        if let Parsed::Num(n) = parsed {
            if n == 0 && !self.zero_ok {
                return Err("zero is not allowed here".into());
            }
            if matches!(
                self.key,
                "max_inflight_chunks_per_request" | "copy_stream_count" | "scatter_worker_count"
            ) && n > u64::from(u32::MAX)
            {
                return Err(format!("{n} is larger than {}", u32::MAX));
            }
        }
        Ok(parsed)
    }

    fn env_name(&self) -> String {
        format!("{ENV_PREFIX}{}", self.env)
    }
}

impl Config {
    /// The backend parameter keys this crate understands.
    pub fn known_param_keys() -> Vec<&'static str> {
        SETTINGS.iter().map(|s| s.key).collect()
    }

    /// Keys of `params` that are not known settings (for the engine to reject).
    pub fn unknown_params<'a>(params: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        params
            .into_iter()
            .filter(|k| !SETTINGS.iter().any(|s| s.key == *k))
            .map(str::to_string)
            .collect()
    }

    /// One row per setting: key, env variable, default, value kind, meaning.
    pub fn describe() -> Vec<SettingInfo> {
        let defaults = Config::default();
        SETTINGS
            .iter()
            .map(|s| SettingInfo {
                key: s.key,
                env: s.env_name(),
                default: (s.get)(&defaults),
                kind: s.kind,
                meaning: s.meaning,
            })
            .collect()
    }

    /// [`Config::describe`] as a Markdown table (for the README and docs).
    pub fn describe_markdown() -> String {
        let mut out = String::from(
            "| parameter | environment variable | default | meaning |\n|---|---|---|---|\n",
        );
        for row in Config::describe() {
            let default = if row.default.is_empty() {
                "(empty)"
            } else {
                row.default.as_str()
            };
            out.push_str(&format!(
                "| `{}` | `{}` | {} | {} |\n",
                row.key, row.env, default, row.meaning
            ));
        }
        out
    }

    /// Resolves the configuration from the real process environment and the
    /// backend parameters.
    pub fn from_process_env(
        params: &BTreeMap<String, String>,
    ) -> Result<(Config, Vec<ConfigWarning>), ConfigError> {
        Config::resolve(&|name: &str| std::env::var(name).ok(), params)
    }

    /// Resolves the configuration: for each setting the backend parameter
    /// wins over the environment variable (looked up through `env`), which
    /// wins over the default. Invalid values are skipped with a warning.
    /// Unknown parameter keys are ignored here (see
    /// [`Config::unknown_params`]). Returns the validated config and every
    /// warning (each one is also logged).
    pub fn resolve(
        env: &dyn Fn(&str) -> Option<String>,
        params: &BTreeMap<String, String>,
    ) -> Result<(Config, Vec<ConfigWarning>), ConfigError> {
        let mut config = Config::default();
        let mut warnings = Vec::new();
        for setting in SETTINGS {
            let env_name = setting.env_name();
            // A parameter equal to the advertised default counts as not
            // given: NIXL clients often pass the plugin's option list back
            // unchanged (nixl-sys: get_plugin_params -> create_backend), and
            // that must not silently override the environment.
            let default = (setting.get)(&Config::default());
            let candidates = [
                params
                    .get(setting.key)
                    .filter(|v| **v != default)
                    .map(|v| (ConfigSource::Param(setting.key.to_string()), v.clone())),
                env(&env_name).map(|v| (ConfigSource::Env(env_name.clone()), v)),
            ];
            for (source, raw) in candidates.into_iter().flatten() {
                match setting.parse(&raw) {
                    Ok(value) => {
                        (setting.set)(&mut config, value);
                        break;
                    }
                    Err(why) => warnings.push(ConfigWarning {
                        source,
                        value: raw,
                        message: format!("{why}; ignored (the next source or the default applies)"),
                    }),
                }
            }
        }
        config.validate_into(&mut warnings)?;
        for w in &warnings {
            tracing::warn!(target: "nixl_bounce::config", "{w}");
        }
        Ok((config, warnings))
    }

    /// The control transport the settings choose (the handshake's kind).
    pub fn control_kind(&self) -> crate::proto::wire::ControlKind {
        use crate::proto::wire::ControlKind;
        if self.use_nixl_notifications {
            ControlKind::NixlNotif
        } else if self.direct_tcp_control {
            ControlKind::Tcp
        } else {
            ControlKind::Zmq
        }
    }

    /// Where the chunk writes of an arena in device memory (`device`) or
    /// host memory are posted (`chunk_writes`); `None` when it names no
    /// way.
    pub fn chunk_writes_for(&self, device: bool) -> Option<IoThreadUse> {
        match self.chunk_writes.as_str() {
            "auto" if device => Some(IoThreadUse::WhenIdle),
            "auto" | "writer_thread" => Some(IoThreadUse::Never),
            "io_thread" => Some(IoThreadUse::Always),
            "io_thread_when_idle" => Some(IoThreadUse::WhenIdle),
            _ => None,
        }
    }

    /// Where CUDA gathers and scatters are launched (`copy_launches`);
    /// `None` when it names no way.
    pub fn copy_launches(&self) -> Option<IoThreadUse> {
        match self.copy_launches.as_str() {
            "io_thread" => Some(IoThreadUse::Always),
            "io_thread_when_idle" => Some(IoThreadUse::WhenIdle),
            "copy_workers" => Some(IoThreadUse::Never),
            _ => None,
        }
    }

    /// The arena's usable capacity: the largest power of two not above
    /// `arena_size_bytes` (0 when the arena size is 0).
    pub fn arena_usable_capacity(&self) -> u64 {
        match self.arena_size_bytes {
            0 => 0,
            n => 1u64 << (63 - n.leading_zeros()),
        }
    }

    /// Checks the settings against each other and clamps
    /// `max_chunk_size_bytes` to the usable capacity. Returns the
    /// adjustments as warnings.
    pub fn validate(&mut self) -> Result<Vec<ConfigWarning>, ConfigError> {
        let mut warnings = Vec::new();
        self.validate_into(&mut warnings)?;
        Ok(warnings)
    }

    fn validate_into(&mut self, warnings: &mut Vec<ConfigWarning>) -> Result<(), ConfigError> {
        let g = self.arena_allocation_granularity_bytes;
        for (value, key, env) in [
            (
                u64::from(self.max_inflight_chunks_per_request),
                "max_inflight_chunks_per_request",
                "MAX_INFLIGHT_CHUNKS_PER_REQUEST",
            ),
            (
                u64::from(self.copy_stream_count),
                "copy_stream_count",
                "COPY_STREAM_COUNT",
            ),
            (
                u64::from(self.scatter_worker_count),
                "scatter_worker_count",
                "SCATTER_WORKER_COUNT",
            ),
            (
                self.arena_size_bytes,
                "arena_size_bytes",
                "ARENA_SIZE_BYTES",
            ),
            (
                g,
                "arena_allocation_granularity_bytes",
                "ARENA_ALLOCATION_GRANULARITY_BYTES",
            ),
            (
                self.max_chunk_size_bytes,
                "max_chunk_size_bytes",
                "MAX_CHUNK_SIZE_BYTES",
            ),
            (
                self.request_timeout_ms,
                "request_timeout_ms",
                "REQUEST_TIMEOUT_MS",
            ),
        ] {
            if value == 0 {
                return Err(ConfigError::ZeroNotAllowed { key, env });
            }
        }
        if !g.is_power_of_two() {
            return Err(ConfigError::GranularityNotPowerOfTwo(g));
        }
        if g < 32 {
            return Err(ConfigError::GranularityTooSmall(g));
        }
        if g > self.arena_size_bytes {
            return Err(ConfigError::GranularityAboveArena {
                granularity: g,
                arena: self.arena_size_bytes,
            });
        }
        if self.max_chunk_size_bytes < 32 {
            return Err(ConfigError::ChunkTooSmall(self.max_chunk_size_bytes));
        }
        if self.chunk_writes_for(false).is_none() {
            return Err(ConfigError::UnknownChunkWrites(self.chunk_writes.clone()));
        }
        if self.copy_launches().is_none() {
            return Err(ConfigError::UnknownCopyLaunches(self.copy_launches.clone()));
        }
        if self.chunk_writer_threads > 16 {
            return Err(ConfigError::TooManyWriters(self.chunk_writer_threads));
        }
        if self.control_bind_loopback && !self.control_interface.is_empty() {
            return Err(ConfigError::InterfaceAndLoopback(
                self.control_interface.clone(),
            ));
        }
        let usable = self.arena_usable_capacity();
        if usable != self.arena_size_bytes {
            warnings.push(ConfigWarning {
                source: ConfigSource::Derived("arena_size_bytes".into()),
                value: self.arena_size_bytes.to_string(),
                message: format!(
                    "not a power of two: only {} ({usable} bytes) are usable by the buddy allocator; \
                     choose a power of two to use all of it",
                    format_bytes(usable)
                ),
            });
        }
        if self.max_chunk_size_bytes > usable {
            warnings.push(ConfigWarning {
                source: ConfigSource::Derived("max_chunk_size_bytes".into()),
                value: self.max_chunk_size_bytes.to_string(),
                message: format!(
                    "larger than the arena's usable capacity; clamped to {} ({usable} bytes)",
                    format_bytes(usable)
                ),
            });
            self.max_chunk_size_bytes = usable;
        }
        if self.max_chunk_size_bytes > usable / 2 {
            warnings.push(ConfigWarning {
                source: ConfigSource::Derived("max_chunk_size_bytes".into()),
                value: self.max_chunk_size_bytes.to_string(),
                message: format!(
                    "above half the usable arena ({}): no local reserve block fits, so an agent that both \
                     sends and receives can stall until request_timeout_ms; set it to at most {}",
                    format_bytes(usable),
                    format_bytes(usable / 2)
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    }

    fn params_of(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_match_the_table() {
        let (c, w) = Config::resolve(&|_| None, &BTreeMap::new()).unwrap();
        assert_eq!(c, Config::default());
        assert!(w.is_empty());
        assert_eq!(c.arena_usable_capacity(), 256 * MIB);
        let keys = Config::known_param_keys();
        assert_eq!(keys.len(), 54);
        assert!(keys.contains(&"announce_writes"));
        assert!(keys.contains(&"standing_credit_peers"));
        assert!(keys.contains(&"copy_launches"));
        assert!(keys.contains(&"group_copy_launches"));
        assert!(keys.contains(&"receive_pass_us"));
        assert!(keys.contains(&"copy_launches_last"));
        assert!(keys.contains(&"chunk_writes"));
        assert!(keys.contains(&"direct_tcp_control"));
        assert!(keys.contains(&"prepare_at_post"));
        assert!(keys.contains(&"enable_peer_map"));
        assert!(keys.contains(&"enable_cma"));
        assert!(keys.contains(&"enable"));
        assert!(keys.contains(&"arena_size_bytes"));
        assert!(keys.contains(&"control_bind_loopback"));
        assert!(keys.contains(&"busy_poll_us"));
        assert!(keys.contains(&"reactor_busy_poll_us"));
        assert!(keys.contains(&"peer_liveness_timeout_ms"));
        let rows = Config::describe();
        assert_eq!(rows[0].env, "NIXL_BOUNCE_ENABLE");
        assert_eq!(rows[1].default, "256MiB");
        assert!(Config::describe_markdown().contains("`NIXL_BOUNCE_MAX_CHUNK_SIZE_BYTES`"));
    }

    #[test]
    fn byte_suffixes() {
        for (text, want) in [
            ("512", 512),
            ("4k", 4 * KIB),
            ("4 KB", 4 * KIB),
            ("4KiB", 4 * KIB),
            ("256MB", 256 * MIB),
            ("1gb", GIB),
            ("2 GiB", 2 * GIB),
            ("  8m ", 8 * MIB),
            ("64B", 64),
        ] {
            assert_eq!(parse_bytes(text), Ok(want), "{text}");
        }
        for bad in [
            "",
            "MB",
            "12XB",
            "-1",
            "1.5MB",
            "99999999999999999999",
            "17179869184G",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bools() {
        for t in ["1", "true", "ON", "Yes"] {
            assert_eq!(parse_bool(t), Ok(true));
        }
        for f in ["0", "False", "off", "NO"] {
            assert_eq!(parse_bool(f), Ok(false));
        }
        assert!(parse_bool("maybe").is_err());
    }

    #[test]
    fn params_win_over_env_and_garbage_falls_back() {
        let env = env_of(&[
            ("NIXL_BOUNCE_ARENA_SIZE_BYTES", "64MiB"),
            ("NIXL_BOUNCE_MAX_CHUNK_SIZE_BYTES", "garbage"),
            ("NIXL_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST", "0"),
            ("NIXL_BOUNCE_ENABLE", "yes"),
            ("NIXL_BOUNCE_COPY_STREAM_COUNT", "3"),
        ]);
        let params = params_of(&[
            ("arena_size_bytes", "128MiB"),
            ("copy_stream_count", "nope"),
        ]);
        let (c, w) = Config::resolve(&env, &params).unwrap();
        assert!(c.enabled);
        assert_eq!(c.arena_size_bytes, 128 * MIB);
        assert_eq!(c.max_chunk_size_bytes, 32 * MIB);
        assert_eq!(c.max_inflight_chunks_per_request, 8);
        // The bad parameter is skipped, the env value applies.
        assert_eq!(c.copy_stream_count, 3);
        let named: Vec<String> = w.iter().map(|w| w.source.to_string()).collect();
        assert!(named
            .iter()
            .any(|s| s.contains("NIXL_BOUNCE_MAX_CHUNK_SIZE_BYTES")));
        assert!(named
            .iter()
            .any(|s| s.contains("NIXL_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST")));
        assert!(named.iter().any(|s| s.contains("`copy_stream_count`")));
        assert_eq!(w.len(), 3);
    }

    #[test]
    fn chunk_clamped_to_usable_capacity() {
        let env = env_of(&[
            ("NIXL_BOUNCE_ARENA_SIZE_BYTES", "24MiB"),
            ("NIXL_BOUNCE_MAX_CHUNK_SIZE_BYTES", "32MiB"),
        ]);
        let (c, w) = Config::resolve(&env, &BTreeMap::new()).unwrap();
        assert_eq!(c.arena_usable_capacity(), 16 * MIB);
        assert_eq!(c.max_chunk_size_bytes, 16 * MIB);
        // Not a power of two, clamped, and no room for the local reserve.
        assert_eq!(w.len(), 3, "{w:?}");
    }

    #[test]
    fn contradictions_are_errors_that_say_what_to_change() {
        let e = Config::resolve(
            &env_of(&[("NIXL_BOUNCE_ARENA_ALLOCATION_GRANULARITY_BYTES", "3MiB")]),
            &BTreeMap::new(),
        )
        .unwrap_err();
        assert!(matches!(e, ConfigError::GranularityNotPowerOfTwo(_)));
        assert!(e.to_string().contains("power of two"));
        let e = Config::resolve(
            &env_of(&[
                ("NIXL_BOUNCE_ARENA_SIZE_BYTES", "1MiB"),
                ("NIXL_BOUNCE_ARENA_ALLOCATION_GRANULARITY_BYTES", "2MiB"),
            ]),
            &BTreeMap::new(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("lower the granularity"));
        let mut c = Config {
            max_inflight_chunks_per_request: 0,
            ..Config::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("MAX_INFLIGHT_CHUNKS_PER_REQUEST"));
        let e = Config::resolve(
            &|_| None,
            &params_of(&[
                ("control_interface", "eth0"),
                ("control_bind_loopback", "1"),
            ]),
        )
        .unwrap_err();
        assert!(matches!(e, ConfigError::InterfaceAndLoopback(_)));
    }

    #[test]
    fn chunk_writes_names_a_thread() {
        use IoThreadUse::*;
        let c = Config::default();
        assert_eq!(c.chunk_writes_for(true), Some(WhenIdle));
        assert_eq!(c.chunk_writes_for(false), Some(Never));
        assert_eq!(c.copy_launches(), Some(Always));
        for (value, device, host) in [
            ("io_thread", Always, Always),
            ("io_thread_when_idle", WhenIdle, WhenIdle),
            ("writer_thread", Never, Never),
        ] {
            let (c, _) =
                Config::resolve(&|_| None, &params_of(&[("chunk_writes", value)])).unwrap();
            assert_eq!(c.chunk_writes_for(true), Some(device));
            assert_eq!(c.chunk_writes_for(false), Some(host));
        }
        let e = Config::resolve(&|_| None, &params_of(&[("chunk_writes", "reactor")])).unwrap_err();
        assert!(matches!(e, ConfigError::UnknownChunkWrites(_)));
        assert!(e.to_string().contains("NIXL_BOUNCE_CHUNK_WRITES"), "{e}");
        for (value, want) in [
            ("io_thread", Always),
            ("io_thread_when_idle", WhenIdle),
            ("copy_workers", Never),
        ] {
            let (c, _) =
                Config::resolve(&|_| None, &params_of(&[("copy_launches", value)])).unwrap();
            assert_eq!(c.copy_launches(), Some(want));
        }
        let e = Config::resolve(&|_| None, &params_of(&[("copy_launches", "auto")])).unwrap_err();
        assert!(matches!(e, ConfigError::UnknownCopyLaunches(_)));
    }

    #[test]
    fn chunk_writer_threads_are_one_to_sixteen() {
        let threads =
            |v: &str| Config::resolve(&|_| None, &params_of(&[("chunk_writer_threads", v)]));
        assert_eq!(threads("4").unwrap().0.chunk_writer_threads, 4);
        assert!(matches!(
            threads("17").unwrap_err(),
            ConfigError::TooManyWriters(17)
        ));
        // Zero is refused at parsing: a warning (an error for an explicit
        // backend parameter, in the engine), and the default stands.
        let (c, warnings) = threads("0").unwrap();
        assert_eq!(c.chunk_writer_threads, 1);
        assert!(!warnings.is_empty(), "zero writers");
    }

    #[test]
    fn unknown_params_are_listed() {
        assert_eq!(
            Config::unknown_params(["arena_size_bytes", "bogus", "enable"]),
            vec!["bogus".to_string()]
        );
    }

    #[test]
    fn deadline_zero_means_none_and_is_accepted() {
        let (c, w) = Config::resolve(
            &env_of(&[("NIXL_BOUNCE_REQUEST_DEADLINE_MS", "0")]),
            &BTreeMap::new(),
        )
        .unwrap();
        assert_eq!(c.request_deadline_ms, 0);
        assert!(w.is_empty());
    }
}

#[cfg(test)]
mod advertised_defaults {
    use super::*;

    #[test]
    fn a_parameter_equal_to_its_advertised_default_does_not_override_the_environment() {
        let env =
            |name: &str| (name == "NIXL_BOUNCE_MAX_CHUNK_SIZE_BYTES").then(|| "1MiB".to_string());
        let advertised: BTreeMap<String, String> = Config::describe()
            .into_iter()
            .map(|s| (s.key.to_string(), s.default))
            .collect();
        let (cfg, warnings) = Config::resolve(&env, &advertised).unwrap();
        assert_eq!(cfg.max_chunk_size_bytes, 1 << 20, "{warnings:?}");
        let mut explicit = advertised.clone();
        explicit.insert("max_chunk_size_bytes".into(), "2MiB".into());
        let (cfg, _) = Config::resolve(&env, &explicit).unwrap();
        assert_eq!(
            cfg.max_chunk_size_bytes,
            2 << 20,
            "a non-default parameter still wins"
        );
    }
}

#[cfg(test)]
mod doc_sync {
    /// The configuration tables in docs/design.md and README.md are
    /// generated from `Config::describe_markdown()`; this keeps them in step.
    #[test]
    fn design_doc_config_table_is_current() {
        let table = super::Config::describe_markdown();
        for file in ["docs/design.md", "README.md"] {
            let doc = std::fs::read_to_string(format!("{}/{file}", env!("CARGO_MANIFEST_DIR")))
                .unwrap_or_else(|e| panic!("{file}: {e}"));
            assert!(
                doc.contains(&table),
                "{file} is missing the current configuration table; paste this:\n{table}"
            );
        }
    }
}
