//! `bounce-vram faults`: cancellation at each stage and a killed target.

use super::*;

/// Arena bytes held by anything (flows, staging, orphans, quarantine).
pub(super) fn arena_held(c: &BTreeMap<String, u64>) -> u64 {
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

/// Every arena byte: free, the reserve, standing slots no flow holds
/// (kept for their senders) and what is held.
pub(super) fn arena_total(c: &BTreeMap<String, u64>) -> u64 {
    let get = |k: &str| c.get(k).copied().unwrap_or(0);
    get("arena_free_bytes")
        + get("arena_reserve_bytes")
        + get("arena_standing_bytes")
        + arena_held(c)
}

pub(super) fn since(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>, k: &str) -> u64 {
    let get = |m: &BTreeMap<String, u64>| m.get(k).copied().unwrap_or(0);
    get(after).saturating_sub(get(before))
}

/// Polls `cond` every millisecond up to `bound`; returns how long it took.
pub(super) fn wait_until(
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
pub(super) fn all_arenas(c: &BTreeMap<String, u64>, capacity: u64) -> u64 {
    capacity * c.get("bounce_instances").copied().unwrap_or(1).max(1)
}

/// Both arenas hold nothing and every byte is accounted for; returns how
/// long that took.
pub(super) fn arenas_idle(init: &mut Initiator, capacity: u64) -> Result<Duration, String> {
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
pub(super) const DRILL_N: usize = 16384;
pub(super) const DRILL_SIZE: usize = 4096;

/// A WRITE released (cancelled) once `stage` is reached, the stage held by
/// failpoints (`mine` for this process, `target` for the target's).
pub(super) fn cancel_drill(
    args: &Args,
    stage: &str,
    mine: &str,
    target: &str,
) -> Result<String, String> {
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
            // Credited: granted, or its first chunk in a standing slot.
            "write" => {
                since(&t, &t0, "grants") + since(&t, &t0, "bounce_standing_taken") > 0
                    && since(&b, &b0, "gather_ns") > 0
            }
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
pub(super) fn killed_target_drill(args: &Args) -> Result<String, String> {
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
    init.target.kill();
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
pub(super) fn terminal(a: &Agent, req: &XferRequest) -> Result<&'static str, String> {
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
pub(super) fn peer_killed_target_drill(args: &Args) -> Result<String, String> {
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
    init.target.kill();
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

pub(super) fn run_faults(args: &Args) -> bool {
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
