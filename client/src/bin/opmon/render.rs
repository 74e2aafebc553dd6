//! How results look to a person: tables, `describe`, progress text. Pure functions of
//! the API's types, so every format is unit-tested.

use std::fmt::Write;

use opmon_client::{
    AgentStatus, GoDuration, ItemOperation, Operation, OperationPhase, Owner, OwnerPhase,
    ResourceIdentifier, Snapshotter, Timestamp,
};

/// Parses `RESOURCE[.GROUP]/NAMESPACE/NAME` or `RESOURCE[.GROUP]/NAME` (cluster-scoped).
pub fn parse_item(text: &str) -> Result<ResourceIdentifier, String> {
    let parts: Vec<&str> = text.split('/').collect();
    let (group_resource, namespace, name) = match parts.as_slice() {
        [gr, ns, name] => (*gr, *ns, *name),
        [gr, name] => (*gr, "", *name),
        _ => {
            return Err(format!(
                "item {text:?}: expected RESOURCE[.GROUP]/NAMESPACE/NAME or RESOURCE[.GROUP]/NAME"
            ))
        }
    };
    let (resource, group) = group_resource
        .split_once('.')
        .unwrap_or((group_resource, ""));
    let item = ResourceIdentifier {
        group: group.into(),
        resource: resource.into(),
        namespace: namespace.into(),
        name: name.into(),
    };
    opmon_client::validate::resource(&item)
        .map_err(|(field, e)| format!("item {text:?}: {field}: {e}"))?;
    Ok(item)
}

/// `resource[.group] namespace/name`, as Velero prints items.
pub fn item(r: &ResourceIdentifier) -> String {
    let gr = if r.group.is_empty() {
        r.resource.clone()
    } else {
        format!("{}.{}", r.resource, r.group)
    };
    if r.namespace.is_empty() {
        format!("{gr} {}", r.name)
    } else {
        format!("{gr} {}/{}", r.namespace, r.name)
    }
}

/// Left-aligned columns separated by two spaces.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            let _ = write!(text, "{cell:<w$}");
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut out, &mut headers.iter().copied());
    for row in rows {
        line(&mut out, &mut row.iter().map(String::as_str));
    }
    out
}

fn time(t: Option<Timestamp>) -> String {
    t.and_then(|t| {
        t.format(&time::format_description::well_known::Rfc3339)
            .ok()
    })
    .unwrap_or_else(|| "<n/a>".into())
}

pub fn owners(list: &[Owner]) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|o| {
            vec![
                o.name.clone(),
                o.phase.to_string(),
                format!("{}/{}", o.operations_completed, o.operations_attempted),
                o.operations_failed.to_string(),
                o.errors.to_string(),
                time(Some(o.created)),
            ]
        })
        .collect();
    table(
        &[
            "NAME",
            "PHASE",
            "OPERATIONS DONE",
            "FAILED",
            "ERRORS",
            "CREATED",
        ],
        &rows,
    )
}

/// `nCompleted/nTotal units (percent)`, or just the count when the total is unknown.
pub fn progress(op: &Operation) -> String {
    let units = if op.operation_units.is_empty() {
        String::new()
    } else {
        format!(" {}", op.operation_units)
    };
    if op.n_total > 0 {
        let percent = op.n_completed as f64 * 100.0 / op.n_total as f64;
        format!("{}/{}{units} ({percent:.0}%)", op.n_completed, op.n_total)
    } else {
        format!("{}{units}", op.n_completed)
    }
}

/// Rate and time left, from the progress seen between start and last update; `None`
/// until progress has moved.
pub fn rate_and_eta(op: &Operation) -> Option<String> {
    let (started, updated) = (op.started?, op.updated?);
    let seconds = (updated - started).as_seconds_f64();
    if seconds <= 0.0 || op.n_completed <= 0 {
        return None;
    }
    let rate = op.n_completed as f64 / seconds;
    let units = if op.operation_units.is_empty() {
        "units"
    } else {
        &op.operation_units
    };
    let mut text = format!("{} {units}/s", human(rate));
    if op.phase.is_unfinished() && op.n_total > op.n_completed {
        let left = (op.n_total - op.n_completed) as f64 / rate;
        let eta = GoDuration(std::time::Duration::from_secs(left.ceil() as u64));
        let _ = write!(text, ", about {eta} left");
    }
    Some(text)
}

/// A rate with at most three significant digits and a k/M/G suffix.
fn human(value: f64) -> String {
    let (scaled, suffix) = if value >= 1e9 {
        (value / 1e9, "G")
    } else if value >= 1e6 {
        (value / 1e6, "M")
    } else if value >= 1e3 {
        (value / 1e3, "k")
    } else {
        (value, "")
    };
    if scaled >= 100.0 {
        format!("{scaled:.0}{suffix}")
    } else if scaled >= 10.0 {
        format!("{scaled:.1}{suffix}")
    } else {
        format!("{scaled:.2}{suffix}")
    }
}

