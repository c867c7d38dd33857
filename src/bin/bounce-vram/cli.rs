//! The command line.

use super::*;

#[derive(Clone)]
pub(super) struct Args {
    pub(super) command: String,
    pub(super) backend: String,
    pub(super) label: String,
    pub(super) params: Vec<(String, String)>,
    pub(super) device: usize,
    pub(super) target_device: usize,
    pub(super) buffer: usize,
    pub(super) counts: Vec<usize>,
    pub(super) sizes: Vec<usize>,
    pub(super) iters: usize,
    pub(super) concurrent: usize,
    pub(super) json: Option<String>,
    pub(super) expect_fallback: bool,
    /// Parameters for the target process only (e.g. `enable=false`).
    pub(super) target_params: Vec<(String, String)>,
    /// What `bench` measures: WRITEs to the target, or READs from it.
    pub(super) op: XferOp,
    /// `bench`: idle microseconds before each request (outside the timing).
    pub(super) gap_us: u64,
}

impl Args {
    pub(super) fn parse() -> Args {
        let mut it = std::env::args().skip(1);
        let mut a = Args {
            command: it.next().unwrap_or_else(|| "help".into()),
            backend: "BOUNCE".into(),
            label: String::new(),
            params: vec![("control_bind_loopback".into(), "true".into())],
            device: 0,
            target_device: 0,
            buffer: 1 << 30,
            counts: vec![1024, 4096, 16384],
            sizes: vec![4096],
            iters: 20,
            concurrent: 128,
            json: None,
            expect_fallback: false,
            op: XferOp::Write,
            target_params: Vec::new(),
            gap_us: 0,
        };
        let list = |s: String| {
            s.split(',')
                .filter_map(|x| x.trim().parse().ok())
                .collect::<Vec<usize>>()
        };
        while let Some(flag) = it.next() {
            let mut val = || {
                it.next()
                    .unwrap_or_else(|| die(format!("{flag} needs a value")))
            };
            match flag.as_str() {
                "--backend" => a.backend = val(),
                "--label" => a.label = val(),
                "--param" => {
                    let kv = val();
                    let (k, v) = kv
                        .split_once('=')
                        .unwrap_or_else(|| die(format!("--param {kv}: not K=V")));
                    a.params.retain(|(key, _)| key != k);
                    a.params.push((k.into(), v.into()));
                }
                "--device" => a.device = val().parse().unwrap_or(0),
                "--target-device" => a.target_device = val().parse().unwrap_or(0),
                "--buffer" => a.buffer = val().parse().unwrap_or(1 << 30),
                "--counts" => a.counts = list(val()),
                "--sizes" => a.sizes = list(val()),
                "--iters" => a.iters = val().parse().unwrap_or(20),
                "--concurrent" => a.concurrent = val().parse().unwrap_or(0),
                "--json" => a.json = Some(val()),
                "--expect-fallback" => a.expect_fallback = true,
                "--gap-us" => a.gap_us = val().parse().unwrap_or(0),
                "--op" => {
                    a.op = match val().as_str() {
                        "write" => XferOp::Write,
                        "read" => XferOp::Read,
                        other => die(format!("--op {other}: expected write or read")),
                    }
                }
                "--target-param" => {
                    let kv = val();
                    let (k, v) = kv
                        .split_once('=')
                        .unwrap_or_else(|| die(format!("--target-param {kv}: not K=V")));
                    a.target_params.push((k.into(), v.into()));
                }
                other => die(format!("unknown option {other}")),
            }
        }
        if a.backend != "BOUNCE" {
            a.params.retain(|(k, _)| k != "control_bind_loopback");
        }
        if a.command == "faults" {
            // The drills hold the bounce path's stages (so not the
            // peer-mapped path); small chunks and arenas: a drill's WRITE is
            // 32 chunks, running when the fault hits.
            for (k, v) in [
                ("max_chunk_size_bytes", "2MiB"),
                ("arena_size_bytes", "16MiB"),
                ("enable_peer_map", "false"),
            ] {
                if !a.params.iter().any(|(key, _)| key == k) {
                    a.params.push((k.into(), v.into()));
                }
            }
        }
        if a.label.is_empty() {
            a.label = a.backend.clone();
        }
        a
    }

    /// The path an eligible transfer should take with these parameters.
    pub(super) fn expected_path(&self) -> Path {
        let off = |list: &[(String, String)], key: &str| {
            list.iter()
                .any(|(k, v)| k == key && matches!(v.as_str(), "false" | "0" | "off" | "no"))
        };
        if self.backend != "BOUNCE"
            || self.expect_fallback
            || off(&self.params, "enable")
            || off(&self.target_params, "enable")
        {
            Path::Ucx
        } else if off(&self.params, "enable_peer_map")
            || off(&self.target_params, "enable_peer_map")
        {
            Path::Bounce
        } else {
            Path::Peer
        }
    }

    /// The usable arena capacity these parameters give.
    pub(super) fn arena_capacity(&self) -> u64 {
        let size = self
            .params
            .iter()
            .find(|(k, _)| k == "arena_size_bytes")
            .and_then(|(_, v)| nixl_bounce::config::parse_bytes(v).ok())
            .unwrap_or(256 << 20);
        1u64 << (63 - size.leading_zeros())
    }

    /// The options the target process needs.
    pub(super) fn forward(&self) -> Vec<String> {
        let mut v = vec![
            "--backend".into(),
            self.backend.clone(),
            "--buffer".into(),
            self.buffer.to_string(),
            "--target-device".into(),
            self.target_device.to_string(),
        ];
        for (k, val) in &self.params {
            if self.target_params.iter().any(|(tk, _)| tk == k) {
                continue;
            }
            v.push("--param".into());
            v.push(format!("{k}={val}"));
        }
        for (k, val) in &self.target_params {
            v.push("--param".into());
            v.push(format!("{k}={val}"));
        }
        v
    }
}
