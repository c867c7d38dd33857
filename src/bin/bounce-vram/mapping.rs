//! `bounce-vram mapping`: what a CUDA IPC mapping of the peer's memory allows.

use super::*;

//
// What a CUDA IPC mapping of another process's VRAM allows (issue 16): no
// NIXL transfer, only this process's copies between two local buffers and
// through the mapping of the target's buffer, each timed against the same
// copy between the two local buffers.

/// One measured (case, direction) of `mapping`.
#[derive(serde::Serialize)]
pub(super) struct MapRow {
    /// `memcpy` (one cuMemcpyDtoDAsync), `kernel` (the pair kernel, its
    /// table as the engine would make it), or `kernel-upload` /
    /// `kernel-inline` (the table uploaded / the launch's parameter).
    pub(super) method: &'static str,
    pub(super) descriptors: usize,
    pub(super) size: usize,
    /// `local->local`, `local->peer` (writes the target's buffer through
    /// the mapping) or `peer->local` (reads it).
    pub(super) direction: &'static str,
    pub(super) iterations: usize,
    /// What p10/p50/p90 measure: `cuda-events` around the memcpy on its
    /// stream, or `wall` (host time from the launch call to the completion
    /// seen by polling).
    pub(super) timer: &'static str,
    pub(super) p10_us: f64,
    pub(super) p50_us: f64,
    pub(super) p90_us: f64,
    /// Bytes moved per second at p50.
    pub(super) gbps: f64,
    /// Host wall time from the call to the completion seen (both methods).
    pub(super) wall_p50_us: f64,
    /// The table's preparation (`prepare_pairs`), p50 over the runs: the
    /// table-form rows only.
    pub(super) prepare_p50_us: Option<f64>,
}

pub(super) const MAP_WARMUPS: usize = 3;
pub(super) const MIB: usize = 1 << 20;

/// Two buffers of this process and the target's through the mapping, each
/// `len` bytes, and the host patterns every check loads as source and
/// destination. Fields drop in order: the mapping (waits for the copies
/// through it) before the copier's last reference, the events and stream
/// before the buffers.
pub(super) struct Probe {
    pub(super) mapping: Arc<IpcMapping>,
    pub(super) copier: Arc<IpcCopier>,
    pub(super) start: CudaEvent,
    pub(super) end: CudaEvent,
    pub(super) stream: Arc<CudaStream>,
    pub(super) a: DeviceArena,
    pub(super) b: DeviceArena,
    /// This process's address of the target's buffer.
    pub(super) peer: u64,
    pub(super) len: usize,
    pub(super) dev: Arc<CudaDevice>,
    pub(super) src_host: Vec<u8>,
    pub(super) dst_host: Vec<u8>,
}

impl Probe {
    /// (name, source, destination) of the three directions.
    pub(super) fn directions(&self) -> [(&'static str, u64, u64); 3] {
        [
            ("local->local", self.a.base(), self.b.base()),
            ("local->peer", self.a.base(), self.peer),
            ("peer->local", self.peer, self.b.base()),
        ]
    }

    /// The mappings a copy between `src` and `dst` goes through.
    pub(super) fn maps(&self, src: u64, dst: u64) -> &[Arc<IpcMapping>] {
        if src == self.peer || dst == self.peer {
            std::slice::from_ref(&self.mapping)
        } else {
            &[]
        }
    }

    /// `len` bytes from the start of one of the three buffers.
    pub(super) fn check_span(&self, addr: u64, len: usize) -> Result<(), String> {
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
    pub(super) fn upload(&self, addr: u64, data: &[u8]) -> Result<(), String> {
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

    pub(super) fn download(&self, addr: u64, out: &mut [u8]) -> Result<(), String> {
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
    pub(super) fn verify(
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
    pub(super) fn memcpy(&self, src: u64, dst: u64, len: usize) -> Result<(f64, f64), String> {
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
    pub(super) fn table(
        &self,
        moves: &[(usize, usize, usize)],
        size: usize,
        src: u64,
        dst: u64,
    ) -> Result<IpcTable, String> {
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
    pub(super) fn case(
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
pub(super) fn launch_and_wait(
    table: &mut IpcTable,
    maps: &[Arc<IpcMapping>],
) -> Result<(f64, f64), String> {
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

pub(super) fn human(bytes: usize) -> String {
    nixl_bounce::config::format_bytes(bytes as u64)
}

pub(super) fn run_mapping(args: &Args) -> bool {
    if let Err(e) = mapping_probe(args) {
        die(format!("mapping: {e}"));
    }
    true
}

pub(super) fn mapping_probe(args: &Args) -> Result<(), String> {
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
    let copier = IpcCopier::for_device(args.device, 1)?;
    let mapping = Arc::new(IpcMapping::open(
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