pub fn operations(ops: &[Operation]) -> String {
    let rows: Vec<Vec<String>> = ops
        .iter()
        .map(|op| {
            vec![
                op.operation_id.clone(),
                op.plugin.name.clone(),
                item(&op.resource),
                op.phase.to_string(),
                progress(op),
                op.error.clone(),
            ]
        })
        .collect();
    table(
        &[
            "OPERATION ID",
            "PLUGIN",
            "ITEM",
            "PHASE",
            "PROGRESS",
            "ERROR",
        ],
        &rows,
    )
}

/// `describe`: the owner, then (with details) each operation as Velero's
/// `backup describe --details` lists async operations.
pub fn describe(owner: &Owner, details: Option<&[Operation]>) -> String {
    let mut out = String::new();
    let field = |out: &mut String, label: &str, value: &dyn std::fmt::Display| {
        let _ = writeln!(out, "{label:<26}{value}");
    };
    field(&mut out, "Name:", &owner.name);
    field(&mut out, "Kind:", &owner.kind);
    field(&mut out, "UID:", &owner.uid);
    field(&mut out, "Phase:", &owner.phase);
    field(&mut out, "Errors:", &owner.errors);
    field(&mut out, "Warnings:", &owner.warnings);
    field(
        &mut out,
        "Item operation timeout:",
        &owner.item_operation_timeout,
    );
    field(&mut out, "Created:", &time(Some(owner.created)));
    field(&mut out, "Updated:", &time(Some(owner.updated)));
    field(&mut out, "Completed:", &time(owner.completed));
    field(
        &mut out,
        "Operations:",
        &format!(
            "{} attempted, {} completed, {} failed",
            owner.operations_attempted, owner.operations_completed, owner.operations_failed
        ),
    );
    if let Some(items) = owner
        .post_operation_items
        .as_ref()
        .filter(|i| !i.is_empty())
    {
        let _ = writeln!(out, "Items to update after operations:");
        for i in items {
            let _ = writeln!(out, "  {}", item(i));
        }
    }
    let Some(ops) = details else {
        return out;
    };
    for op in ops {
        let action = match op.plugin.kind {
            opmon_client::PluginKind::BackupItemAction => "Backup Item Action Plugin:",
            opmon_client::PluginKind::RestoreItemAction => "Restore Item Action Plugin:",
            opmon_client::PluginKind::VolumeSnapshotter => "Volume Snapshotter Plugin:",
        };
        let _ = writeln!(out, "\nOperation for {}:", item(&op.resource));
        let sub = |out: &mut String, label: &str, value: &dyn std::fmt::Display| {
            let _ = writeln!(out, "  {label:<28}{value}");
        };
        sub(&mut out, action, &op.plugin.name);
        sub(&mut out, "Operation ID:", &op.operation_id);
        if !op.post_operation_items.is_empty() {
            sub(&mut out, "Items to Update:", &"");
            for i in &op.post_operation_items {
                let _ = writeln!(out, "  {:<28}{}", "", item(i));
            }
        }
        sub(&mut out, "Phase:", &op.phase);
        sub(&mut out, "Progress:", &progress(op));
        if let Some(rate) = rate_and_eta(op) {
            sub(&mut out, "Rate:", &rate);
        }
        if !op.description.is_empty() {
            sub(&mut out, "Progress description:", &op.description);
        }
        sub(&mut out, "Created:", &time(Some(op.created)));
        sub(&mut out, "Started:", &time(op.started));
        sub(&mut out, "Updated:", &time(op.updated));
        if op.phase == OperationPhase::Failed {
            sub(&mut out, "Error:", &op.error);
        }
    }
    out
}

pub fn status(s: &AgentStatus) -> String {
    let mut out = format!(
        "version {}, up {}, {} unfinished operations, {} snapshotters\n",
        s.version, s.uptime, s.unfinished_operations, s.snapshotters
    );
    let rows: Vec<Vec<String>> = s
        .owners
        .iter()
        .map(|(phase, n)| vec![phase.to_string(), n.to_string()])
        .collect();
    if !rows.is_empty() {
        out.push_str(&table(&["PHASE", "OWNERS"], &rows));
    }
    out
}

pub fn snapshotters(list: &[Snapshotter]) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|s| {
            let target = match (&s.socket, &s.command) {
                (Some(socket), _) => socket.display().to_string(),
                (None, Some(command)) => command.join(" "),
                (None, None) => "-".into(),
            };
            vec![s.name.clone(), s.api_version.as_str().into(), target]
        })
        .collect();
    table(&["NAME", "API", "SOCKET OR COMMAND"], &rows)
}

