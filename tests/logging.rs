//! Logging: off by default except warnings and errors; NIXL_BOUNCE_LOG sets
//! the level and NIXL_BOUNCE_LOG_FILE sends the log to a file. The plugin
//! reads both once, when NIXL loads it, so this test binary (one process)
//! sets them before its first BOUNCE agent.

mod support;

use support::*;

#[test]
fn nixl_bounce_log_file_receives_the_engine_log() {
    if !ready("BOUNCE") {
        return;
    }
    let path = std::env::temp_dir().join(format!("nixl-bounce-log-{}.txt", std::process::id()));
    let _ = std::fs::remove_file(&path);
    std::env::set_var("NIXL_BOUNCE_LOG", "nixl_bounce=info");
    std::env::set_var("NIXL_BOUNCE_LOG_FILE", &path);
    let name = unique_name("log-agent");
    let node = Node::new(&name, "BOUNCE", &[("control_bind_loopback", "true")]).or_fail("create");
    // An unknown parameter is rejected, and the reason is logged.
    let bad = Node::new(&unique_name("log-bad"), "BOUNCE", &[("no_such_param", "1")]);
    assert!(bad.is_err());
    // So is a UCX parameter NIXL's UCX engine cannot use, naming it.
    let bad_ucx = Node::new(
        &unique_name("log-bad-ucx"),
        "BOUNCE",
        &[("num_threads", "abc")],
    );
    assert!(bad_ucx.is_err());
    drop(node);
    // The file writer is non-blocking: give it a moment to flush.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let text = loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let both = text.contains("no_such_param") && text.contains("num_threads=");
        if both || std::time::Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let _ = std::fs::remove_file(&path);
    assert!(
        text.contains("BOUNCE engine created") && text.contains(&name),
        "engine creation not logged:\n{text}"
    );
    assert!(
        text.contains("unknown BOUNCE backend parameter \"no_such_param\""),
        "rejection not logged:\n{text}"
    );
    assert!(
        text.contains("UCX engine") && text.contains("{num_threads=\"abc\"}; check their values"),
        "UCX parameter rejection not logged with the parameter:\n{text}"
    );
}
