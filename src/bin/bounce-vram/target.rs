//! The target process (`serve`) and the initiator's handle on it.

use super::*;

pub(super) fn serve(args: &Args) {
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
                match nixl_bounce::copy::ipc::export_allocation(args.target_device, buf.base()) {
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

pub(super) struct Target {
    pub(super) child: Child,
    pub(super) stdin: ChildStdin,
    pub(super) lines: std::io::Lines<BufReader<ChildStdout>>,
    pub(super) name: String,
    pub(super) base: usize,
    pub(super) metadata: Vec<u8>,
}

impl Target {
    /// Starts the target process with `failpoints` (`NIXL_BOUNCE_FAILPOINTS`).
    pub(super) fn spawn(args: &Args, failpoints: &str) -> Result<Target, String> {
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

    pub(super) fn reply(&mut self) -> Result<String, String> {
        for line in self.lines.by_ref() {
            let line = line.map_err(|e| e.to_string())?;
            if let Some(rest) = line.strip_prefix(TAG) {
                return Ok(rest.to_string());
            }
        }
        Err("the target exited".into())
    }

    pub(super) fn cmd(&mut self, line: &str) -> Result<String, String> {
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
