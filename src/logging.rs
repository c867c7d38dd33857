//! Logging set-up for the plugin.
//!
//! `NIXL_BOUNCE_LOG` takes a `tracing` filter (`error`, `warn`, `info`,
//! `debug`, `trace`, `off`, or per-module directives such as
//! `nixl_bounce::engine=debug`). Unset, the plugin logs warnings and errors
//! only, like NIXL itself: routine operation prints nothing, and a rejected
//! parameter or a failed transfer still says why. `NIXL_BOUNCE_LOG_FILE`
//! sends the log to that file (appended) instead of standard error.

use std::sync::OnceLock;
use tracing_subscriber::EnvFilter;

/// The level used when `NIXL_BOUNCE_LOG` is unset.
pub const DEFAULT_FILTER: &str = "warn";

static INIT: OnceLock<Option<tracing_appender::non_blocking::WorkerGuard>> = OnceLock::new();

/// Installs the plugin's subscriber once per process. Harmless to call again,
/// and a no-op when the host process already installed a global subscriber.
pub fn init() {
    INIT.get_or_init(|| {
        let (filter, filter_error) = match std::env::var("NIXL_BOUNCE_LOG") {
            Ok(spec) => match EnvFilter::try_new(&spec) {
                Ok(f) => (f, None),
                Err(e) => (
                    EnvFilter::new(DEFAULT_FILTER),
                    Some(format!("NIXL_BOUNCE_LOG={spec:?} is not a valid filter ({e}); using {DEFAULT_FILTER:?}")),
                ),
            },
            Err(_) => (EnvFilter::new(DEFAULT_FILTER), None),
        };
        let builder = tracing_subscriber::fmt().with_env_filter(filter).with_target(true);
        let guard = match std::env::var_os("NIXL_BOUNCE_LOG_FILE") {
            Some(path) => match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
                Ok(file) => {
                    let (writer, guard) = tracing_appender::non_blocking(file);
                    let _ = builder.with_ansi(false).with_writer(writer).try_init();
                    Some(guard)
                }
                Err(e) => {
                    let _ = builder.with_writer(std::io::stderr).try_init();
                    tracing::warn!(path = ?path, error = %e, "cannot open NIXL_BOUNCE_LOG_FILE; logging to stderr");
                    None
                }
            },
            None => {
                let _ = builder.with_writer(std::io::stderr).try_init();
                None
            }
        };
        if let Some(msg) = filter_error {
            tracing::warn!("{msg}");
        }
        guard
    });
}
