//! The `opmon` binary on its own: completions, and a clear error and exit code 2 when
//! there is no agent to talk to.

use std::process::Command;

fn opmon() -> Command {
    Command::new(env!("CARGO_BIN_EXE_opmon"))
}

#[test]
fn completions_are_printed_for_each_shell() {
    // Each script hands the words typed to `COMPLETE=<shell> opmon -- …`.
    for (shell, marker) in [
        ("bash", "COMPLETE=\"bash\""),
        ("zsh", "#compdef opmon"),
        ("fish", "COMPLETE=fish opmon --"),
    ] {
        let out = opmon().args(["completions", shell]).output().unwrap();
        assert!(out.status.success(), "{shell}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(marker),
            "{shell}: {}",
            &text[..text.len().min(200)]
        );
    }
    // Which the binary answers with the subcommands, without an agent.
    let out = opmon()
        .env("COMPLETE", "fish")
        .args(["--", "opmon", "backup", ""])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("end-in-progress"),
        "completes subcommands"
    );
}

#[test]
fn no_agent_means_exit_code_2_naming_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");
    let out = opmon()
        .arg("--socket")
        .arg(&socket)
        .arg("status")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "opmon: cannot connect to the opmon agent at {}",
            socket.display()
        )),
        "{stderr}"
    );
}
