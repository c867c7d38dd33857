//! Per-engine counters, readable from Rust, from C and from Python.
//!
//! Each engine registers its [`EngineStats`] under its agent name. The C
//! export `nixl_bounce_stats` (see `src/ffi`) renders a JSON snapshot; Python
//! reaches it with `ctypes` on the loaded plugin. Rust code that uses BOUNCE
//! through NIXL calls [`plugin_stats`], which finds the copy of this library
//! that NIXL loaded (a separate copy from any the program links itself).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};

use libloading::os::unix::Library;

use serde::{Deserialize, Serialize};

use crate::engine::bounce::Fallback;
use crate::sync::Locked;

/// Declares a struct of atomic counters, each declared once: its field, its
/// name in a snapshot, and `named()`, which lists them. Fields that are not
/// plain counters (gauges, arrays, nested counters) follow in `also { }`.
macro_rules! typed_counters {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $($(#[$fmeta:meta])* $field:ident => $key:literal,)*
        }
        $(also {
            $($(#[$xmeta:meta])* $xfield:ident: $xty:ty,)*
        })?
    ) => {
        $(#[$meta])*
        #[derive(Debug, Default)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: ::std::sync::atomic::AtomicU64,)*
            $($($(#[$xmeta])* pub $xfield: $xty,)*)?
        }

        impl $name {
            /// Each counter with its snapshot name.
            pub fn named(&self) -> impl Iterator<Item = (&'static str, &::std::sync::atomic::AtomicU64)> {
                [$(($key, &self.$field)),*].into_iter()
            }
        }
    };
}
pub(crate) use typed_counters;

typed_counters! {
    /// Counters of one engine, all monotonic. These are in every snapshot;
    /// the rest (`fallbacks`, `hot`, `rare`) once they count something.
    pub struct Counters {
        registrations => "registrations",
        deregistrations => "deregistrations",
        transfers_prepared => "transfers_prepared",
        transfers_posted => "transfers_posted",
        transfers_failed => "transfers_failed",
        notifs_received => "notifs_received",
        rejected_calls => "rejected_calls",
        panics => "panics",
    }
    also {
        /// The plugin's own time in preparations (`prepare_ns`). Transfers
        /// the shim hands to UCX below the route floor are counted as
        /// prepared but not timed (their share is a few comparisons in the
        /// shim).
        prepare_ns: AtomicU64,
        /// Transfers the UCX delegate carries, by reason (`fallback_*`,
        /// indexed by [`Fallback::index`]).
        fallbacks: [AtomicU64; Fallback::ALL.len()],
        /// What every preparation and post of BOUNCE's own paths adds to.
        hot: HotCounters,
        /// What is rare: failures, cancellations, refused peers.
        rare: RareCounters,
    }
}

typed_counters! {
    /// What happens seldom: transfers that failed or were cancelled, peers
    /// refused, paths that could not be set up.
    pub struct RareCounters {
        peer_map_exported => "peer_map_exported",
        peer_map_unavailable => "peer_map_unavailable",
        peer_map_succeeded => "peer_map_succeeded",
        peer_map_failed => "peer_map_failed",
        peer_map_cancelled => "peer_map_cancelled",
        cma_succeeded => "cma_succeeded",
        cma_failed => "cma_failed",
        cma_cancelled => "cma_cancelled",
        bounce_cancelled => "bounce_cancelled",
        arena_mixed_staged => "arena_mixed_staged",
        /// A peer's bounce instance refused at its handshake (its transfers
        /// then count as `fallback_peer_not_bounce_capable`), by reason.
        peer_incompatible_wire_version => "peer_incompatible_wire_version",
        peer_incompatible_control_kind => "peer_incompatible_control_kind",
        peer_incompatible_chunk_size => "peer_incompatible_chunk_size",
        peer_incompatible_no_cancel => "peer_incompatible_no_cancel",
        peer_incompatible_endpoint => "peer_incompatible_endpoint",
    }
}

typed_counters! {
    /// The counters a peer-mapped preparation (its breakdown) and every
    /// post add to: atomics side by side in a few cache lines. In the named
    /// map, each was a search among tens of keys under a lock, and on the
    /// cold caches a real client's preparation meets (vLLM prepares a new
    /// request every step) those searches cost microseconds.
    pub struct HotCounters {
        peer_prepared => "peer_map_prepared",
        peer_prepare_ns => "peer_map_prepare_ns",
        peer_inline_tables => "peer_map_inline_tables",
        /// Inline tables uploaded at their request's second post (a
        /// request posted again is taken to be posted many times).
        peer_inline_uploaded => "peer_map_inline_tables_uploaded",
        peer_fill_ns => "peer_map_fill_ns",
        peer_setup_ns => "peer_map_setup_ns",
        peer_upload_ns => "peer_map_upload_ns",
        peer_upload_alloc_ns => "peer_map_upload_alloc_ns",
        peer_upload_copy_ns => "peer_map_upload_copy_ns",
        peer_upload_order_ns => "peer_map_upload_order_ns",
        peer_fill_parts => "peer_map_fill_parts",
        peer_fill_parts_helped => "peer_map_fill_parts_helped",
        peer_fill_tables_helped => "peer_map_fill_tables_helped",
        peer_fill_first_help_ns => "peer_map_fill_first_help_ns",
        /// The plugin's time in a peer-mapped preparation before its table.
        prepare_before_table_ns => "prepare_before_table_ns",
        peer_submitted => "peer_map_submitted",
        peer_bytes => "peer_map_bytes",
        bounce_submitted => "bounce_submitted",
        bounce_bytes => "bounce_bytes",
        /// Arena plans packed in parts on several threads, their parts,
        /// and the parts the pool's workers packed.
        arena_plans_in_parts => "arena_plans_in_parts",
        arena_plan_parts => "arena_plan_parts",
        arena_plan_parts_helped => "arena_plan_parts_helped",
        /// Arena plans packed in the check's own pass over the lists
        /// (counted in `arena_plans_in_parts` too).
        arena_plans_with_check => "arena_plans_with_check",
        /// When the first worker began a part of a plan packed after the
        /// check, summed (ns after the packing began; a plan packed in the
        /// check's pass counts in `arena_check_first_help_ns`).
        arena_plan_first_help_ns => "arena_plan_first_help_ns",
        /// Arena-path preparations, and the plugin's time in their checks
        /// of NIXL's two lists (with routing's facts and the plan's
        /// survey; with the plan's packing when it was done in the same
        /// pass, `arena_plans_with_check`) and in their plans (only the
        /// assembly then).
        arena_prepared => "arena_prepared",
        arena_check_ns => "arena_check_ns",
        arena_plan_ns => "arena_plan_ns",
        /// Checks of both lists in parts (those of transfers the
        /// peer-mapped path's checked route took too): their parts, the
        /// parts the workers checked, and when the first began one
        /// (summed).
        arena_check_parts => "arena_check_parts",
        arena_check_parts_helped => "arena_check_parts_helped",
        arena_check_first_help_ns => "arena_check_first_help_ns",
        cma_prepared => "cma_prepared",
        cma_submitted => "cma_submitted",
        cma_bytes => "cma_bytes",
    }
}

/// Reads an engine's live counters (name, value) and its poison cause, if
/// any, for a stats snapshot.
pub type StatsSource = Box<dyn Fn() -> (BTreeMap<String, u64>, Option<String>) + Send>;

/// What an engine exposes about itself.
pub struct EngineStats {
    pub agent: String,
    pub params: BTreeMap<String, String>,
    pub counters: Counters,
    /// Live values from the bounce runtime, read at snapshot time.
    source: Mutex<Option<StatsSource>>,
}

impl std::fmt::Debug for EngineStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineStats")
            .field("agent", &self.agent)
            .finish_non_exhaustive()
    }
}

/// A point-in-time copy of an engine's statistics (the JSON shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub agent: String,
    pub version: String,
    pub params: BTreeMap<String, String>,
    pub counters: BTreeMap<String, u64>,
    /// Why the bounce arena is poisoned, if it is.
    #[serde(default)]
    pub poisoned: Option<String>,
}

impl EngineStats {
    pub fn new(agent: &str, params: BTreeMap<String, String>) -> Arc<Self> {
        let stats = Arc::new(Self {
            agent: agent.to_string(),
            params,
            counters: Counters::default(),
            source: Mutex::new(None),
        });
        REGISTRY
            .locked()
            .insert(agent.to_string(), Arc::downgrade(&stats));
        stats
    }

    pub fn bump(counter: &AtomicU64) {
        Self::add(counter, 1);
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts a transfer the UCX delegate carries, and why.
    pub fn fell_back(&self, reason: Fallback) {
        Self::bump(&self.counters.fallbacks[reason.index()]);
    }

    /// Installs the source of live runtime counters and poison state.
    pub fn set_source(&self, f: StatsSource) {
        *self.source.locked() = Some(f);
    }

    pub fn snapshot(&self) -> Snapshot {
        let c = &self.counters;
        let mut counters: BTreeMap<String, u64> = c
            .named()
            .map(|(k, v)| (k.to_string(), v.load(Ordering::Relaxed)))
            .collect();
        // These appear once they count something.
        let fallbacks = Fallback::ALL
            .iter()
            .map(|r| (r.name(), &c.fallbacks[r.index()]));
        for (k, v) in std::iter::once(("prepare_ns", &c.prepare_ns))
            .chain(fallbacks)
            .chain(c.hot.named())
            .chain(c.rare.named())
        {
            let n = v.load(Ordering::Relaxed);
            if n > 0 {
                counters.insert(k.to_string(), n);
            }
        }
        let mut poisoned = None;
        if let Some(f) = self.source.locked().as_ref() {
            let (extra, p) = f();
            counters.extend(extra);
            poisoned = p;
        }
        Snapshot {
            agent: self.agent.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            params: self.params.clone(),
            counters,
            poisoned,
        }
    }
}

impl Drop for EngineStats {
    fn drop(&mut self) {
        let mut reg = REGISTRY.locked();
        // Only remove our own entry (a newer engine may reuse the name).
        if reg.get(&self.agent).is_some_and(|w| w.strong_count() == 0) {
            reg.remove(&self.agent);
        }
    }
}

static REGISTRY: LazyLock<Mutex<HashMap<String, Weak<EngineStats>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The snapshot of the engine of `agent` in THIS copy of the library.
pub fn local_snapshot(agent: &str) -> Option<Snapshot> {
    let reg = REGISTRY.locked();
    reg.get(agent).and_then(Weak::upgrade).map(|s| s.snapshot())
}

/// A poisoned bounce arena of this process. Records are kept for the life
/// of the process: the arena's memory is never reused (it is leaked when its
/// engine goes), and the event needs an operator's attention.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoisonedArena {
    /// The engine's agent and the arena's memory location.
    pub arena: String,
    pub reason: String,
}

static POISONED: LazyLock<Mutex<Vec<PoisonedArena>>> = LazyLock::new(|| Mutex::new(Vec::new()));

/// Records that `arena` is poisoned (the runtime calls this once per arena).
pub fn record_poisoned(arena: &str, reason: &str) {
    POISONED.locked().push(PoisonedArena {
        arena: arena.to_string(),
        reason: reason.to_string(),
    });
}

/// Every arena poisoned in THIS copy of the library, oldest first.
pub fn local_poisoned() -> Vec<PoisonedArena> {
    POISONED.locked().clone()
}

/// Every arena poisoned in the plugin NIXL loaded into this process, oldest
/// first (empty: none).
pub fn plugin_poisoned() -> Result<Vec<PoisonedArena>, String> {
    let read = |f: PoisonedFn| {
        let mut buf = vec![0u8; 1024];
        loop {
            // SAFETY: the pointer and length describe a live buffer.
            let n = unsafe { f(buf.as_mut_ptr(), buf.len()) };
            let n = usize::try_from(n).map_err(|_| "nixl_bounce_poisoned failed".to_string())?;
            if n <= buf.len() {
                return serde_json::from_slice(&buf[..n])
                    .map_err(|e| format!("malformed poison report: {e}"));
            }
            buf.resize(n, 0);
        }
    };
    // SAFETY: the plugin's nixl_bounce_poisoned has this signature (declared
    // in src/ffi, the same source as this crate).
    unsafe { with_plugin_symbol::<PoisonedFn, _>(c"nixl_bounce_poisoned", read) }
}

type PoisonedFn = unsafe extern "C" fn(*mut u8, usize) -> isize;

/// The snapshot of `agent`'s BOUNCE engine in the plugin NIXL loaded into this
/// process (`libplugin_BOUNCE.so`).
pub fn plugin_stats(agent: &str) -> Result<Snapshot, String> {
    // SAFETY: the plugin's nixl_bounce_stats has this signature (declared in
    // src/ffi, the same source as this crate).
    unsafe { with_plugin_symbol::<StatsFn, _>(c"nixl_bounce_stats", |f| call_stats(f, agent)) }
}

/// Calls `f` with the function `symbol` of the loaded plugin, holding a
/// handle on the plugin meanwhile.
///
/// # Safety
/// `F` is the symbol's type, a function pointer.
unsafe fn with_plugin_symbol<F: Copy, T>(
    symbol: &std::ffi::CStr,
    f: impl FnOnce(F) -> Result<T, String>,
) -> Result<T, String> {
    let path = crate::nixl_capi::loaded_object_path("libplugin_BOUNCE.so").ok_or(
        "libplugin_BOUNCE.so is not loaded in this process (create a BOUNCE backend first)",
    )?;
    // SAFETY: RTLD_NOLOAD only returns a handle to an already-loaded object
    // (no initialiser runs); dropping it after the call balances the count.
    let lib =
        unsafe { Library::open(Some(&path), libc::RTLD_NOW | libc::RTLD_NOLOAD) }.map_err(|e| {
            format!(
                "cannot open the loaded plugin {}: {}",
                path.display(),
                crate::nixl_capi::loader_error(&e)
            )
        })?;
    // SAFETY: the caller's contract; `Option<F>` of a function pointer is
    // pointer-sized, `None` for a null symbol.
    let sym = unsafe { lib.get::<Option<F>>(symbol) }
        .ok()
        .and_then(|s| *s);
    let sym = sym.ok_or_else(|| {
        format!(
            "{} does not export {}",
            path.display(),
            symbol.to_string_lossy()
        )
    })?;
    f(sym)
}

type StatsFn = unsafe extern "C" fn(*const u8, usize, *mut u8, usize) -> isize;

fn call_stats(f: StatsFn, agent: &str) -> Result<Snapshot, String> {
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: the pointers and lengths describe live buffers.
        let n = unsafe { f(agent.as_ptr(), agent.len(), buf.as_mut_ptr(), buf.len()) };
        if n < 0 {
            return Err(format!(
                "no BOUNCE engine for agent {agent:?} in the loaded plugin"
            ));
        }
        let n = n as usize;
        if n <= buf.len() {
            return serde_json::from_slice(&buf[..n])
                .map_err(|e| format!("malformed stats JSON: {e}"));
        }
        buf.resize(n, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_is_registered_by_name_and_dropped_with_the_engine() {
        let s = EngineStats::new(
            "stats-test-agent",
            BTreeMap::from([("k".into(), "v".into())]),
        );
        EngineStats::bump(&s.counters.transfers_posted);
        let snap = local_snapshot("stats-test-agent").unwrap();
        assert_eq!(snap.counters["transfers_posted"], 1);
        assert_eq!(snap.params["k"], "v");
        let json = serde_json::to_string(&snap).unwrap();
        assert_eq!(serde_json::from_str::<Snapshot>(&json).unwrap(), snap);
        drop(s);
        assert!(local_snapshot("stats-test-agent").is_none());
    }

    #[test]
    fn fallback_reasons_are_counted_by_name_once_they_occur() {
        for (i, r) in Fallback::ALL.iter().enumerate() {
            assert_eq!(r.index(), i, "{r:?} is not at its index in Fallback::ALL");
        }
        let s = EngineStats::new("stats-fallback-agent", BTreeMap::new());
        let before = s.snapshot().counters;
        assert!(!before
            .keys()
            .any(|k| k.starts_with("fallback_") || k == "prepare_ns"));
        s.fell_back(Fallback::TooFewDescriptors);
        s.fell_back(Fallback::TooFewDescriptors);
        s.fell_back(Fallback::Unplannable);
        s.counters.prepare_ns.fetch_add(250, Ordering::Relaxed);
        let c = s.snapshot().counters;
        assert_eq!(c["fallback_too_few_descriptors"], 2);
        assert_eq!(c["fallback_unplannable"], 1);
        assert_eq!(c["prepare_ns"], 250);
        assert!(!c.contains_key("fallback_poisoned"));
    }
}
