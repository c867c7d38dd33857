//! A live variant: an initiator and a target agent with one backend each,
//! both buffers registered, metadata exchanged.

use std::collections::BTreeMap;

use nixl_bounce::stats::{plugin_stats, Snapshot};
use nixl_sys::{Agent, AgentConfig, RegistrationHandle};

use crate::cli::{BackendKind, VariantSpec};
use crate::mem::BenchMemory;
use crate::sysinfo::claim_new_threads;
use nixl_bounce::harness::{backend_params, unique_name, Node};

/// Parameters every BOUNCE row gets: the control socket binds 127.0.0.1.
/// `control_interface` is set to empty explicitly: before e4e0e48 the plugin
/// advertised its default as the two-character text `""`, which a caller
/// that starts from the advertised defaults (as the harness does) passed
/// back as an interface name. Harmless now.
const BOUNCE_LOOPBACK: &[(&str, &str)] =
    &[("control_bind_loopback", "true"), ("control_interface", "")];

pub struct Variant {
    pub spec: VariantSpec,
    pub label: String,
    /// Effective backend parameters (plugin defaults + ours), as NIXL got them.
    pub params: BTreeMap<String, String>,
    // Field order matters: registrations go before the agents.
    regs: Vec<RegistrationHandle>,
    pub init: Node,
    pub target: Node,
}

impl Variant {
    /// Creates both agents, registers `src` with the initiator and `dst`
    /// with the target, and exchanges metadata both ways.
    pub fn open(
        spec: &VariantSpec,
        src: &dyn BenchMemory,
        dst: &dyn BenchMemory,
    ) -> Result<Self, String> {
        let label = spec.label();
        let mut extra: Vec<(&str, &str)> = Vec::new();
        if spec.backend == BackendKind::Bounce {
            extra.extend_from_slice(BOUNCE_LOOPBACK);
        }
        let mut agent_config = AgentConfig::default();
        for (k, v) in &spec.params {
            match k.strip_prefix("agent.") {
                Some(key) => set_agent_config(&mut agent_config, key, v)?,
                None => extra.push((k.as_str(), v.as_str())),
            }
        }
        let plugin = spec.backend.plugin();
        let agent_prefix: String = label
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .collect();

        // The side first, so that thread names that embed the agent name
        // (truncated to 15 characters) still tell the two apart.
        let init = node(
            &unique_name(&format!("i-{agent_prefix}")),
            plugin,
            &extra,
            &agent_config,
        )?;
        claim_new_threads(&format!("{label}/init"));
        let target = node(
            &unique_name(&format!("t-{agent_prefix}")),
            plugin,
            &extra,
            &agent_config,
        )?;
        claim_new_threads(&format!("{label}/target"));
        let regs = vec![src.register(&init)?, dst.register(&target)?];
        let t = init.load_md(&target.local_md()?)?;
        let i = target.load_md(&init.local_md()?)?;
        if t != target.name || i != init.name {
            return Err(format!(
                "metadata exchange returned {t:?}/{i:?}, expected {:?}/{:?}",
                target.name, init.name
            ));
        }
        claim_new_threads(&format!("{label}/connect"));
        let params = backend_params(&init.agent, plugin, &extra)?
            .iter()
            .map_err(|e| format!("reading backend parameters: {e}"))?
            .filter_map(|p| p.ok().map(|(k, v)| (k.to_string(), v.to_string())))
            .collect();
        Ok(Variant {
            spec: spec.clone(),
            label,
            params,
            regs,
            init,
            target,
        })
    }

    /// The BOUNCE plugin's counters of the initiator and the target.
    pub fn bounce_stats(&self) -> Option<Result<(Snapshot, Snapshot), String>> {
        (self.spec.backend == BackendKind::Bounce).then(|| {
            Ok((
                plugin_stats(&self.init.name)?,
                plugin_stats(&self.target.name)?,
            ))
        })
    }
}

/// Like the harness' `Node::new`, with an agent configuration.
fn node(
    name: &str,
    plugin: &str,
    extra: &[(&str, &str)],
    config: &AgentConfig,
) -> Result<Node, String> {
    let agent = Agent::new_configured(name, config)
        .map_err(|e| format!("Agent::new_configured({name}): {e} ({e:?})"))?;
    let params = backend_params(&agent, plugin, extra)?;
    let backend = agent
        .create_backend(plugin, &params)
        .map_err(|e| format!("create_backend({plugin}): {e} ({e:?})"))?;
    Ok(Node {
        name: name.to_string(),
        backend_name: plugin.to_string(),
        backend,
        agent,
    })
}

/// `agent.<key>=<value>` in a variant: the bench's own agents' configuration
/// (not a backend parameter; for BOUNCE it configures the outer agents only).
fn set_agent_config(c: &mut AgentConfig, key: &str, value: &str) -> Result<(), String> {
    let bad = |what: &str| format!("agent.{key}={value:?}: expected {what}");
    match key {
        "prog_thread" => c.enable_prog_thread = nixl_bounce::config::parse_bool(value).map_err(|_| bad("a boolean"))?,
        "pthr_delay_us" => c.pthr_delay_us = value.parse().map_err(|_| bad("microseconds"))?,
        "num_workers" => c.num_workers = value.parse().map_err(|_| bad("a count"))?,
        _ => return Err(format!("unknown agent setting agent.{key} (known: agent.prog_thread, agent.pthr_delay_us, agent.num_workers)")),
    }
    Ok(())
}

impl Drop for Variant {
    fn drop(&mut self) {
        self.regs.clear();
    }
}
