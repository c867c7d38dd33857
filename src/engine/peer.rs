//! The peer-mapped path in the engine: which VRAM regions are exported for
//! mapping, which remote regions can be mapped, and the routing rule that
//! sends a transfer through one kernel instead of the bounce arena.
//!
//! A transfer takes this path when both engines run on one host (same boot
//! id), every descriptor is VRAM on both sides, the local descriptors lie on
//! one GPU, every remote descriptor lies in an allocation the peer exported
//! and this process could map, and the routing gates of the bounce path
//! (descriptor count, average size) pass. Anything else takes the bounce
//! path or UCX, exactly as before. See docs/design.md §3.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use nixl_sys::Agent;

use super::bounce::{peer_map_gate, Fallback};
use super::conn_info::PeerExport;
use super::{MemKind, Op, Shape};
use crate::config::Config;
use crate::copy::peer::{self, Identity, PeerCopier, PeerCopy, PeerLaunch, PeerMapping};
use crate::proto::Run;

/// Streams per device for peer-mapped copies.
const STREAMS_PER_DEVICE: usize = 4;

/// Why a transfer does not take the peer-mapped path (before any mapping is
/// looked at).
pub fn gate(cfg: &Config, g: &Shape) -> Result<(), &'static str> {
    if !cfg.enabled || !cfg.enable_peer_map {
        return Err("peer mapping disabled");
    }
    if g.local_transfer {
        return Err("a transfer within one agent");
    }
    if g.local != MemKind::Vram || g.remote != MemKind::Vram {
        return Err("not VRAM on both sides");
    }
    peer_map_gate(cfg)
        .admit(g.descriptors, g.bytes)
        .map_err(|f| match f {
            Fallback::TooFewDescriptors => "too few descriptors",
            _ => "descriptors too large",
        })
}

/// A peer's exported allocation, shared by every loaded region in it; holds
/// this process's mappings of it (one per local GPU that copies to or from
/// it). Dropped, with its mappings, when the last such region is unloaded.
#[derive(Debug)]
pub struct RemoteAlloc {
    pub export: PeerExport,
    same_process: bool,
    mappings: Mutex<HashMap<usize, Result<Arc<PeerMapping>, String>>>,
}

impl RemoteAlloc {
    /// The mapping for copies on `copier`'s device, opened at first use (a
    /// failure is remembered and not retried for this allocation).
    fn mapping(&self, copier: &Arc<PeerCopier>) -> Result<Arc<PeerMapping>, String> {
        let dev = copier.device().ordinal();
        let mut map = self.mappings.lock().expect("mappings lock");
        map.entry(dev)
            .or_insert_with(|| {
                let e = &self.export;
                PeerMapping::open(
                    copier,
                    &e.device_uuid,
                    e.alloc_base,
                    e.alloc_len,
                    &e.ipc_handle,
                    self.same_process,
                )
                .map(Arc::new)
            })
            .clone()
    }
}

/// A transfer on the peer-mapped path, made when the request is prepared.
pub struct PeerXfer {
    pub table: peer::PeerTable,
    /// The mappings the table's addresses point into: open while the request
    /// lives (and, once it is gone, until its last copy ended: see
    /// `PeerMapping`'s drop).
    pub mappings: Vec<Arc<PeerMapping>>,
    pub launch: Option<Arc<PeerLaunch>>,
    /// How long the posted copy may run before its request fails (the
    /// transfer's deadline, else the configured deadline or timeout).
    pub limit: Duration,
    pub reported: bool,
    pub peer_inner: String,
}

/// The engine's peer-mapping state.
pub struct PeerMaps {
    identity: Option<Identity>,
    copiers: Mutex<HashMap<usize, Result<Arc<PeerCopier>, String>>>,
    allocs: Mutex<HashMap<PeerExport, Weak<RemoteAlloc>>>,
    notifier: Mutex<Option<Notifier>>,
    /// The run list a preparation builds, kept between preparations (its
    /// megabytes would otherwise be page-faulted in anew every time); one
    /// that finds it in use builds its own.
    runs: Mutex<Vec<Run>>,
}

impl std::fmt::Debug for PeerMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerMaps")
            .field("identity", &self.identity.is_some())
            .finish_non_exhaustive()
    }
}

impl PeerMaps {
    pub fn new(cfg: &Config) -> Self {
        let identity = if cfg.enabled && cfg.enable_peer_map {
            peer::identity()
        } else {
            None
        };
        PeerMaps {
            identity,
            copiers: Mutex::new(HashMap::new()),
            allocs: Mutex::new(HashMap::new()),
            notifier: Mutex::new(None),
            runs: Mutex::new(Vec::new()),
        }
    }

