//! Backend parameters: which belong to the inner UCX backend, which to
//! BOUNCE, and which are unknown (rejected, naming them).

use std::collections::BTreeMap;

/// Parameters NIXL 1.5's UCX engine reads although its plugin does not list
/// them among its options (the plugin advertises only `num_workers`,
/// `ucx_devices` and `ucx_error_handling_mode`). They pass through to the
/// inner UCX backend like the advertised ones.
pub const UCX_UNADVERTISED_KEYS: &[&str] = &[
    "num_threads",
    "split_batch_size",
    "ucx_ep_close_force",
    "device_list",
    "ucx_num_device_channels",
    "engine_config",
];

/// The parameters of one `createBackend("BOUNCE", params)` call, split.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SplitParams {
    /// Passed unchanged to the inner UCX backend.
    pub ucx: BTreeMap<String, String>,
    /// Read by BOUNCE.
    pub bounce: BTreeMap<String, String>,
}

/// Splits `params` into UCX's and BOUNCE's. `ucx_keys` are the parameters the
/// installed UCX plugin advertises (asked from NIXL at run time, so a newer
/// UCX plugin's parameters pass through without a change here); `bounce_keys`
/// are BOUNCE's own.
pub fn split(
    params: &BTreeMap<String, String>,
    ucx_keys: &[String],
    bounce_keys: &[&str],
) -> Result<SplitParams, String> {
    let mut out = SplitParams::default();
    let mut unknown = Vec::new();
    for (k, v) in params {
        if bounce_keys.contains(&k.as_str()) {
            out.bounce.insert(k.clone(), v.clone());
        } else if ucx_keys.iter().any(|u| u == k) || UCX_UNADVERTISED_KEYS.contains(&k.as_str()) {
            out.ucx.insert(k.clone(), v.clone());
        } else {
            unknown.push(k.as_str());
        }
    }
    if unknown.is_empty() {
        Ok(out)
    } else {
        let mut known: Vec<&str> = bounce_keys.to_vec();
        known.extend(ucx_keys.iter().map(String::as_str));
        known.extend(UCX_UNADVERTISED_KEYS);
        known.sort_unstable();
        known.dedup();
        Err(format!(
            "unknown BOUNCE backend parameter{} {}; known parameters: {}",
            if unknown.len() == 1 { "" } else { "s" },
            unknown
                .iter()
                .map(|k| format!("{k:?}"))
                .collect::<Vec<_>>()
                .join(", "),
            known.join(", ")
        ))
    }
}

/// The environment variable that gives UCX parameter `key` to BOUNCE's UCX
/// backends: `NIXL_BOUNCE_UCX_<KEY>` (vLLM, for one, passes backend
/// parameters to no backend but UCX).
pub fn ucx_env_name(key: &str) -> String {
    format!("NIXL_BOUNCE_UCX_{}", key.to_ascii_uppercase())
}

/// Adds to `ucx` every UCX parameter (advertised or not) that the
/// environment sets and the backend parameters do not (they win).
pub fn add_ucx_from_env(
    ucx: &mut BTreeMap<String, String>,
    ucx_keys: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) {
    let keys = ucx_keys
        .iter()
        .map(String::as_str)
        .chain(UCX_UNADVERTISED_KEYS.iter().copied());
    for key in keys {
        if !ucx.contains_key(key) {
            if let Some(v) = env(&ucx_env_name(key)) {
                ucx.insert(key.to_string(), v);
            }
        }
    }
}

/// UCX parameters the inner agent's UCX backend never gets: the ones that
/// make NIXL's UCX engine split large transfers over dedicated worker
/// threads. The inner agent posts one write per chunk and notifications,
/// never a split batch, so such workers would only sit there, and a
/// dedicated worker that carries no transfer never progresses, so it keeps
/// the sockets of peers that went away open (docs/design.md §2).
pub const INNER_OMITTED_KEYS: &[&str] = &["num_threads", "split_batch_size"];

/// The inner agent's UCX parameters: `ucx` less [`INNER_OMITTED_KEYS`].
pub fn inner_params(ucx: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    ucx.iter()
        .filter(|(k, _)| !INNER_OMITTED_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_parameters_come_from_the_environment_unless_given() {
        let env = |name: &str| match name {
            "NIXL_BOUNCE_UCX_NUM_THREADS" => Some("4".to_string()),
            "NIXL_BOUNCE_UCX_NUM_WORKERS" => Some("2".to_string()),
            _ => None,
        };
        let mut ucx = map(&[("num_workers", "3")]);
        add_ucx_from_env(&mut ucx, &["num_workers".to_string()], &env);
        assert_eq!(ucx, map(&[("num_threads", "4"), ("num_workers", "3")]));
    }

    #[test]
    fn the_inner_agent_gets_no_dedicated_threads() {
        let told = map(&[
            ("num_threads", "4"),
            ("split_batch_size", "512"),
            ("num_workers", "2"),
        ]);
        assert_eq!(inner_params(&told), map(&[("num_workers", "2")]));
        let none = map(&[("num_workers", "2")]);
        assert_eq!(inner_params(&none), none);
    }

    fn map(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn splits_ucx_and_bounce_parameters() {
        let ucx = vec![
            "num_threads".to_string(),
            "ucx_error_handling_mode".to_string(),
        ];
        let s = split(
            &map(&[("num_threads", "4"), ("arena_size_bytes", "1M")]),
            &ucx,
            &["arena_size_bytes"],
        )
        .unwrap();
        assert_eq!(s.ucx, map(&[("num_threads", "4")]));
        assert_eq!(s.bounce, map(&[("arena_size_bytes", "1M")]));
    }

    #[test]
    fn unknown_parameters_are_named() {
        let err = split(
            &map(&[("no_such_param", "1"), ("num_threads", "2")]),
            &["num_threads".into()],
            &[],
        )
        .unwrap_err();
        assert!(err.contains("\"no_such_param\""), "{err}");
        assert!(err.contains("num_threads"), "known list missing: {err}");
    }
}
