//! What the Velero plugin tests share (tests/tests/velero_plugin.rs, velero_standin.rs,
//! kubernetes.rs): the Go programs built against Debian's go-plugin and gRPC (the test
//! plugin of tests/go/velero-plugin and Velero's stand-in host of tests/go/velero-host),
//! and a test directory holding the test plugin's state and journal.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The Go programs: a Velero plugin (the original, in the stand-in's tests) and a host
/// doing what Velero's plugin manager and controllers do.
pub struct GoPrograms {
    pub plugin: PathBuf,
    pub host: PathBuf,
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

/// Both Go programs, built once (offline, GOPATH mode against Debian's Go packages, the
/// messages by protoc) and cached by their sources' hash in /var/cache/opmon-ci (as
/// root, as in CI) or the temporary directory.
pub fn go_programs() -> &'static GoPrograms {
    static BUILT: OnceLock<GoPrograms> = OnceLock::new();
    BUILT.get_or_init(|| {
        let go = Path::new(env!("CARGO_MANIFEST_DIR")).join("go");
        let sources = [
            "velero-plugin/main.go",
            "velero-plugin/proto/generated.proto",
            "velero-plugin/proto/v2.proto",
            "velero-host/main.go",
        ];
        let mut hasher = DefaultHasher::new();
        for f in sources {
            std::fs::read(go.join(f))
                .unwrap_or_else(|e| panic!("{f}: {e}"))
                .hash(&mut hasher);
        }
        let cache = if nix::unistd::geteuid().is_root() {
            PathBuf::from("/var/cache/opmon-ci")
        } else {
            std::env::temp_dir().join("opmon-ci")
        };
        std::fs::create_dir_all(&cache).expect("the build cache");
        let done = cache.join(format!("velero-go-{:016x}", hasher.finish()));
        let programs = GoPrograms {
            plugin: done.join("velero-plugin"),
            host: done.join("velero-host"),
        };
        if done.exists() {
            return programs;
        }
        let work = tempfile::tempdir_in(&cache).expect("a build directory");
        let gopath = work.path();
        let proto = go.join("velero-plugin/proto");
        std::fs::create_dir_all(gopath.join("src")).expect("GOPATH");
        for file in ["generated.proto", "v2.proto"] {
            run(
                Command::new("protoc")
                    .arg("-I")
                    .arg(&proto)
                    .arg(format!(
                        "--go_out=plugins=grpc,paths=import:{}",
                        gopath.join("src").display()
                    ))
                    .arg(proto.join(file)),
                "protoc (apt-get install protobuf-compiler protoc-gen-go-1-3)",
            );
        }
        let out = gopath.join("out");
        std::fs::create_dir_all(&out).expect("the output directory");
        for program in ["velero-plugin", "velero-host"] {
            let package = gopath.join("src/opmontest").join(program);
            std::fs::create_dir_all(&package).expect("the package directory");
            std::fs::copy(go.join(program).join("main.go"), package.join("main.go"))
                .expect("the program's source");
            run(
                Command::new("go")
                    .args(["build", "-o"])
                    .arg(out.join(program))
                    .arg(".")
                    .current_dir(&package)
                    .env("GO111MODULE", "off")
                    .env("GOPATH", format!("{}:/usr/share/gocode", gopath.display()))
                    .env("GOFLAGS", "")
                    .env("GOPROXY", "off")
                    .env("GOTOOLCHAIN", "local")
                    .env("GOCACHE", gopath.join("cache")),
                "go build (apt-get install golang-go golang-github-hashicorp-go-plugin-dev \
                 golang-google-grpc-dev golang-goprotobuf-dev)",
            );
        }
        // Another test binary may have built them meanwhile: either copy will do.
        if std::fs::rename(&out, &done).is_err() {
            assert!(done.exists(), "caching {}", done.display());
        }
        programs
    })
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