pub fn item_operations(records: &[ItemOperation]) -> String {
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            let (id, plugin) = match &r.spec {
                opmon_client::ItemOperationSpec::Backup(s) => {
                    (&s.operation_id, &s.backup_item_action)
                }
                opmon_client::ItemOperationSpec::Restore(s) => {
                    (&s.operation_id, &s.restore_item_action)
                }
            };
            vec![
                id.clone(),
                plugin.clone(),
                r.status.phase.to_string(),
                format!("{}/{}", r.status.n_completed, r.status.n_total),
                r.status.error.clone(),
            ]
        })
        .collect();
    table(
        &["OPERATION ID", "PLUGIN", "PHASE", "PROGRESS", "ERROR"],
        &rows,
    )
}

/// The documented exit code for an owner in `phase`.
pub fn exit_code(phase: OwnerPhase) -> u8 {
    match phase {
        OwnerPhase::Failed | OwnerPhase::FailedValidation => 2,
        OwnerPhase::PartiallyFailed
        | OwnerPhase::WaitingForPluginOperationsPartiallyFailed
        | OwnerPhase::FinalizingPartiallyFailed => 1,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opmon_client::{PluginKind, PluginRef};
    use time::macros::datetime;

    fn op(n: i64, total: i64) -> Operation {
        Operation {
            plugin: PluginRef {
                kind: PluginKind::BackupItemAction,
                name: "example.io/copier".into(),
            },
            resource: parse_item("persistentvolumeclaims/app/data").unwrap(),
            operation_id: "copy-1".into(),
            post_operation_items: vec![],
            phase: OperationPhase::InProgress,
            error: String::new(),
            n_completed: n,
            n_total: total,
            operation_units: "bytes".into(),
            description: String::new(),
            created: datetime!(2026-01-01 0:00 UTC),
            started: Some(datetime!(2026-01-01 0:00 UTC)),
            updated: Some(datetime!(2026-01-01 0:00:10 UTC)),
            plugin_updated: Some(datetime!(2026-01-01 0:00:10 UTC)),
        }
    }

    #[test]
    fn items_parse_with_groups_and_without_namespaces() {
        let vsb = parse_item("volumesnapshotbackups.velero.io/app/vsb-1").unwrap();
        assert_eq!(
            (vsb.resource.as_str(), vsb.group.as_str()),
            ("volumesnapshotbackups", "velero.io")
        );
        assert_eq!(item(&vsb), "volumesnapshotbackups.velero.io app/vsb-1");
        let pv = parse_item("persistentvolumes/pv-1").unwrap();
        assert_eq!(
            (pv.namespace.as_str(), item(&pv).as_str()),
            ("", "persistentvolumes pv-1")
        );
        assert!(parse_item("pods")
            .unwrap_err()
            .contains("expected RESOURCE"));
        // Kubernetes names: RBAC's colons are fine, a '%' is not.
        assert!(
            parse_item("clusterroles.rbac.authorization.k8s.io/system:aggregate-to-admin").is_ok()
        );
        assert!(parse_item("pods/ns/50%")
            .unwrap_err()
            .starts_with("item \"pods/ns/50%\": name: must not contain '%'"));
    }

    #[test]
    fn progress_shows_counts_units_and_percent() {
        assert_eq!(progress(&op(25, 100)), "25/100 bytes (25%)");
        assert_eq!(progress(&op(7, 0)), "7 bytes");
    }

    #[test]
    fn rate_and_eta_come_from_start_and_last_update() {
        // 50 MB in 10 s: 5 MB/s, 50 MB left: 10 s.
        assert_eq!(
            rate_and_eta(&op(50_000_000, 100_000_000)).as_deref(),
            Some("5.00M bytes/s, about 10s left")
        );
        assert_eq!(
            rate_and_eta(&op(0, 100)),
            None,
            "no rate before progress moves"
        );
    }

    #[test]
    fn tables_align_columns() {
        let t = table(
            &["A", "LONG HEADER"],
            &[vec!["wide cell".into(), "x".into()]],
        );
        assert_eq!(t, "A          LONG HEADER\nwide cell  x\n");
    }

    #[test]
    fn exit_codes_follow_the_documented_phases() {
        assert_eq!(exit_code(OwnerPhase::Completed), 0);
        assert_eq!(exit_code(OwnerPhase::Finalizing), 0);
        assert_eq!(exit_code(OwnerPhase::FinalizingPartiallyFailed), 1);
        assert_eq!(exit_code(OwnerPhase::PartiallyFailed), 1);
        assert_eq!(exit_code(OwnerPhase::Failed), 2);
    }
}
