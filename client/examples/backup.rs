use std::process::ExitCode;
use std::time::Duration;

use opmon_client::{Client, NewOperation, PluginKind, ResourceIdentifier};

/// This example's backup; the Go client's example makes `nightly-go`.
const BACKUP: &str = "nightly-rust";

#[tokio::main]
async fn main() -> ExitCode {
    let Some(operation_id) = std::env::args().nth(1) else {
        eprintln!("usage: backup OPERATION_ID (what `qemu-img-snapshotter start` printed)");
        return ExitCode::from(2);
    };
    match backup(&operation_id).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("backup {BACKUP}: {}", e.chain()); // the error and its causes
            ExitCode::FAILURE
        }
    }
}

async fn backup(operation_id: &str) -> Result<(), opmon_client::Error> {
    let client = Client::builder(opmon_client::default_socket_path()) // $OPMON_SOCKET, else the agent's
        .connect_timeout(Duration::from_secs(5)) // default 5 s
        .call_timeout(Duration::from_secs(120)) // default 2 min; finalize_timeout: 1 h
        .connect()
        .await?;
    let backups = client.backups(); // an owned handle: clone it into tasks
    backups.start(BACKUP, "9b2e61c4").await?; // optional: .item_operation_timeout(..)

    // The operation a plugin started, which the snapshotter registered for the plugin's
    // name (the quick start's qemu-img-snapshotter) reports on.
    let pvc = ResourceIdentifier::namespaced("persistentvolumeclaims", "vms", "vm-2-disk");
    let plugin = "example.io/qemu-img";
    let op = NewOperation::new(PluginKind::VolumeSnapshotter, plugin, pvc, operation_id);
    backups.add_operations(BACKUP, vec![op]).await?;
    backups.end_in_progress(BACKUP).await?;

    // A backup waits in Finalizing for finalize, and Finalizing is not terminal.
    let mut updates = backups.subscribe(BACKUP).await?; // a Stream of changes
    while let Some(update) = updates.next().await {
        let update = update?; // .resumed, .owner, .operations
        if update.owner.phase.is_finalizing() || update.owner.phase.is_terminal() {
            break;
        }
    }
    let done = backups.finalize(BACKUP).await?;
    println!("{} is {}", done.owner.name, done.owner.phase);
    Ok(())
}
