//! End-to-end: Velero's own code (v1.18.1: its plugin discovery and manager, its backup
//! controller and backupper, its backup and restore operations controllers, its backup
//! deletion) drives the stand-in (`opmon-velero-plugin`) and the real agent. The tests
//! are Go tests in tests/go/velero, importing Velero's module; this runs them with the
//! binaries cargo built and the test plugin (tests/go/velero/cmd/test-plugin).

use opmon_tests::{velero, workspace_binary};

#[test]
fn velero_drives_the_stand_in() {
    let out = velero::go(&["test", "-v", "-count=1", "-timeout", "20m", "."])
        .env("OPMON_AGENT", workspace_binary("opmon-agent"))
        .env(
            "OPMON_VELERO_STANDIN",
            workspace_binary("opmon-velero-plugin"),
        )
        .env("OPMON_VELERO_TESTPLUGIN", velero::test_plugin())
        .env("OPMON_CLI", workspace_binary("opmon"))
        // Skipping is refused under CI: a test that cannot find what it runs fails.
        .env("CI", std::env::var_os("CI").unwrap_or_default())
        .output()
        .unwrap_or_else(|e| panic!("go test: {e}; .ci/run installs Go (golang-go)"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "go test in tests/go/velero:\n{text}");
    assert!(!text.contains("--- SKIP"), "{text}");
}
