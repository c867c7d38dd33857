//! Helpers of the fault tests (`support::faults`): failpoints for one agent,
//! the arena gauges of the stats, bounded waits that measure, and the check
//! that no byte outside a transfer's destinations changed.
#![allow(dead_code)]

use super::bounce::*;
use super::*;
use std::time::{Duration, Instant};

/// Creates something (an agent) with `NIXL_BOUNCE_FAILPOINTS=spec`; the
/// variable is read when an engine is created, so only that one injects.
/// Tests using it must be `#[serial]`.
pub fn with_failpoints<T>(spec: &str, f: impl FnOnce() -> T) -> T {
    std::env::set_var("NIXL_BOUNCE_FAILPOINTS", spec);
    let r = f();
    std::env::remove_var("NIXL_BOUNCE_FAILPOINTS");
    r
}

/// Arena bytes held by anything (remote flows, local staging, orphans,
/// quarantine); the idle reserve and free space excluded.
pub fn arena_held(c: &Counters) -> u64 {
    [
        "arena_flow_bytes",
        "arena_local_bytes",
        "arena_orphan_bytes",
        "arena_quarantine_bytes",
    ]
    .iter()
    .map(|k| c.get(k))
    .sum()
}

/// Every arena byte is somewhere: free + reserve + standing slots (kept
/// for their senders) + held = capacity.
#[track_caller]
pub fn assert_arena_conserved(c: &Counters, capacity: u64) {
    let total = c.get("arena_free_bytes")
        + c.get("arena_reserve_bytes")
        + c.get("arena_standing_bytes")
        + arena_held(c);
    assert_eq!(
        total, capacity,
        "{}: arena bytes not conserved: {:?}",
        c.agent, c.map
    );
}

/// Waits until `cond` holds, up to `bound`; returns how long it took.
/// Past the bound it panics with `what()`.
#[track_caller]
pub fn wait_for(
    bound: Duration,
    what: impl Fn() -> String,
    mut cond: impl FnMut() -> bool,
) -> Duration {
    let t0 = Instant::now();
    loop {
        if cond() {
            return t0.elapsed();
        }
        if t0.elapsed() > bound {
            panic!("not within {bound:?}: {}", what());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits until the agent's arena holds nothing (everything free, reserve
/// or a standing slot no flow holds) and checks conservation. Returns how long it took.
#[track_caller]
pub fn wait_arena_idle(agent: &str, capacity: u64, bound: Duration) -> Duration {
    wait_idle_of(agent, capacity, bound, || stats(agent))
}

/// [`wait_arena_idle`] for counters read by `read` (a peer process's
/// `STATS`, say); `what` names the arena in the failure.
#[track_caller]
pub fn wait_idle_of(
    what: &str,
    capacity: u64,
    bound: Duration,
    mut read: impl FnMut() -> Counters,
) -> Duration {
    let t0 = Instant::now();
    loop {
        let last = read();
        if arena_held(&last) == 0 {
            assert_arena_conserved(&last, capacity);
            return t0.elapsed();
        }
        if t0.elapsed() > bound {
            panic!(
                "not within {bound:?}: {what}'s arena still holds bytes: {:?}",
                last.map
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Every byte outside `plan`'s destination blocks is as in `before`.
pub fn outside_destinations_unchanged(
    after: &[u8],
    before: &[u8],
    plan: &Plan,
) -> Result<(), String> {
    let mut inside = vec![false; after.len()];
    for d in &plan.dst {
        inside[*d..*d + plan.block]
            .iter_mut()
            .for_each(|b| *b = true);
    }
    match (0..after.len()).find(|&i| !inside[i] && after[i] != before[i]) {
        None => Ok(()),
        Some(i) => Err(format!(
            "byte {i} outside every destination changed: {:#04x} -> {:#04x}",
            before[i], after[i]
        )),
    }
}

/// Polls `req` until it is terminal or `bound` passes (then panics);
/// returns the outcome and how long it took.
#[track_caller]
pub fn terminal_within(
    node: &Node,
    req: &nixl_sys::XferRequest,
    bound: Duration,
    what: &str,
) -> (Result<(), String>, Duration) {
    let t0 = Instant::now();
    let mut spins = 0u64;
    loop {
        match poll(node, req) {
            Ok(true) => return (Ok(()), t0.elapsed()),
            Ok(false) => {}
            Err(e) => return (Err(e), t0.elapsed()),
        }
        check_deadline(t0, bound, &|| format!("{what}: still running"));
        pause(&mut spins);
    }
}