    /// What to publish for a VRAM region registered on `device` at `addr`
    /// (`len` bytes), if it can be mapped by peers. Errors are the reason
    /// it cannot (logged by the caller, not fatal).
    pub fn export(&self, device: u64, addr: u64, len: u64) -> Result<PeerExport, String> {
        let id = self
            .identity
            .ok_or("peer mapping is off, or this host cannot be identified")?;
        let (alloc_base, alloc_len, ipc_handle, device_uuid) =
            peer::export_allocation(device as usize, addr)?;
        let export = PeerExport {
            host: id.host,
            process: id.process,
            device_uuid,
            alloc_base,
            alloc_len,
            ipc_handle,
        };
        if !export.covers(addr, len) {
            return Err(format!(
                "the region ({len} bytes at {addr:#x}) does not lie inside one allocation"
            ));
        }
        Ok(export)
    }

    /// The shared handle of a peer's exported allocation holding the region
    /// `[addr, addr + len)`, when it can be used from here: the peer is on
    /// this host and the region lies inside the allocation. `None` means
    /// the region is served by the bounce path or UCX.
    pub fn remote(&self, export: &PeerExport, addr: u64, len: u64) -> Option<Arc<RemoteAlloc>> {
        let id = self.identity?;
        if export.host != id.host {
            return None;
        }
        if !export.covers(addr, len) {
            tracing::warn!(
                addr,
                len,
                "a peer's region lies outside the allocation it exported; not mapped"
            );
            return None;
        }
        let mut allocs = self.allocs.lock().expect("allocs lock");
        allocs.retain(|_, w| w.strong_count() > 0);
        if let Some(a) = allocs.get(export).and_then(Weak::upgrade) {
            return Some(a);
        }
        let a = Arc::new(RemoteAlloc {
            export: *export,
            same_process: export.process == id.process,
            mappings: Mutex::new(HashMap::new()),
        });
        allocs.insert(*export, Arc::downgrade(&a));
        Some(a)
    }

    fn copier(&self, device: usize) -> Result<Arc<PeerCopier>, String> {
        let mut map = self.copiers.lock().expect("copiers lock");
        map.entry(device)
            .or_insert_with(|| PeerCopier::for_device(device, STREAMS_PER_DEVICE))
            .clone()
    }

    /// Plans a peer-mapped transfer of `n` descriptors: `pairs` yields, per
    /// descriptor, (local address, remote address, length, the remote
    /// region's allocation), the local ones on `device`, or `Err` naming why
    /// that descriptor cannot take this path. Err: why the transfer cannot.
    pub fn prepare<'a>(
        &self,
        op: Op,
        device: usize,
        n: usize,
        uniform_len: Option<u64>,
        pairs: impl Iterator<Item = Result<(u64, u64, u64, &'a Arc<RemoteAlloc>), &'static str>>,
        peer_inner: String,
    ) -> Result<PeerXfer, String> {
        let started = std::time::Instant::now();
        let copier = self.copier(device)?;
        let mut mappings: Vec<Arc<PeerMapping>> = Vec::new();
        let mut last: Option<(*const RemoteAlloc, Arc<PeerMapping>)> = None;
        // Each pair as this process's (source, destination) of one copy.
        let copies = pairs.map(|pair| -> Result<PeerCopy, String> {
            let (local, remote, len, alloc) = pair?;
            // Consecutive descriptors usually share an allocation: no
            // look-up and no reference count per descriptor then.
            if !matches!(&last, Some((p, _)) if std::ptr::eq(*p, Arc::as_ptr(alloc))) {
                let m = alloc.mapping(&copier)?;
                if !mappings.iter().any(|x| Arc::ptr_eq(x, &m)) {
                    mappings.push(m.clone());
                }
                last = Some((Arc::as_ptr(alloc), m));
            }
            let mapping = &last.as_ref().expect("set above").1;
            let mapped = remote
                .checked_sub(alloc.export.alloc_base)
                .and_then(|offset| mapping.address(offset, len))
                .ok_or_else(|| {
                    format!("remote descriptor ({len} bytes at {remote:#x}) lies outside the peer's allocation")
                })?;
            Ok(match op {
                Op::Write => PeerCopy {
                    src: local,
                    dst: mapped,
                    len,
                },
                Op::Read => PeerCopy {
                    src: mapped,
                    dst: local,
                    len,
                },
            })
        });
        let table = match uniform_len {
            // Every copy of one size (real clients' blocks): written straight
            // into the table.
            Some(len) => copier.prepare_uniform(
                n,
                len,
                copies.map(|c| c.map(|c| (c.src, c.dst))),
                started,
            )?,
            None => {
                let mut kept = self.runs.try_lock().ok();
                let mut own = Vec::new();
                let runs: &mut Vec<Run> = match kept.as_deref_mut() {
                    Some(v) => v,
                    None => &mut own,
                };
                runs.clear();
                runs.reserve(n);
                for c in copies {
                    peer::push_copy(runs, c?);
                }
                copier.prepare(runs, started)?
            }
        };
        Ok(PeerXfer {
            table,
            mappings,
            launch: None,
            limit: Duration::MAX,
            reported: false,
            peer_inner,
        })
    }

