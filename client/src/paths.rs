//! Where the agent's socket is when nobody says otherwise (docs/architecture.md, "The
//! API"): the agent and every client resolve it the same way.

use std::path::PathBuf;

/// The agent's socket as a client finds it: `$OPMON_SOCKET` if set (as the `opmon` CLI
/// reads it), else where the agent puts it by default: `$RUNTIME_DIRECTORY/agent.sock`
/// (systemd), else `/run/opmon/agent.sock` as root, else
/// `$XDG_RUNTIME_DIR/opmon/agent.sock`, else `/tmp/opmon-<uid>/agent.sock`.
///
/// ```
/// std::env::set_var("OPMON_SOCKET", "/run/velero/opmon.sock");
/// assert_eq!(opmon_client::default_socket_path(), std::path::Path::new("/run/velero/opmon.sock"));
/// ```
pub fn default_socket_path() -> PathBuf {
    match std::env::var_os("OPMON_SOCKET") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => standard_socket_path(),
    }
}

/// Where the agent puts its socket unless configured: `$RUNTIME_DIRECTORY/agent.sock`
/// (systemd), else `/run/opmon/agent.sock` as root, else
/// `$XDG_RUNTIME_DIR/opmon/agent.sock`, else `/tmp/opmon-<uid>/agent.sock`.
pub fn standard_socket_path() -> PathBuf {
    if let Some(dir) = first_path_of("RUNTIME_DIRECTORY") {
        return dir.join("agent.sock");
    }
    let uid = nix::unistd::geteuid();
    if uid.is_root() {
        return PathBuf::from("/run/opmon/agent.sock");
    }
    if let Some(dir) = first_path_of("XDG_RUNTIME_DIR") {
        return dir.join("opmon").join("agent.sock");
    }
    PathBuf::from(format!("/tmp/opmon-{uid}/agent.sock"))
}

/// The first entry of a colon-separated path list in `var` (systemd passes several
/// directories that way), if set and non-empty.
#[cfg_attr(not(feature = "internal"), allow(dead_code))]
pub fn first_path_of(var: &str) -> Option<PathBuf> {
    let value = std::env::var_os(var)?;
    let text = value.to_str()?;
    let first = text.split(':').next()?;
    (!first.is_empty()).then(|| PathBuf::from(first))
}
