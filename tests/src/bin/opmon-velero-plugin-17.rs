//! A test plugin that behaves on the wire as a Velero plugin built with hashicorp
//! go-plugin 1.7 does (Debian's go-plugin, which the Go test plugin uses, is 1.0.1):
//!
//! - it refuses to run without Velero's magic cookie and protocol version 2;
//! - it announces `1|2|unix|SOCKET|grpc|` and, when the host asks for multiplexing
//!   (`PLUGIN_MULTIPLEX_GRPC`), a seventh field `true`;
//! - after the handshake, what it writes to its stdout and stderr goes into a buffer of
//!   64 KiB (a pipe's) that only go-plugin's stdio stream (`plugin.GRPCStdio/StreamStdio`)
//!   drains: a host that never opens the stream blocks it at its first large write.
//!
//! It serves Velero's plugin lister and RestoreItemAction v2 Progress and Cancel for
//! `example.io/restore-a`, with the operations of the Go plugin (done, steps-N, fail,
//! error, noisy-N; see tests/go/velero/cmd/test-plugin/main.go), and writes the same
//! journal in `$OPMON_TEST_STATE`. Its messages are declared here, apart from the agent's.

use std::convert::Infallible;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

const PLUGIN: &str = "example.io/restore-a";
/// What a pipe holds before a writer blocks: 64 lines of 1 KiB.
const PIPE_CHUNKS: usize = 64;

#[derive(Clone, PartialEq, prost::Message)]
struct Empty {}

