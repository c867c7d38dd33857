//! The initiator: its agent, its VRAM, and the cases it runs.

use super::*;

/// Fields drop in order: the registration (deregisters), the agent (its
/// engine and IO thread stop), the target process, and only then the buffer.
pub(super) struct Initiator {
    pub(super) _registration: RegistrationHandle,
    pub(super) agent: Agent,
    pub(super) target: Target,
    pub(super) name: String,
    pub(super) buf: DeviceArena,
    pub(super) dev: u64,
    pub(super) target_name: String,
}

pub(super) const FAILPOINTS: &str = "NIXL_BOUNCE_FAILPOINTS";

impl Initiator {
    pub(super) fn new(args: &Args) -> Result<Initiator, String> {
        Self::with_failpoints(args, "", "")
    }

    /// With failpoints for this process's engine and for the target's.
    pub(super) fn with_failpoints(
        args: &Args,
        mine: &str,
        target: &str,
    ) -> Result<Initiator, String> {
        let cuda = CudaRuntime::probe()?;
        let dev = cuda.device(args.device)?;
        let buf = DeviceArena::new(&dev, args.buffer)?;
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let name = format!(
            "vram-init-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        // Read once, when the engine is created.
        std::env::set_var(FAILPOINTS, mine);
        let agent = agent(&name, &args.backend, &args.params);
        std::env::remove_var(FAILPOINTS);
        let agent = agent?;
        let registration = agent
            .register_memory(&buf, None)
            .map_err(|e| format!("register: {e}"))?;
        let target = Target::spawn(args, target)?;
        let loaded = agent
            .load_remote_md(&target.metadata)
            .map_err(|e| format!("loading the target's metadata: {e}"))?;
        if loaded != target.name {
            return Err(format!("loaded {loaded:?}, expected {:?}", target.name));
        }
        Ok(Initiator {
            _registration: registration,
            agent,
            name,
            dev: args.device as u64,
            buf,
            target_name: loaded,
            target,
        })
    }

    pub(super) fn request(&self, plan: &Plan, notif: Option<&[u8]>) -> Result<XferRequest, String> {
        self.request_op(XferOp::Write, plan, notif)
    }

    /// A WRITE of `plan` from this buffer into the target's, or a READ of it
    /// from the target's buffer (moves: source offset, destination offset).
    pub(super) fn request_op(
        &self,
        op: XferOp,
        plan: &Plan,
        notif: Option<&[u8]>,
    ) -> Result<XferRequest, String> {
        type Spans = Vec<(usize, usize)>; // (offset, length)
        let (local, remote): (Spans, Spans) = match op {
            XferOp::Write => plan.moves.iter().map(|&(s, d, l)| ((s, l), (d, l))).unzip(),
            XferOp::Read => plan.moves.iter().map(|&(s, d, l)| ((d, l), (s, l))).unzip(),
        };
        let l = xfer_list(self.buf.base() as usize, self.dev, local.into_iter());
        let r = xfer_list(self.target.base, self.target_device(), remote.into_iter());
        let mut opt = OptArgs::new().map_err(|e| e.to_string())?;
        if let Some(m) = notif {
            opt.set_has_notification(true).map_err(|e| e.to_string())?;
            opt.set_notification_message(m).map_err(|e| e.to_string())?;
        }
        self.agent
            .create_xfer_req(op, &l, &r, &self.target_name, Some(&opt))
            .map_err(|e| {
                format!(
                    "create_xfer_req ({op:?}, {} descriptors): {e}",
                    plan.moves.len()
                )
            })
    }

    pub(super) fn target_device(&self) -> u64 {
        TARGET_DEVICE.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One verified WRITE; returns its duration.
    pub(super) fn checked_write(
        &mut self,
        n: usize,
        size: usize,
        seed: u64,
        mixed: bool,
        args: &Args,
    ) -> Result<Duration, String> {
        let slots = args.buffer / size;
        let p = plan(n, size, slots, 0, seed, mixed);
        let (sseed, dseed) = (seed * 2 + 1, seed * 2 + 2);
        let n = p.moves.len();
        self.buf.write(0, &pattern(args.buffer, sseed))?;
        self.target.cmd(&format!("FILL {dseed}"))?;
        let req = self.request(&p, None)?;
        let dt = post_and_wait(&self.agent, &req)?;
        drop(req);
        self.target.cmd(&format!(
            "CHECK 1 {n} {size} {slots} {seed} {sseed} {dseed} {}",
            u8::from(mixed)
        ))?;
        Ok(dt)
    }
}

impl Initiator {
    /// One verified READ of the target's VRAM into this process's; returns
    /// its duration.
    pub(super) fn checked_read(
        &mut self,
        n: usize,
        size: usize,
        seed: u64,
        mixed: bool,
        args: &Args,
    ) -> Result<Duration, String> {
        let slots = args.buffer / size;
        let p = plan(n, size, slots, 0, seed, mixed);
        let (sseed, dseed) = (seed * 2 + 1, seed * 2 + 2);
        self.target.cmd(&format!("FILL {sseed}"))?;
        self.buf.write(0, &pattern(args.buffer, dseed))?;
        let req = self.request_op(XferOp::Read, &p, None)?;
        let dt = post_and_wait(&self.agent, &req)?;
        drop(req);
        let want = expected(args.buffer, std::slice::from_ref(&p), sseed, dseed);
        let mut got = vec![0u8; args.buffer];
        self.buf.read(0, &mut got)?;
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            return Err(format!(
                "READ destination: first wrong byte at offset {i}: {} != {}",
                got[i], want[i]
            ));
        }
        // The source is unchanged (no plan: the pattern itself).
        self.target
            .cmd(&format!("CHECK 0 0 {size} {slots} 0 0 {sseed} 0"))?;
        Ok(dt)
    }
}

pub(super) static TARGET_DEVICE: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);