    /// The way to send notifications of peer-mapped transfers (the
    /// engine's notifier thread, started at the first use).
    pub fn notifier(&self, inner: &Agent) -> Result<Notify, String> {
        let mut slot = self.notifier.lock().expect("notifier lock");
        if slot.is_none() {
            *slot = Some(Notifier::start(inner.clone())?);
        }
        let n = slot.as_ref().expect("started above");
        Ok(Notify(n.tx.clone()))
    }
}

/// Queues notifications for the notifier thread.
pub struct Notify(mpsc::Sender<Pending>);

impl Notify {
    /// Sends `message` to `peer_inner` once `launch` ended, unless the
    /// request was released or failed first. A thread of the engine does
    /// it, so the notification leaves even if the application never polls
    /// the request.
    pub fn after(
        self,
        launch: Arc<PeerLaunch>,
        limit: Duration,
        peer_inner: String,
        message: Vec<u8>,
    ) {
        // The thread ends only with the engine, after every sender is gone.
        let _ = self.0.send(Pending {
            launch,
            limit,
            peer_inner,
            message,
        });
    }
}

impl Drop for PeerMaps {
    fn drop(&mut self) {
        if let Some(n) = self.notifier.get_mut().ok().and_then(Option::take) {
            n.stop();
        }
    }
}

struct Pending {
    launch: Arc<PeerLaunch>,
    /// After this long the copy counts as failed (see `PeerLaunch::expire`),
    /// so a copy that never ends cannot hold the thread (or the engine's
    /// teardown, which waits for it) longer.
    limit: Duration,
    peer_inner: String,
    message: Vec<u8>,
}

/// The thread that sends notifications of peer-mapped transfers after their
/// copies ended, in posting order.
struct Notifier {
    tx: mpsc::Sender<Pending>,
    thread: JoinHandle<()>,
    /// Set when the engine goes: copies still running get at most
    /// [`STOP_GRACE`] more before their notifications are given up.
    stopping: Arc<AtomicBool>,
}

/// How long a stopping notifier still waits for a copy to end.
const STOP_GRACE: Duration = Duration::from_secs(1);

impl Notifier {
    fn start(inner: Agent) -> Result<Self, String> {
        let (tx, rx) = mpsc::channel::<Pending>();
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let thread = std::thread::Builder::new()
            .name("bounce-peer-notify".into())
            .spawn(move || {
                // When the engine began stopping: from then on, at most
                // STOP_GRACE in all for the copies still queued.
                let mut stop_seen: Option<std::time::Instant> = None;
                for p in rx {
                    let ended = loop {
                        if p.launch.cancelled.load(Ordering::SeqCst) {
                            break Err("released".to_string());
                        }
                        p.launch.expire(p.limit);
                        if let Some(r) = p.launch.poll() {
                            break r;
                        }
                        if stop.load(Ordering::SeqCst) {
                            let since = *stop_seen.get_or_insert_with(std::time::Instant::now);
                            if since.elapsed() > STOP_GRACE {
                                break Err("the engine stopped before the copy ended".into());
                            }
                        }
                        std::thread::sleep(Duration::from_micros(20));
                    };
                    if let Err(e) = ended {
                        if !p.launch.cancelled.load(Ordering::SeqCst) {
                            tracing::warn!("no notification for a peer-mapped copy: {e}");
                        }
                        continue;
                    }
                    if p.launch.cancelled.load(Ordering::SeqCst) {
                        continue;
                    }
                    if let Err(e) = inner.send_notification(&p.peer_inner, &p.message, None) {
                        tracing::warn!(peer = %p.peer_inner, "sending a peer-mapped transfer's notification: {e}");
                    }
                }
            })
            .map_err(|e| format!("starting the peer-map notifier: {e}"))?;
        Ok(Notifier {
            tx,
            thread,
            stopping,
        })
    }

