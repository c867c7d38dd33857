//! NIXL plumbing: agents, transfer lists, posting and waiting, the plugin's counters.

use super::*;

pub(super) fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("bounce-vram: {msg}");
    std::process::exit(1)
}

pub(super) fn agent(
    name: &str,
    backend: &str,
    params: &[(String, String)],
) -> Result<Agent, String> {
    let a = Agent::new(name).map_err(|e| format!("Agent::new: {e}"))?;
    let (_m, defaults) = a
        .get_plugin_params(backend)
        .map_err(|e| format!("plugin params of {backend}: {e}"))?;
    let mut p: Params = defaults.clone().map_err(|e| format!("params: {e}"))?;
    for (k, v) in params {
        p.set(k, v).map_err(|e| format!("param {k}: {e}"))?;
    }
    a.create_backend(backend, &p)
        .map_err(|e| format!("create_backend({backend}): {e}"))?;
    Ok(a)
}

pub(super) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(super) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}

pub(super) fn xfer_list(
    base: usize,
    dev: u64,
    items: impl Iterator<Item = (usize, usize)>,
) -> XferDescList<'static> {
    let mut l = XferDescList::new(MemType::Vram).expect("descriptor list");
    for (off, len) in items {
        l.add_desc(base + off, len, dev);
    }
    l
}

/// Posts `req`, naming the failure.
pub(super) fn post(a: &Agent, req: &XferRequest) -> Result<(), String> {
    a.post_xfer_req(req, None)
        .map(drop)
        .map_err(|e| format!("post: {e}"))
}

/// Posts `req` and waits for it; returns the time from post to completion.
pub(super) fn post_and_wait(a: &Agent, req: &XferRequest) -> Result<Duration, String> {
    let t0 = Instant::now();
    post(a, req)?;
    wait(a, req)?;
    Ok(t0.elapsed())
}

pub(super) fn wait(a: &Agent, req: &XferRequest) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        match a.get_xfer_status(req) {
            Ok(XferStatus::Success) => return Ok(()),
            Ok(XferStatus::InProgress) => {}
            Err(e) => return Err(format!("transfer failed: {e}")),
        }
        if t0.elapsed() > TIMEOUT {
            return Err("transfer still running after 60 s".into());
        }
        std::hint::spin_loop();
    }
}

pub(super) fn plugin_counters(name: &str) -> BTreeMap<String, u64> {
    nixl_bounce::stats::plugin_stats(name)
        .map(|s| s.counters)
        .unwrap_or_default()
}

/// Which path carried the requests counted between two snapshots of the
/// initiator's counters (and, for the bounce path's READ, the owner's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Path {
    Peer,
    Bounce,
    Ucx,
}

impl Path {
    pub(super) fn of(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> Path {
        if since(after, before, "peer_map_succeeded") > 0 {
            Path::Peer
        } else if since(after, before, "bounce_succeeded") > 0 {
            Path::Bounce
        } else {
            Path::Ucx
        }
    }
    pub(super) fn name(self) -> &'static str {
        match self {
            Path::Peer => "peer",
            Path::Bounce => "bounce",
            Path::Ucx => "ucx",
        }
    }
}
