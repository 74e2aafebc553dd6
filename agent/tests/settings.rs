//! The binary's settings: bad values are refused before anything is created.

use std::process::Command;

/// The agent with none of this process's `OPMON_*` variables: the agent refuses those
/// that are not its settings, and a test harness may have its own.
fn agent() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_opmon-agent"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("OPMON_") {
            command.env_remove(name);
        }
    }
    command
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

/// The agent printing its configuration, with no config file.
fn print_config() -> Command {
    let mut command = agent();
    command
        .env("OPMON_CONFIG", "/dev/null")
        .arg("--print-config");
    command
}

#[test]
fn an_opmon_variable_that_is_no_setting_stops_the_agent_naming_it() {
    // The variable the sidecar manifest once set, which did nothing.
    let out = print_config().env("OPMON_LOG", "info").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "opmon-agent: environment variable OPMON_LOG is not an opmon-agent setting (did you mean OPMON_LOG_FORMAT or OPMON_LOG_LEVEL?)"
    );
    let out = print_config()
        .env("OPMON_POLL_INTERVALL", "1s")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "opmon-agent: environment variable OPMON_POLL_INTERVALL is not an opmon-agent setting (did you mean OPMON_POLL_INTERVAL?)"
    );
    let out = print_config().env("OPMON_COLOUR", "1").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "opmon-agent: environment variable OPMON_COLOUR is not an opmon-agent setting (see opmon-agent --help for the settings' variables)"
    );
}

#[test]
fn variables_of_the_cli_and_of_command_snapshotters_do_not_stop_the_agent() {
    let out = print_config()
        .env("OPMON_SOCKET", "/tmp/x.sock")
        .env("OPMON_PLUGIN", "example.io/p")
        .env("OPMON_OWNER_NAME", "b")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("socket = \"/tmp/x.sock\"") && text.contains("# environment OPMON_SOCKET"),
        "{text}"
    );
}

#[test]
fn a_log_level_that_is_not_a_level_is_refused_instead_of_logging_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.toml");
    std::fs::write(&file, "log_level = \"verbose\"\n").unwrap();
    let out = print_config().env("OPMON_CONFIG", &file).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        format!(
            "opmon-agent: log_level (from {} line 1): \"verbose\" is not a level (trace, debug, info, warn, error, off) or a directive like opmon_agent=debug",
            file.display()
        )
    );
    // Levels and target=level directives are fine.
    for good in [
        "debug",
        "WARN",
        "info,opmon_agent=trace",
        "opmon_agent::core=debug",
    ] {
        let out = print_config()
            .env("OPMON_LOG_LEVEL", good)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{good}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn max_connections_per_uid_is_a_setting_with_bounds() {
    let out = print_config().output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.starts_with("max_connections_per_uid = 256 ") && l.ends_with("# default")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("allowed_uids = [] ") && l.ends_with("# default")),
        "{text}"
    );
    let out = print_config()
        .env("OPMON_MAX_CONNECTIONS_PER_UID", "0")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "opmon-agent: max_connections_per_uid (from environment OPMON_MAX_CONNECTIONS_PER_UID): must be between 1 and 4096"
    );
}

#[test]
fn a_bad_snapshotter_table_stops_the_agent_before_the_database_and_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.toml");
    std::fs::write(
        &file,
        "[[snapshotter]]\nname = \"example.io/copier\"\napi_version = \"v2\"\nsocket = \"relative.sock\"\n",
    )
    .unwrap();
    let state = dir.path().join("state");
    let socket = dir.path().join("run/agent.sock");
    let out = agent()
        .arg("--config")
        .arg(&file)
        .arg("--state-dir")
        .arg(&state)
        .arg("--socket")
        .arg(&socket)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "opmon-agent: config snapshotter example.io/copier: socket: must be an absolute path"
    );
    assert!(!state.exists(), "no state directory, so no agent.db");
    assert!(
        !socket.exists() && !dir.path().join("run").exists(),
        "no socket"
    );
}

#[test]
fn a_mistyped_flag_or_key_is_refused_naming_it() {
    let out = agent().arg("--pol-interval=1s").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unexpected argument '--pol-interval' found")
            && stderr.contains("tip: a similar argument exists: '--poll-interval'"),
        "{stderr}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.toml");
    std::fs::write(&file, "log_levle = \"debug\"\n").unwrap();
    let out = print_config().env("OPMON_CONFIG", &file).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "opmon-agent: config file {} line 1: unknown field `log_levle`, expected one of `socket`, `socket_mode`,",
            file.display()
        )),
        "{stderr}"
    );
}

#[test]
fn help_lists_every_setting_with_its_variable_and_default() {
    let out = agent().arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for declared in opmon_agent::config::declarations() {
        assert!(
            text.contains(&declared.flag()),
            "{} in {text}",
            declared.flag()
        );
        assert!(
            text.contains(&format!("[env: {}=", declared.variable())),
            "{} in {text}",
            declared.variable()
        );
    }
    assert!(
        text.contains("[default: 256]") && text.contains("[default: \"10s\" (at least 100ms)]"),
        "{text}"
    );
}