    /// Sends what is queued (each after its copy, waiting at most
    /// [`STOP_GRACE`] more per copy) and ends the thread.
    fn stop(self) {
        self.stopping.store(true, Ordering::SeqCst);
        drop(self.tx);
        let _ = self.thread.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> Shape {
        Shape {
            local: MemKind::Vram,
            remote: MemKind::Vram,
            descriptors: 4096,
            bytes: 4096 * 4096,
            local_transfer: false,
        }
    }

    #[test]
    fn vram_transfers_with_many_small_descriptors_pass() {
        assert_eq!(gate(&Config::default(), &input()), Ok(()));
        // One large descriptor too: the kernel tiles it over every warp.
        let one = Shape {
            descriptors: 1,
            bytes: 1 << 30,
            ..input()
        };
        assert_eq!(gate(&Config::default(), &one), Ok(()));
    }

    #[test]
    fn each_gate_says_why() {
        // The default gate admits every count and size; these limits are set
        // to see each reason.
        let cfg = Config {
            peer_map_min_descriptor_count: 1024,
            peer_map_max_average_descriptor_size_bytes: 16 << 10,
            ..Config::default()
        };
        let off = Config {
            enable_peer_map: false,
            ..Config::default()
        };
        assert_eq!(gate(&off, &input()), Err("peer mapping disabled"));
        let master_off = Config {
            enabled: false,
            ..Config::default()
        };
        assert_eq!(gate(&master_off, &input()), Err("peer mapping disabled"));
        for (g, why) in [
            (
                Shape {
                    local_transfer: true,
                    ..input()
                },
                "a transfer within one agent",
            ),
            (
                Shape {
                    local: MemKind::Dram,
                    ..input()
                },
                "not VRAM on both sides",
            ),
            (
                Shape {
                    remote: MemKind::Dram,
                    ..input()
                },
                "not VRAM on both sides",
            ),
            (
                Shape {
                    descriptors: 10,
                    bytes: 40960,
                    ..input()
                },
                "too few descriptors",
            ),
            (
                Shape {
                    bytes: 4096 * (1 << 20),
                    ..input()
                },
                "descriptors too large",
            ),
        ] {
            assert_eq!(gate(&cfg, &g), Err(why));
        }
    }

    #[test]
    fn remote_regions_of_other_hosts_or_outside_the_allocation_are_not_mapped() {
        let maps = PeerMaps::new(&Config::default());
        let id = peer::identity().expect("boot id");
        let export = PeerExport {
            host: id.host,
            process: [9; 16],
            device_uuid: [1; 16],
            alloc_base: 1 << 40,
            alloc_len: 1 << 30,
            ipc_handle: [0; 64],
        };
        let a = maps.remote(&export, 1 << 40, 4096).expect("same host");
        let b = maps
            .remote(&export, (1 << 40) + 8192, 4096)
            .expect("same host");
        assert!(Arc::ptr_eq(&a, &b), "one handle per allocation");
        assert!(!a.same_process);
        assert!(maps.remote(&export, (1 << 40) + (1 << 30), 1).is_none());
        let other_host = PeerExport {
            host: [0xee; 16],
            ..export
        };
        assert!(maps.remote(&other_host, 1 << 40, 4096).is_none());
        let mine = PeerExport {
            process: id.process,
            ..export
        };
        assert!(maps.remote(&mine, 1 << 40, 4096).unwrap().same_process);
        drop((a, b));
        // The last region gone, the allocation is forgotten.
        assert!(maps.remote(&export, 1 << 40, 4096).is_some());
        assert_eq!(maps.allocs.lock().unwrap().len(), 1);
    }

    #[test]
    fn nothing_is_exported_when_peer_mapping_is_off() {
        let maps = PeerMaps::new(&Config {
            enable_peer_map: false,
            ..Config::default()
        });
        assert!(maps.export(0, 4096, 4096).unwrap_err().contains("off"));
        let id = peer::identity().expect("boot id");
        let export = PeerExport {
            host: id.host,
            process: id.process,
            device_uuid: [1; 16],
            alloc_base: 4096,
            alloc_len: 4096,
            ipc_handle: [0; 64],
        };
        assert!(maps.remote(&export, 4096, 4096).is_none());
    }
}
