//! What the Velero plugin tests share (tests/tests/velero_plugin.rs, velero_standin.rs,
//! kubernetes.rs, velero_go.rs): the Go module tests/go/velero on Velero's own module
//! (its test plugin, written on Velero's plugin framework, and its tests), the Go
//! environment that builds it, and a test directory holding the test plugin's state and
//! journal.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The Go module tests/go/velero.
pub fn module() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("go/velero")
}

/// Where the Go builds are kept between runs: /var/cache/opmon-ci as root (as in CI),
/// else the temporary directory.
fn cache() -> PathBuf {
    let cache = if nix::unistd::geteuid().is_root() {
        PathBuf::from("/var/cache/opmon-ci")
    } else {
        std::env::temp_dir().join("opmon-ci")
    };
    std::fs::create_dir_all(&cache).expect("the build cache");
    cache
}

/// `go` for tests/go/velero in module mode: modules come from the Go module proxy, and
/// as root the module download and the build cache are kept in /var/cache/opmon-ci.
pub fn go(args: &[&str]) -> Command {
    let mut command = Command::new("go");
    command
        .args(args)
        .current_dir(module())
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=readonly")
        // Static, as plugin images ship them: the plugin runs in images without glibc.
        .env("CGO_ENABLED", "0")
        .env_remove("GO111MODULE")
        .env_remove("GOPATH");
    if nix::unistd::geteuid().is_root() {
        command
            .env("GOMODCACHE", cache().join("go-mod"))
            .env("GOCACHE", cache().join("go-build"));
    }
    command
}

/// Runs `command`, failing the test with its output; a missing tool says what to install.
fn run(command: &mut Command, what: &str) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: {e}; .ci/run installs what it needs"));
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The hash of `files` (relative to the module) and of every file in `dirs`.
fn sources_hash(files: &[&str], dirs: &[&str]) -> u64 {
    let module = module();
    let mut paths: Vec<PathBuf> = files.iter().map(|f| module.join(f)).collect();
    for dir in dirs {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(module.join(dir))
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        entries.sort();
        paths.extend(entries);
    }
    let mut hasher = DefaultHasher::new();
    for path in paths {
        path.strip_prefix(&module)
            .expect("inside")
            .hash(&mut hasher);
        std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .hash(&mut hasher);
    }
    hasher.finish()
}

/// The program `tests/go/velero/cmd/<name>`, built once and cached by its sources' hash.
fn built(name: &str, cell: &'static OnceLock<PathBuf>) -> &'static Path {
    cell.get_or_init(|| {
        let hash = sources_hash(&["go.mod", "go.sum"], &[&format!("cmd/{name}")]);
        let done = cache().join(format!("velero-{name}-{hash:016x}"));
        if done.exists() {
            return done;
        }
        let work = tempfile::tempdir_in(cache()).expect("a build directory");
        let out = work.path().join(name);
        run(
            go(&["build", "-o"]).arg(&out).arg(format!("./cmd/{name}")),
            &format!(
                "go build ./cmd/{name} in tests/go/velero (apt-get install golang-go; \
                 the Go module proxy for Velero's module)"
            ),
        );
        // Another test binary may have built it meanwhile: either copy will do.
        if std::fs::rename(&out, &done).is_err() {
            assert!(done.exists(), "caching {}", done.display());
        }
        done
    })
    .as_path()
}

/// The test plugin (tests/go/velero/cmd/test-plugin), written on Velero's plugin
/// framework.
pub fn test_plugin() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    built("test-plugin", &BUILT)
}

/// The Go host of velero_standin.rs (tests/go/velero/cmd/velero-host): Velero's side of
/// go-plugin, driven step by step, for what Velero's own controllers cannot be made to
/// do in a test (a Velero restarted mid-operation, an agent away).
pub fn velero_host() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    built("velero-host", &BUILT)
}

/// A test's directory, with the test plugin's state directory (`OPMON_TEST_STATE`).
pub struct PluginDir {
    dir: tempfile::TempDir,
}

impl PluginDir {
    pub fn new() -> PluginDir {
        let dir = PluginDir {
            dir: tempfile::tempdir().expect("a test directory"),
        };
        std::fs::create_dir_all(dir.state()).expect("the plugin's state directory");
        dir
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The test plugin's `OPMON_TEST_STATE`.
    pub fn state(&self) -> PathBuf {
        self.path().join("plugin-state")
    }

    /// Every call the test plugin got, a line each, in order.
    pub fn journal(&self) -> Vec<String> {
        crate::journal(&self.state().join("journal"))
    }
}

impl Default for PluginDir {
    fn default() -> Self {
        PluginDir::new()
    }
}
