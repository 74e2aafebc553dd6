//! finalize: `backup.finalize` rewriting a Velero backup tarball with some items
//! replaced, against `gzip -dc IN | gzip -6 > OUT` and `pigz -dc IN | pigz -6 -p 2 >
//! OUT` on the same file, in the same run; with the output's size against gzip's and the
//! agent's peak resident memory.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use flate2::write::GzEncoder;
use flate2::Compression;
use opmon_client::{
    ApiVersion, Contents, FinalizeParams, OwnerPhase, ResourceIdentifier, Snapshotter, UpdatedItem,
};
use rand::RngCore;

use crate::agent::Spec;
use crate::register::{operation, start_backups, QUIET};
use crate::table::{dur, Row};
use crate::Ctx;

/// The kinds of items in the tarball: (group, resource, apiVersion, kind).
const KINDS: &[(&str, &str, &str, &str)] = &[
    ("", "configmaps", "v1", "ConfigMap"),
    ("", "secrets", "v1", "Secret"),
    ("", "persistentvolumeclaims", "v1", "PersistentVolumeClaim"),
    ("apps", "deployments", "apps/v1", "Deployment"),
];

/// Item `i` of the tarball.
pub fn item(i: usize) -> (ResourceIdentifier, &'static str, &'static str) {
    let (group, resource, api_version, kind) = KINDS[i % KINDS.len()];
    (
        ResourceIdentifier {
            group: group.into(),
            resource: resource.into(),
            namespace: format!("ns-{}", (i / KINDS.len()) % 100),
            name: format!("item-{i}"),
        },
        api_version,
        kind,
    )
}