#[derive(Clone, PartialEq, prost::Message)]
struct Identifier {
    #[prost(string, tag = "1")]
    command: String,
    #[prost(string, tag = "2")]
    kind: String,
    #[prost(string, tag = "3")]
    name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Listed {
    #[prost(message, repeated, tag = "1")]
    plugins: Vec<Identifier>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProgressRequest {
    #[prost(string, tag = "1")]
    plugin: String,
    #[prost(string, tag = "2")]
    operation_id: String,
    #[prost(bytes = "vec", tag = "3")]
    restore: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Time {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Progress {
    #[prost(bool, tag = "1")]
    completed: bool,
    #[prost(string, tag = "2")]
    err: String,
    #[prost(int64, tag = "3")]
    n_completed: i64,
    #[prost(int64, tag = "4")]
    n_total: i64,
    #[prost(string, tag = "6")]
    description: String,
    #[prost(message, optional, tag = "7")]
    started: Option<Time>,
    #[prost(message, optional, tag = "8")]
    updated: Option<Time>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProgressResponse {
    #[prost(message, optional, tag = "1")]
    progress: Option<Progress>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Stdio {
    #[prost(int32, tag = "1")]
    channel: i32,
    #[prost(bytes = "vec", tag = "2")]
    data: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StackFrame {
    #[prost(string, tag = "1")]
    file: String,
    #[prost(int32, tag = "2")]
    line: i32,
    #[prost(string, tag = "3")]
    function: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Stack {
    #[prost(message, repeated, tag = "1")]
    frames: Vec<StackFrame>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

/// Go's zero `time.Time`, as Velero's framework sends an unknown time.
const GO_ZERO: Time = Time {
    seconds: -62_135_596_800,
    nanos: 0,
};

/// A write to stdout (1) or stderr (2).
type Output = (i32, Vec<u8>);

struct Plugin {
    state: PathBuf,
    /// The "pipe" of stdout and stderr: (channel, bytes).
    output: mpsc::Sender<Output>,
    /// Its reading end, taken by the first stdio stream.
    reader: Mutex<Option<mpsc::Receiver<Output>>>,
    journal: Mutex<()>,
}

impl Plugin {
    fn record(&self, line: &str) {
        let _guard = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state.join("journal"))
        {
            let _ = writeln!(f, "{line}");
        }
    }

    fn count(&self, name: &str) -> i64 {
        let path = self.state.join(name);
        let n = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .unwrap_or(0)
            + 1;
        let _ = std::fs::write(&path, n.to_string());
        n
    }

    /// Writes to "stdout" or "stderr": blocks while the pipe is full.
    async fn write(&self, channel: i32, data: Vec<u8>) {
        let _ = self.output.send((channel, data)).await;
    }

    async fn progress(&self, r: ProgressRequest) -> Result<Progress, Status> {
        let owner: serde_json::Value = serde_json::from_slice(&r.restore)
            .map_err(|e| velero_error(&format!("decoding the restore: {e}")))?;
        self.record(&format!(
            "progress RestoreItemActionV2 {} {} {}/{}",
            r.plugin,
            r.operation_id,
            owner["kind"].as_str().unwrap_or(""),
            owner["metadata"]["name"].as_str().unwrap_or("")
        ));
        if r.plugin != PLUGIN {
            return Err(velero_error(&format!("{} is not served here", r.plugin)));
        }
        let id = r.operation_id.as_str();
        let words: Vec<&str> = id.split('-').collect();
        let polls = self.count(&format!("polls-{id}"));
        let now = now();
        match words[0] {
            "done" => Ok(Progress {
                completed: true,
                n_completed: 1,
                n_total: 1,
                started: Some(GO_ZERO),
                updated: Some(now),
                ..Default::default()
            }),
            "steps" => {
                let n: i64 = words.get(1).and_then(|w| w.parse().ok()).unwrap_or(1);
                Ok(Progress {
                    completed: polls >= n,
                    n_completed: polls,
                    n_total: n,
                    description: format!("step {polls} of {n}"),
                    started: Some(now.clone()),
                    updated: Some(now),
                    ..Default::default()
                })
            }
            "fail" => Ok(Progress {
                completed: true,
                err: "the copy failed: disk full".into(),
                started: Some(now),
                ..Default::default()
            }),
            "error" => Err(velero_error(&format!("no snapshot named {id}"))),
            "noisy" => {
                let kib: usize = words.get(1).and_then(|w| w.parse().ok()).unwrap_or(1);
                let mut line = vec![b'x'; 1023];
                line.push(b'\n');
                for _ in 0..kib {
                    self.write(1, line.clone()).await;
                    self.write(2, line.clone()).await;
                }
                Ok(Progress {
                    completed: true,
                    started: Some(now),
                    ..Default::default()
                })
            }
            _ => Err(velero_error(&format!("unknown operation {id}"))),
        }
    }
}

fn now() -> Time {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    Time {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// A plugin's error as Velero's framework returns it: code Unknown, a `generated.Stack`.
fn velero_error(message: &str) -> Status {
    let stack = Stack {
        frames: vec![StackFrame {
            file: "plugin.go".into(),
            line: 7,
            function: "plugin.Progress".into(),
        }],
    };
    let details = RpcStatus {
        code: tonic::Code::Unknown as i32,
        message: message.into(),
        details: vec![Any {
            type_url: "type.googleapis.com/generated.Stack".into(),
            value: stack.encode_to_vec(),
        }],
    };
    Status::with_details(
        tonic::Code::Unknown,
        message,
        details.encode_to_vec().into(),
    )
}

type Body = tonic::body::Body;

async fn route(
    plugin: Arc<Plugin>,
    request: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<Body>, Infallible> {
    let path = request.uri().path().to_string();
    let response = match path.as_str() {
        "/generated.PluginLister/ListPlugins" => {
            let service = tower::service_fn(|_: Request<Empty>| async {
                Ok::<_, Status>(Response::new(Listed {
                    plugins: vec![Identifier {
                        command: std::env::args().next().unwrap_or_default(),
                        kind: "RestoreItemActionV2".into(),
                        name: PLUGIN.into(),
                    }],
                }))
            });
            grpc::<Listed, Empty>().unary(service, request).await
        }
        "/v2.RestoreItemAction/Progress" => {
            let plugin = plugin.clone();
            let service = tower::service_fn(move |r: Request<ProgressRequest>| {
                let plugin = plugin.clone();
                async move {
                    let progress = plugin.progress(r.into_inner()).await?;
                    Ok::<_, Status>(Response::new(ProgressResponse {
                        progress: Some(progress),
                    }))
                }
            });
            grpc::<ProgressResponse, ProgressRequest>()
                .unary(service, request)
                .await
        }
        "/v2.RestoreItemAction/Cancel" => {
            let plugin = plugin.clone();
            let service = tower::service_fn(move |r: Request<ProgressRequest>| {
                let plugin = plugin.clone();
                async move {
                    let r = r.into_inner();
                    plugin.record(&format!(
                        "cancel RestoreItemActionV2 {} {}",
                        r.plugin, r.operation_id
                    ));
                    Ok::<_, Status>(Response::new(Empty {}))
                }
            });
            grpc::<Empty, ProgressRequest>()
                .unary(service, request)
                .await
        }
        "/plugin.GRPCStdio/StreamStdio" => {
            let mut reader = plugin
                .reader
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            let service = tower::service_fn(move |_: Request<Empty>| {
                let reader = reader.take();
                async move {
                    let Some(reader) = reader else {
                        return Err(Status::failed_precondition("stdio already streamed"));
                    };
                    let stream = futures::stream::unfold(reader, |mut reader| async move {
                        let (channel, data) = reader.recv().await?;
                        Some((Ok::<_, Status>(Stdio { channel, data }), reader))
                    });
                    Ok(Response::new(Box::pin(stream)))
                }
            });
            grpc::<Stdio, Empty>()
                .server_streaming(service, request)
                .await
        }
        _ => Status::unimplemented(format!("no method {path}")).into_http(),
    };
    Ok(response)
}

fn grpc<Out: Message + Send + 'static, In: Message + Default + Send + 'static>(
) -> tonic::server::Grpc<tonic_prost::ProstCodec<Out, In>> {
    tonic::server::Grpc::new(tonic_prost::ProstCodec::default())
}

#[tokio::main]
async fn main() {
    // What go-plugin's Serve checks before anything else.
    if std::env::var("VELERO_PLUGIN").as_deref() != Ok("hello") {
        eprintln!(
            "This binary is a plugin. These are not meant to be executed directly.\n\
             Please execute the program that consumes these plugins, which will\n\
             load any plugins automatically"
        );
        std::process::exit(1);
    }
    let versions = std::env::var("PLUGIN_PROTOCOL_VERSIONS").unwrap_or_default();
    if !versions.split(',').any(|v| v == "2") {
        eprintln!("no protocol version in common with the host: {versions}");
        std::process::exit(1);
    }
    let state = PathBuf::from(std::env::var("OPMON_TEST_STATE").unwrap_or_else(|_| ".".into()));
    let (output, reader) = mpsc::channel(PIPE_CHUNKS);
    let plugin = Arc::new(Plugin {
        state,
        output,
        reader: Mutex::new(Some(reader)),
        journal: Mutex::new(()),
    });
    let args: Vec<String> = std::env::args().skip(1).collect();
    plugin.record(&format!(
        "started {} {}",
        std::process::id(),
        args.join(" ")
    ));

    let dir = std::env::temp_dir().join(format!("plugin-17-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("socket directory");
    let socket = dir.join("plugin.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("binding the socket");
    let multiplex = std::env::var("PLUGIN_MULTIPLEX_GRPC").is_ok_and(|v| v == "true");
    let mut line = format!("1|2|unix|{}|grpc|", socket.display());
    if multiplex {
        line.push_str("|true");
        plugin.record("handshake 7 fields");
    } else {
        plugin.record("handshake 6 fields");
    }
    // The handshake is the last thing written to the real stdout.
    println!("{line}");
    let _ = std::io::stdout().flush();
    // go-plugin's own first log line goes where all later output goes.
    plugin
        .write(
            2,
            br#"{"@level":"debug","@message":"plugin address","network":"unix"}
"#
            .to_vec(),
        )
        .await;

    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let plugin = plugin.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let plugin = plugin.clone();
                async move { route(plugin, request).await }
            });
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
