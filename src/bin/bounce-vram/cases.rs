//! `bounce-vram test`: every case byte-exact, the path asserted from the counters.

use super::*;

pub(super) fn run_tests(args: &Args) -> bool {
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
pub(super) fn checked_case(
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

/// Eight threads each post a 1024-descriptor WRITE into their own slice of
/// the target buffer at once; the target checks the whole buffer afterwards.
pub(super) fn concurrent(init: &mut Initiator, args: &Args) -> Result<String, String> {
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
