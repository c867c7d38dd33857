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
    child::reply(&format!("MD {} {} {}", name, buf.base(), hex(&md)));
    let num = |s: &str| {
        s.parse::<usize>()
            .map_err(|_| format!("{s:?} is not a number"))
    };
    let plans_of = |w: &[&str]| -> Result<Vec<Plan>, String> {
        let [parts, n, size, slots, pseed] = [w[0], w[1], w[2], w[3], w[4]].map(num);
        Ok(plans(parts?, n?, size?, slots?, pseed? as u64, w[5] == "1"))
    };
    let read_all = || -> Result<Vec<u8>, String> {
        let mut got = vec![0u8; args.buffer];
        buf.read(0, &mut got)
            .map(|()| got)
            .map_err(|e| e.to_string())
    };
    child::serve(|w| match w {
        ["FILL", seed] => buf
            .write(0, &pattern(args.buffer, num(seed)? as u64))
            .map(|()| String::new())
            .map_err(|e| e.to_string()),
        ["CHECK", parts, n, size, slots, pseed, sseed, dseed, mixed] => {
            let ps = plans_of(&[parts, n, size, slots, pseed, mixed])?;
            let want = expected(args.buffer, &ps, num(sseed)? as u64, num(dseed)? as u64);
            let got = read_all()?;
            match got.iter().zip(&want).position(|(a, b)| a != b) {
                None => Ok(String::new()),
                Some(i) => Err(format!(
                    "first wrong byte at offset {i}: {} != {}",
                    got[i], want[i]
                )),
            }
        }
        ["CHECK_OUTSIDE", parts, n, size, slots, pseed, dseed, mixed] => {
            let ps = plans_of(&[parts, n, size, slots, pseed, mixed])?;
            let got = read_all()?;
            // The fill everywhere, except what the destinations now hold
            // (unspecified after a failed request).
            let mut want = pattern(args.buffer, num(dseed)? as u64);
            for plan in &ps {
                for &(_, d, l) in &plan.moves {
                    want[d..d + l].copy_from_slice(&got[d..d + l]);
                }
            }
            match got.iter().zip(&want).position(|(a, b)| a != b) {
                None => Ok(String::new()),
                Some(i) => Err(format!(
                    "byte {i} outside every destination changed: {} != {}",
                    got[i], want[i]
                )),
            }
        }
        // The IPC export of the allocation holding the buffer (`mapping`):
        // base, length, handle, GPU UUID, buffer base.
        ["IPC"] => nixl_bounce::copy::ipc::export_allocation(args.target_device, buf.base())
            .map(|(base, len, handle, uuid)| {
                format!(
                    "{base} {len} {} {} {}",
                    hex(&handle),
                    hex(&uuid),
                    buf.base()
                )
            })
            .map_err(|e| format!("exporting the target buffer: {e}")),
        ["STATS"] => Ok(serde_json::to_string(&plugin_counters(&name)).unwrap_or_default()),
        _ => Err(format!("unknown command {:?}", w.join(" "))),
    });
}

/// The initiator's handle on the target process.
pub(super) struct Target {
    /// `None` once killed.
    peer: Option<ChildPeer>,
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
            .env(FAILPOINTS, failpoints);
        let (peer, first) = ChildPeer::spawn("target", cmd, 2 * TIMEOUT)?;
        let w: Vec<&str> = first.split_whitespace().collect();
        let ["MD", name, base, md] = w[..] else {
            return Err(format!("unexpected first line from the target: {first:?}"));
        };
        Ok(Target {
            peer: Some(peer),
            name: name.to_string(),
            base: base
                .parse()
                .map_err(|_| "bad base address from the target".to_string())?,
            metadata: unhex(md),
        })
    }

    /// Sends a command; the text of its `OK` reply.
    pub(super) fn cmd(&mut self, line: &str) -> Result<String, String> {
        self.peer
            .as_mut()
            .ok_or("the target was killed")?
            .call(line)
    }

    /// Kills the target process (SIGKILL) and reaps it.
    pub(super) fn kill(&mut self) {
        if let Some(peer) = self.peer.take() {
            peer.kill();
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // QUIT, so that its agent ends (and writes its NIXL_BOUNCE_TRACE
        // timeline); killed after 10 s.
        if let Some(peer) = self.peer.take() {
            let _ = peer.quit(Duration::from_secs(10));
        }
    }
}
