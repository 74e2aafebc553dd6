//! The binary's settings: bad values are refused before anything is created.

use std::process::Command;

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_opmon-agent"))
}

#[test]
fn a_poll_interval_below_100ms_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = agent()
        .args(["--poll-interval", "10ms", "--state-dir"])
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "opmon-agent: poll_interval (from flag --poll-interval): 10ms is below the minimum of 100ms"
    );
    assert!(!dir.path().join("state").exists(), "nothing was created");
}

#[test]
fn a_duration_that_is_not_go_syntax_is_refused_from_the_environment_too() {
    let out = agent()
        .env("OPMON_CALL_DEADLINE", "30 seconds")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid duration \"30 seconds\""),
        "{stderr}"
    );
}