fn entry_path(r: &ResourceIdentifier) -> String {
    let gr = if r.group.is_empty() {
        r.resource.clone()
    } else {
        format!("{}.{}", r.resource, r.group)
    };
    format!("resources/{gr}/namespaces/{}/{}.json", r.namespace, r.name)
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64(bytes: &[u8], out: &mut String) {
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(BASE64[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
}

/// The JSON of item `i`: a Kubernetes object whose data is `random` base64-encoded
/// (compresses about as well as real secrets and binary config data: barely).
fn object(i: usize, random: &[u8]) -> String {
    let (r, api_version, kind) = item(i);
    let mut blob = String::with_capacity(random.len() * 4 / 3 + 4);
    base64(random, &mut blob);
    format!(
        r#"{{"apiVersion":"{api_version}","kind":"{kind}","metadata":{{"name":"{}","namespace":"{}","uid":"{}","resourceVersion":"{}","labels":{{"app":"bench","shard":"{}"}},"annotations":{{"velero.io/bench":"true"}}}},"data":{{"payload":"{blob}"}}}}"#,
        r.name,
        r.namespace,
        crate::register::uid(&r.name),
        100_000 + i,
        i % 16
    )
}

fn append<W: Write>(tar: &mut tar::Builder<W>, name: &str, data: &[u8]) -> std::io::Result<()> {
    let mut header = tar::Header::new_gnu();
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(1_700_000_000);
    header.set_entry_type(tar::EntryType::Regular);
    tar.append_data(&mut header, name, data)
}

/// Writes the input tarball: `metadata/version`, then `entries` items.
pub fn build_tarball(path: &Path, entries: usize, random_bytes: usize) -> Result<u64, String> {
    let io = |e: std::io::Error| format!("writing {}: {e}", path.display());
    let file = std::fs::File::create(path).map_err(io)?;
    let gz = GzEncoder::new(
        std::io::BufWriter::with_capacity(1 << 20, file),
        Compression::default(),
    );
    let mut tar = tar::Builder::new(gz);
    append(&mut tar, "metadata/version", b"1.1.0\n").map_err(io)?;
    let mut rng = rand::rng();
    let mut random = vec![0u8; random_bytes];
    for i in 0..entries {
        rng.fill_bytes(&mut random);
        let json = object(i, &random);
        append(&mut tar, &entry_path(&item(i).0), json.as_bytes()).map_err(io)?;
    }
    let gz = tar.into_inner().map_err(io)?;
    let mut out = gz.finish().map_err(io)?;
    out.flush().map_err(io)?;
    std::fs::metadata(path).map(|m| m.len()).map_err(io)
}

/// `script` (with `$1` the input, `$2` the output) under `sh -c`, timed.
fn pipeline(what: &str, script: &str, input: &Path, output: &Path) -> Result<Duration, String> {
    let began = Instant::now();
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!("set -e; {script}"))
        .arg("sh")
        .arg(input)
        .arg(output)
        .status()
        .map_err(|e| format!("running {what}: {e}"))?;
    if !status.success() {
        return Err(format!("{what} failed: {status}"));
    }
    Ok(began.elapsed())
}

/// `sync FILE`, timed: what the agent's fsync of its output costs.
fn sync_file(path: &Path) -> Result<Duration, String> {
    let began = Instant::now();
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| format!("syncing {}: {e}", path.display()))?;
    Ok(began.elapsed())
}

pub async fn run(ctx: &Ctx) -> Result<Vec<Row>, String> {
    let s = &ctx.sizes;
    let dir = ctx.subdir("finalize")?;
    let input = dir.join("backup.tar.gz");
    let (entries, random) = (s.tar_entries, s.tar_random_bytes);
    let path = input.clone();
    let size = tokio::task::spawn_blocking(move || build_tarball(&path, entries, random))
        .await
        .map_err(|e| format!("building the tarball: {e}"))??;

    // The baselines first: they also bring the input into the page cache.
    let gzip_out = dir.join("gzip.tar.gz");
    let (i2, o2) = (input.clone(), gzip_out.clone());
    let gzip = tokio::task::spawn_blocking(move || {
        pipeline(
            "gzip -dc | gzip -6",
            r#"gzip -dc "$1" | gzip -6 > "$2""#,
            &i2,
            &o2,
        )
    })
    .await
    .map_err(|e| format!("gzip: {e}"))??;
    let o3 = gzip_out.clone();
    let gzip_sync = tokio::task::spawn_blocking(move || sync_file(&o3))
        .await
        .map_err(|e| format!("sync: {e}"))??;
    let gzip_size = std::fs::metadata(&gzip_out).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_file(&gzip_out);
    let pigz_out = dir.join("pigz.tar.gz");
    let (i4, o4) = (input.clone(), pigz_out.clone());
    let pigz = tokio::task::spawn_blocking(move || {
        pipeline(
            "pigz -dc | pigz -6 -p 2 (apt-get install pigz)",
            r#"pigz -dc "$1" | pigz -6 -p 2 > "$2""#,
            &i4,
            &o4,
        )
    })
    .await
    .map_err(|e| format!("pigz: {e}"))?;
    let _ = std::fs::remove_file(&pigz_out);

    // A backup in Finalizing: one operation of a v1 snapshotter, complete at its poll.
    // The tarball lies beside the state directory: allowed by finalize_dirs.
    let dirs = dir.display().to_string();
    let mut args: Vec<&str> = QUIET.to_vec();
    args.extend(["--finalize-dirs", dirs.as_str()]);
    let spec = Spec::new(ctx, &dir, &args);
    let (mut agent, _) = spec.start().await?;
    let client = agent.client().await?;
    let plugin = "example.io/v1-bench";
    client
        .register_snapshotter(Snapshotter {
            name: plugin.into(),
            api_version: ApiVersion::V1,
            socket: None,
            command: None,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("snapshotter.register: {e}"))?;
    let name = "finalize-1".to_string();
    start_backups(ctx, &client, std::slice::from_ref(&name)).await?;
    client
        .backups()
        .add_operations(&name, vec![operation(plugin, 0, 0)])
        .await
        .map_err(|e| format!("backup.addOperations: {e}"))?;
    let owner = client
        .backups()
        .end_in_progress(&name)
        .await
        .map_err(|e| format!("backup.endInProgress: {e}"))?;
    if owner.phase != OwnerPhase::Finalizing {
        return Err(format!("{name} is {} after endInProgress", owner.phase));
    }
    let step = (entries / s.tar_updates.max(1)).max(1);
    let updated: Vec<UpdatedItem> = (0..s.tar_updates)
        .map(|k| {
            let i = (k * step + step / 2).min(entries - 1);
            let (resource, api_version, kind) = item(i);
            let object = serde_json::json!({
                "apiVersion": api_version,
                "kind": kind,
                "metadata": {"name": resource.name, "namespace": resource.namespace},
                "data": {"payload": format!("updated by finalize, item {i}")},
            });
            UpdatedItem { resource, object }
        })
        .collect();
    let output = dir.join("finalized.tar.gz");
    let began = Instant::now();
    let result = client
        .backups()
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: name.clone(),
            contents: Some(Contents {
                input: input.clone(),
                output: output.clone(),
            }),
            updated_items: updated,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("backup.finalize: {e}"))?;
    let took = began.elapsed();
    let peak_kib = agent.peak_rss_kib();
    drop(client);
    agent.terminate()?;
    // The tarball holds the plain paths only: each updated item's preferred-version
    // path is appended, as Velero does.
    if result.replaced != s.tar_updates as u64 || result.added != s.tar_updates as u64 {
        return Err(format!(
            "backup.finalize replaced {} and added {} entries; expected {} and {}",
            result.replaced, result.added, s.tar_updates, s.tar_updates
        ));
    }
    if result.owner.phase != OwnerPhase::Completed {
        return Err(format!("{name} is {} after finalize", result.owner.phase));
    }
    let out_size = std::fs::metadata(&output).map(|m| m.len()).unwrap_or(0);
    let mb = |b: u64| b as f64 / 1e6;
    let mut rows = vec![
        Row::ratio_at_most("finalize vs gzip", dur(took), dur(gzip), 0.5),
        match &pigz {
            Ok(pigz) => Row::ratio_at_most("finalize vs pigz", dur(took), dur(*pigz), 1.0),
            Err(e) => Row::error("finalize", e),
        },
        Row::ratio_at_most(
            "finalize output size",
            (out_size as f64, format!("{:.2} MB", mb(out_size))),
            (gzip_size as f64, format!("{:.2} MB", mb(gzip_size))),
            1.02,
        ),
        match peak_kib {
            Ok(kib) => Row::absolute(
                "finalize memory peak",
                crate::table::mib(kib),
                "≤ 64 MiB",
                kib <= 64 * 1024,
            ),
            Err(e) => Row::error("finalize", &e),
        },
    ];
    rows.extend([
        Row::info_vs("finalize vs gzip+fsync", dur(took), dur(gzip + gzip_sync)),
        Row::info(
            "finalize throughput",
            format!(
                "{:.0} MB → {:.0} MB, {:.1} MB/s of input",
                mb(size),
                mb(out_size),
                mb(size) / took.as_secs_f64()
            ),
        ),
    ]);
    Ok(rows)
}
