//! How results look to a person: tables, `describe`, progress text. Pure functions of
//! the API's types, so every format is unit-tested. Every string that came from outside
//! (names, IDs, descriptions, errors) goes through [`clean`], so no cell can move the
//! cursor, recolour the terminal or start a line of its own.

use std::borrow::Cow;
use std::fmt::Write;

use opmon_client::{
    AgentStatus, Event, GoDuration, ItemOperation, Operation, OperationPhase, Owner, OwnerPhase,
    ResourceIdentifier, ServerStartedResult, Snapshotter, Timestamp,
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

/// Text from outside, control characters escaped.
/// `n` and `noun`, plural unless `n` is 1: "1 operation", "2 operations".
pub fn counted(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

pub fn clean(text: &str) -> Cow<'_, str> {
    opmon_client::text::escape_controls(text)
}

/// `resource[.group]`, as Go's `schema.GroupResource` prints itself.
fn group_resource(r: &ResourceIdentifier) -> String {
    if r.group.is_empty() {
        clean(&r.resource).into_owned()
    } else {
        format!("{}.{}", clean(&r.resource), clean(&r.group))
    }
}

/// `resource[.group] namespace/name` (or `… name` when cluster-scoped).
pub fn item(r: &ResourceIdentifier) -> String {
    if r.namespace.is_empty() {
        format!("{} {}", group_resource(r), clean(&r.name))
    } else {
        format!(
            "{} {}/{}",
            group_resource(r),
            clean(&r.namespace),
            clean(&r.name)
        )
    }
}

/// `resource[.group] namespace/name` exactly as Velero's describers print an item,
/// `/name` included when there is no namespace.
fn velero_item(r: &ResourceIdentifier) -> String {
    format!(
        "{} {}/{}",
        group_resource(r),
        clean(&r.namespace),
        clean(&r.name)
    )
}

/// Left-aligned columns separated by two spaces: [`tabwrite`] of the rows, each line
/// without trailing spaces.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut text = headers.join("\t");
    for row in rows {
        text.push('\n');
        text.push_str(&row.join("\t"));
    }
    tabwrite(&text)
        .lines()
        .map(|line| format!("{}\n", line.trim_end()))
        .collect()
}

/// One column of a [`columns`] table: its header and how a cell of it reads.
type Column<'a, T> = (&'a str, &'a dyn Fn(&T) -> String);

/// A [`table`] of `items`, one row each, with `columns`.
pub fn columns<T>(items: &[T], columns: &[Column<'_, T>]) -> String {
    let headers: Vec<&str> = columns.iter().map(|(header, _)| *header).collect();
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|item| columns.iter().map(|(_, cell)| cell(item)).collect())
        .collect();
    table(&headers, &rows)
}

/// Owners as `kubectl get` lists objects: how old each is in the `AGE` column.
pub fn owners(list: &[Owner], now: Timestamp) -> String {
    columns(
        list,
        &[
            ("NAME", &|o| clean(&o.name).into_owned()),
            ("PHASE", &|o| o.phase.to_string()),
            ("OPERATIONS DONE", &operations_done),
            ("FAILED", &|o| o.operations_failed.to_string()),
            ("ERRORS", &|o| o.errors.to_string()),
            ("AGE", &|o| age(o.created, now)),
        ],
    )
}

fn operations_done(o: &Owner) -> String {
    format!("{}/{}", o.operations_completed, o.operations_attempted)
}

/// The last error of `op` while it is unfinished or after it failed (why it waits, or
/// what came before its failure), cleaned; `None` if it has none, it is the failure's
/// own error, or the operation ended otherwise (a completed one keeps an old one).
pub fn last_error(op: &Operation) -> Option<Cow<'_, str>> {
    let last = op.last_error.as_deref()?;
    let shown = op.phase.is_unfinished() || op.phase == OperationPhase::Failed;
    (shown && op.error.as_deref() != Some(last)).then(|| clean(last))
}

/// The owners that had one name (`history`): by uid, the current one marked so, the
/// retired ones with the age of their retirement.
pub fn history(list: &[Owner], now: Timestamp) -> String {
    columns(
        list,
        &[
            ("UID", &|o| clean(&o.uid).into_owned()),
            ("PHASE", &|o| o.phase.to_string()),
            ("OPERATIONS DONE", &operations_done),
            ("FAILED", &|o| o.operations_failed.to_string()),
            ("AGE", &|o| age(o.created, now)),
            ("RETIRED", &|o| {
                o.retired.map_or_else(|| "current".into(), |t| age(t, now))
            }),
        ],
    )
}

/// `nCompleted/nTotal units (percent)`, or just the count when the total is unknown.
pub fn progress(op: &Operation) -> String {
    let units = if op.operation_units.is_empty() {
        String::new()
    } else {
        format!(" {}", clean(&op.operation_units))
    };
    if op.n_total > 0 {
        let percent = op.n_completed as f64 * 100.0 / op.n_total as f64;
        format!("{}/{}{units} ({percent:.0}%)", op.n_completed, op.n_total)
    } else {
        format!("{}{units}", op.n_completed)
    }
}

/// The agent's smoothed rate of `op` and, while it runs, the time left by its ETA
/// counted from `now`, or `finishing` once all of it is done but the snapshotter has not
/// said it completed (the agent has no ETA then); `None` until there is either.
pub fn rate_and_eta(op: &Operation, now: Timestamp) -> Option<String> {
    let done = op.n_total > 0 && op.n_completed >= op.n_total;
    let mut parts = Vec::new();
    if let Some(rate) = op.rate {
        parts.push(rate_text(rate, &op.operation_units));
    }
    if op.phase.is_unfinished() {
        match op.eta {
            Some(eta) if !done => parts.push(time_left(eta, now)),
            _ if done => parts.push("finishing".into()),
            _ => {}
        }
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// Whether `units` are bytes, which are shown as the progress bars show them (KiB, MiB).
pub fn is_bytes(units: &str) -> bool {
    matches!(units, "byte" | "bytes" | "B")
}

/// A rate in `units` per second: bytes as `16.00 MiB/s` (one style with the bars'
/// `MiB`), anything else as `3.20k files/s`.
fn rate_text(rate: f64, units: &str) -> String {
    if is_bytes(units) {
        format!("{}/s", indicatif::HumanBytes(rate.max(0.0) as u64))
    } else if units.is_empty() {
        format!("{} units/s", human(rate))
    } else {
        format!("{} {}/s", human(rate), clean(units))
    }
}

/// `about 1m5s left` until `eta`, or `overdue by 5s` once it has passed: the ETA was
/// made from the last sample that moved, so a stalled operation shows as overdue.
pub fn time_left(eta: Timestamp, now: Timestamp) -> String {
    let seconds = |d: time::Duration| {
        GoDuration(std::time::Duration::from_secs(
            d.whole_seconds().unsigned_abs(),
        ))
    };
    if eta >= now {
        format!(
            "about {} left",
            seconds(eta - now + time::Duration::milliseconds(999))
        )
    } else {
        format!("overdue by {}", seconds(now - eta))
    }
}

/// The owner's aggregate rate per unit and its ETA (`10.0M bytes/s, 3 items/s, about
/// 2m0s left`); `None` when it has no rate in any unit and no ETA.
pub fn owner_rate(owner: &Owner, now: Timestamp) -> Option<String> {
    let progress = owner.progress.as_ref()?;
    let mut parts: Vec<String> = progress
        .units
        .iter()
        .filter_map(|u| Some(rate_text(u.rate?, &u.units)))
        .collect();
    if let Some(eta) = progress.eta {
        parts.push(time_left(eta, now));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// How long ago `t` was, as kubectl's `Age` column: the largest two units (`45s`,
/// `3m20s`, `5h2m`, `3d4h`).
pub fn age(t: Timestamp, now: Timestamp) -> String {
    let s = (now - t).whole_seconds().max(0);
    let (d, h, m, sec) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{sec}s"),
        (0, 0, _) if sec == 0 => format!("{m}m"),
        (0, 0, _) => format!("{m}m{sec}s"),
        (0, _, 0) => format!("{h}h"),
        (0, _, _) => format!("{h}h{m}m"),
        (_, 0, _) => format!("{d}d"),
        _ => format!("{d}d{h}h"),
    }
}

/// Who caused an event: `uid 1000 pid 4242` for a call, `agent` for what the agent did.
fn event_source(e: &Event) -> String {
    match e.caller {
        Some(c) => format!("uid {} pid {}", c.uid, c.pid),
        None => "agent".into(),
    }
}

/// The operation an event is about, or `-`.
fn event_operation(e: &Event) -> String {
    e.operation.as_ref().map_or_else(
        || "-".into(),
        |o| format!("{} {}", item(&o.resource), clean(&o.operation_id)),
    )
}

/// An owner's events as `kubectl describe` ends with them: a table of age, reason,
/// source, operation and message, oldest first. `omitted` earlier events are said in
/// the title (they are in `opmon backup|restore events`).
pub fn events(events: &[Event], omitted: usize, now: Timestamp) -> String {
    if events.is_empty() {
        return "\nEvents:  <none>\n".into();
    }
    let title = if omitted > 0 {
        format!("\nEvents (the last {}; {omitted} earlier):\n", events.len())
    } else {
        "\nEvents:\n".to_string()
    };
    let mut out = title;
    let table = columns(
        events,
        &[
            ("AGE", &|e| age(e.time, now)),
            ("REASON", &|e| e.reason.to_string()),
            ("FROM", &event_source),
            ("OPERATION", &event_operation),
            ("MESSAGE", &|e| clean(&e.message).into_owned()),
        ],
    );
    for line in table.lines() {
        let _ = writeln!(out, "  {line}");
    }
    out
}

/// Events as `opmon backup events` lists them: with their number and time.
pub fn event_list(events: &[Event]) -> String {
    columns(
        events,
        &[
            ("SEQ", &|e| e.seq.to_string()),
            ("TIME", &|e| velero_time(e.time)),
            ("REASON", &|e| e.reason.to_string()),
            ("FROM", &event_source),
            ("OPERATION", &event_operation),
            ("MESSAGE", &|e| clean(&e.message).into_owned()),
        ],
    )
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
    columns(
        ops,
        &[
            ("OPERATION ID", &|op| clean(&op.operation_id).into_owned()),
            ("PLUGIN", &|op| clean(&op.plugin.name).into_owned()),
            ("ITEM", &|op| item(&op.resource)),
            ("PHASE", &|op| op.phase.to_string()),
            ("PROGRESS", &progress),
            ("ERROR", &|op| {
                clean(op.error.as_deref().unwrap_or("")).into_owned()
            }),
            ("LAST ERROR", &|op| {
                last_error(op).unwrap_or_default().into_owned()
            }),
        ],
    )
}

/// Go's `text/tabwriter` as Velero's describers set it up (`minwidth 0, padding 2`),
/// by the tabwriter crate, a port of it. Cells hold no tab or newline of their own
/// (everything from outside went through [`clean`]). The crate measures a cell by its
/// display width, Go by its characters: the two align alike but for wide (CJK, emoji)
/// or combining characters, which the crate lines up as a terminal shows them.
pub fn tabwrite(text: &str) -> String {
    use std::io::Write;
    let mut w = tabwriter::TabWriter::new(Vec::new()).minwidth(0).padding(2);
    // Writing to memory cannot fail.
    let _ = w.write_all(text.as_bytes());
    let bytes = w.into_inner().unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A time as Velero's describers print a `metav1.Time`: Go's `Time.String()` of a
/// second-precision time in the local zone (`TZ`, else `/etc/localtime`), e.g.
/// `2026-11-22 10:57:45 +0100 CET`.
fn velero_time(t: Timestamp) -> String {
    let second = t.unix_timestamp();
    match jiff::Timestamp::from_second(second) {
        Ok(ts) => ts
            .to_zoned_datetime(local_zone())
            .strftime("%Y-%m-%d %H:%M:%S %z %Z")
            .to_string(),
        // Outside jiff's range (a time a snapshotter reported at the ends of `time`'s):
        // UTC, in the same form.
        Err(_) => t
            .to_offset(time::UtcOffset::UTC)
            .format(time::macros::format_description!(
                "[year]-[month]-[day] [hour]:[minute]:[second] +0000 UTC"
            ))
            .unwrap_or_default(),
    }
}

/// The zone times are printed in: the system's; UTC in the unit tests, whose expected
/// texts must not depend on the machine.
fn local_zone() -> jiff::tz::TimeZone {
    if cfg!(test) {
        jiff::tz::TimeZone::UTC
    } else {
        jiff::tz::TimeZone::system()
    }
}

/// One operation as `velero backup|restore describe --details` prints it, then the
/// agent's extras (rate, time left).
fn describe_operation(out: &mut String, op: &Operation, now: Timestamp) {
    let action = match op.plugin.kind {
        opmon_client::PluginKind::BackupItemAction => "Backup Item Action Plugin:",
        opmon_client::PluginKind::RestoreItemAction => "Restore Item Action Plugin:",
        opmon_client::PluginKind::VolumeSnapshotter => "Volume Snapshotter Plugin:",
        // A kind of a newer agent's.
        opmon_client::PluginKind::Unknown => "Plugin:",
    };
    let _ = writeln!(out, "\tOperation for {}:", velero_item(&op.resource));
    let _ = writeln!(out, "\t\t{action}\t{}", clean(&op.plugin.name));
    let _ = writeln!(out, "\t\tOperation ID:\t{}", clean(&op.operation_id));
    if !op.post_operation_items.is_empty() {
        let _ = writeln!(out, "\t\tItems to Update:");
    }
    for i in &op.post_operation_items {
        let _ = writeln!(out, "\t\t\t{}", velero_item(i));
    }
    let _ = writeln!(out, "\t\tPhase:\t{}", op.phase);
    if let Some(error) = &op.error {
        let _ = writeln!(out, "\t\tOperation Error:\t{}", clean(error));
    }
    if op.n_total > 0 || op.n_completed > 0 {
        let _ = writeln!(
            out,
            "\t\tProgress:\t{} of {} complete ({})",
            op.n_completed,
            op.n_total,
            clean(&op.operation_units)
        );
    }
    if !op.description.is_empty() {
        let _ = writeln!(out, "\t\tProgress description:\t{}", clean(&op.description));
    }
    let _ = writeln!(out, "\t\tCreated:\t{}", velero_time(op.created));
    if let Some(t) = op.started {
        let _ = writeln!(out, "\t\tStarted:\t{}", velero_time(t));
    }
    // Velero prints the plugin's own Updated (the agent's change time is its own).
    if let Some(t) = op.plugin_updated {
        let _ = writeln!(out, "\t\tUpdated:\t{}", velero_time(t));
    }
    if let Some(rate) = rate_and_eta(op, now) {
        let _ = writeln!(out, "\t\tRate:\t{rate}");
    }
    // What the agent adds: why an operation is waiting, and what it is waiting for.
    if op.attempts > 0 {
        let _ = writeln!(
            out,
            "\t\tTransient errors:\t{} retried, the last: {}",
            op.attempts,
            clean(op.last_error.as_deref().unwrap_or(""))
        );
    }
    // With no retry, the last error is why the snapshotter could not be reached: an
    // operation that waits for it looks otherwise as if it were running.
    if let (0, Some(error)) = (op.attempts, &op.last_error) {
        let _ = writeln!(out, "\t\tLast error:\t{}", clean(error));
    }
    if let Some(t) = op.next_attempt_at {
        let _ = writeln!(out, "\t\tNext attempt:\t{}", velero_time(t));
    }
    if op.cancel_requested {
        let _ = writeln!(
            out,
            "\t\tCancel:\tsent, not yet answered by the snapshotter"
        );
    }
}

/// `describe`: the owner, then its item operations as Velero's describers show them: a
/// summary line without `--details`, every operation with it.
pub fn describe(owner: &Owner, details: Option<&[Operation]>, now: Timestamp) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Name:\t{}", clean(&owner.name));
    let _ = writeln!(out, "Kind:\t{}", owner.kind);
    let _ = writeln!(out, "UID:\t{}", clean(&owner.uid));
    let _ = writeln!(out, "Phase:\t{}", owner.phase);
    if let Some(reason) = &owner.failure_reason {
        let _ = writeln!(out, "Failure Reason:\t{}", clean(reason));
    }
    if let Some(server) = &owner.server {
        let _ = writeln!(
            out,
            "Server:\t{} (instance {})",
            clean(&server.name),
            clean(&server.instance)
        );
    }
    let _ = writeln!(out, "Errors:\t{}", owner.errors);
    let _ = writeln!(out, "Warnings:\t{}", owner.warnings);
    let _ = writeln!(
        out,
        "ItemOperationTimeout:\t{}",
        owner.item_operation_timeout
    );
    let _ = writeln!(out, "Created:\t{}", velero_time(owner.created));
    let _ = writeln!(out, "Updated:\t{}", velero_time(owner.updated));
    if let Some(t) = owner.completed {
        let _ = writeln!(out, "Completed:\t{}", velero_time(t));
    }
    if let Some(t) = owner.retired {
        let _ = writeln!(out, "Retired:\t{} (a new uid has the name)", velero_time(t));
    }
    if let Some(rate) = owner_rate(owner, now) {
        let _ = writeln!(out, "Rate:\t{rate}");
    }
    if let Some(items) = owner
        .post_operation_items
        .as_ref()
        .filter(|i| !i.is_empty())
    {
        let _ = writeln!(out, "Items to update after operations:");
        for i in items {
            let _ = writeln!(out, "\t{}", item(i));
        }
    }
    let title = match owner.kind {
        opmon_client::OwnerKind::Backup => "Backup Item Operations:",
        opmon_client::OwnerKind::Restore => "Restore Item Operations:",
    };
    if owner.operations_attempted > 0 {
        out.push('\n');
        match details {
            None => {
                let _ = writeln!(
                    out,
                    "{title}\t{} of {} completed successfully, {} failed (specify --details for more information)",
                    owner.operations_completed,
                    owner.operations_attempted,
                    owner.operations_failed
                );
            }
            Some(ops) => {
                let _ = writeln!(out, "{title}");
                for op in ops {
                    describe_operation(&mut out, op, now);
                }
            }
        }
    }
    tabwrite(&out)
}

pub fn status(s: &AgentStatus) -> String {
    let mut out = format!(
        "version {}, up {}, {}, {}\n",
        s.version,
        s.uptime,
        counted(s.unfinished_operations, "unfinished operation"),
        counted(s.snapshotters, "snapshotter")
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
    columns(
        list,
        &[
            ("NAME", &|s| clean(&s.name).into_owned()),
            ("API", &|s| s.api_version.as_str().into()),
            ("SOCKET OR COMMAND", &|s| clean(&target(s)).into_owned()),
        ],
    )
}

/// Where a snapshotter is reached: its socket, its command, or a Velero plugin binary
/// (marked as such) with its arguments.
fn target(s: &Snapshotter) -> String {
    match (&s.socket, &s.command, &s.velero_plugin) {
        (Some(socket), _, _) => socket.display().to_string(),
        (None, Some(command), _) => command.join(" "),
        (None, None, Some(plugin)) => {
            std::iter::once(format!("velero_plugin {}", plugin.display()))
                .chain(s.args.iter().flatten().cloned())
                .collect::<Vec<_>>()
                .join(" ")
        }
        (None, None, None) => "-".into(),
    }
}

pub fn item_operations(records: &[ItemOperation]) -> String {
    let spec = |r: &ItemOperation| match &r.spec {
        opmon_client::ItemOperationSpec::Backup(s) => (
            clean(&s.operation_id).into_owned(),
            clean(&s.backup_item_action).into_owned(),
        ),
        opmon_client::ItemOperationSpec::Restore(s) => (
            clean(&s.operation_id).into_owned(),
            clean(&s.restore_item_action).into_owned(),
        ),
    };
    columns(
        records,
        &[
            ("OPERATION ID", &|r| spec(r).0),
            ("PLUGIN", &|r| spec(r).1),
            ("PHASE", &|r| r.status.phase.to_string()),
            ("PROGRESS", &|r| {
                format!("{}/{}", r.status.n_completed, r.status.n_total)
            }),
            ("ERROR", &|r| clean(&r.status.error).into_owned()),
        ],
    )
}

/// The documented exit code for an owner in `phase`.
/// `server started`: which owners the agent failed.
pub fn server_started(name: &str, instance: &str, r: &ServerStartedResult) -> String {
    let server = if name.is_empty() {
        "the server of owners started without one".to_string()
    } else {
        format!("server {}", clean(name))
    };
    let mut text = format!(
        "{server} runs as {}: {}\n",
        clean(instance),
        match r.failed.len() {
            0 => "nothing failed".to_string(),
            1 => "1 backup or restore failed".to_string(),
            n => format!("{n} backups and restores failed"),
        }
    );
    for o in &r.failed {
        text.push_str(&format!(
            "{} {} (uid {}) failed\n",
            o.kind,
            clean(&o.name),
            clean(&o.uid)
        ));
    }
    text
}

/// The exit code an owner's phase gives every command that reads or moves one: 0, 1
/// PartiallyFailed or on its way there, 2 Failed.
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
    use opmon_client::{OperationPhase, PluginKind, PluginRef};
    use time::macros::datetime;

    #[test]
    fn times_past_the_time_zone_database_print_in_utc_in_the_same_form() {
        assert_eq!(
            velero_time(datetime!(2026-11-22 09:57:45 UTC)),
            "2026-11-22 09:57:45 +0000 UTC"
        );
        assert_eq!(
            velero_time(datetime!(9999-12-31 23:59:59 UTC)),
            "9999-12-31 23:59:59 +0000 UTC"
        );
        assert_eq!(
            velero_time(datetime!(-9999-01-01 00:00:05 UTC)),
            "-9999-01-01 00:00:05 +0000 UTC"
        );
    }

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
            error: None,
            n_completed: n,
            n_total: total,
            operation_units: "bytes".into(),
            description: String::new(),
            created: datetime!(2026-01-01 0:00 UTC),
            started: Some(datetime!(2026-01-01 0:00 UTC)),
            updated: Some(datetime!(2026-01-01 0:00:10 UTC)),
            plugin_updated: Some(datetime!(2026-01-01 0:00:10 UTC)),
            cancel_requested: false,
            attempts: 0,
            last_error: None,
            next_attempt_at: None,
            // What the agent would say of n units in the 10 s since the start.
            rate: (n > 0).then(|| n as f64 / 10.0),
            eta: (n > 0 && total > n).then(|| {
                datetime!(2026-01-01 0:00:10 UTC)
                    + time::Duration::seconds_f64((total - n) as f64 * 10.0 / n as f64)
            }),
        }
    }

    /// When the tests look: at the operations' last update.
    const NOW: Timestamp = datetime!(2026-01-01 0:00:10 UTC);

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
        // Kubernetes names are path segments: Velero's own items carry
        // upper case and underscores, but never '%'.
        assert!(parse_item("pods/ns/Odd_Name").is_ok());
        assert!(parse_item("pods/ns/a%2Fb")
            .unwrap_err()
            .starts_with("item \"pods/ns/a%2Fb\": name:"));
    }

    #[test]
    fn progress_shows_counts_units_and_percent() {
        assert_eq!(progress(&op(25, 100)), "25/100 bytes (25%)");
        assert_eq!(progress(&op(7, 0)), "7 bytes");
    }

    #[test]
    fn an_operation_at_100_percent_says_it_is_finishing() {
        // All of it copied, the snapshotter not yet done: the agent has no ETA.
        let mut done = op(100_000_000, 100_000_000);
        assert_eq!(done.eta, None);
        assert_eq!(
            rate_and_eta(&done, NOW).as_deref(),
            Some("9.54 MiB/s, finishing")
        );
        done.rate = None;
        assert_eq!(rate_and_eta(&done, NOW).as_deref(), Some("finishing"));
        done.phase = OperationPhase::Completed;
        assert_eq!(rate_and_eta(&done, NOW), None);
    }

    #[test]
    fn rates_use_the_bars_units_for_bytes() {
        assert_eq!(rate_text(16_777_216.0, "bytes"), "16.00 MiB/s");
        assert_eq!(rate_text(16_777_216.0, "B"), "16.00 MiB/s");
        assert_eq!(rate_text(3_200.0, "files"), "3.20k files/s");
        assert_eq!(rate_text(2.0, ""), "2.00 units/s");
    }

    #[test]
    fn owners_are_listed_with_their_age() {
        let mut owner = owner(opmon_client::OwnerKind::Backup, 2, 1, 0);
        owner.created = NOW - time::Duration::seconds(3 * 3600 + 25 * 60);
        let text = owners(&[owner], NOW);
        assert!(text.lines().next().unwrap_or("").ends_with("AGE"), "{text}");
        assert!(
            text.lines().nth(1).unwrap_or("").ends_with("3h25m"),
            "{text}"
        );
    }

    #[test]
    fn rate_and_eta_are_the_agents() {
        // 5 MB/s, 50 MB left: 10 s from the last sample.
        assert_eq!(
            rate_and_eta(&op(50_000_000, 100_000_000), NOW).as_deref(),
            Some("4.77 MiB/s, about 10s left")
        );
        let later = NOW + time::Duration::seconds(4);
        assert_eq!(
            rate_and_eta(&op(50_000_000, 100_000_000), later).as_deref(),
            Some("4.77 MiB/s, about 6s left")
        );
        let stalled = NOW + time::Duration::seconds(75);
        assert_eq!(
            rate_and_eta(&op(50_000_000, 100_000_000), stalled).as_deref(),
            Some("4.77 MiB/s, overdue by 1m5s")
        );
        assert_eq!(
            rate_and_eta(&op(0, 100), NOW),
            None,
            "no rate before the agent has one"
        );
        let mut unknown_total = op(50, 0);
        unknown_total.operation_units = String::new();
        assert_eq!(
            rate_and_eta(&unknown_total, NOW).as_deref(),
            Some("5.00 units/s"),
            "no ETA without a total"
        );
    }

    #[test]
    fn an_owners_rate_is_per_unit_with_the_latest_eta() {
        let mut o = owner(opmon_client::OwnerKind::Backup, 3, 0, 0);
        assert_eq!(owner_rate(&o, NOW), None, "an older agent's owner");
        o.progress = Some(opmon_client::OwnerProgress {
            units: vec![
                opmon_client::UnitsProgress {
                    units: "bytes".into(),
                    operations: 2,
                    n_completed: 10,
                    n_total: 100,
                    rate: Some(12_500_000.0),
                },
                opmon_client::UnitsProgress {
                    units: "".into(),
                    operations: 1,
                    n_completed: 1,
                    n_total: 0,
                    rate: None,
                },
            ],
            eta: Some(NOW + time::Duration::seconds(120)),
        });
        assert_eq!(
            owner_rate(&o, NOW).as_deref(),
            Some("11.92 MiB/s, about 2m0s left")
        );
    }

    #[test]
    fn ages_show_the_two_largest_units() {
        let ago = |s: i64| age(NOW - time::Duration::seconds(s), NOW);
        assert_eq!(
            [
                ago(0),
                ago(45),
                ago(60),
                ago(200),
                ago(7200),
                ago(7500),
                ago(86_400 * 3 + 3600 * 4)
            ],
            ["0s", "45s", "1m", "3m20s", "2h", "2h5m", "3d4h"]
        );
        assert_eq!(ago(-5), "0s", "a clock ahead is no negative age");
    }

    #[test]
    fn events_end_describe_as_kubectl_shows_them() {
        let event = |seq: u64, reason: &str, caller, message: &str| Event {
            seq,
            time: NOW - time::Duration::seconds(90),
            reason: reason.parse().unwrap_or(opmon_client::EventReason::Unknown),
            operation: None,
            caller,
            message: message.into(),
        };
        let mut failed = event(3, "OperationFailed", None, "disk\u{1b}[2J gone");
        failed.operation = Some(opmon_client::EventOperation {
            plugin: PluginRef {
                kind: PluginKind::BackupItemAction,
                name: "example.io/copier".into(),
            },
            resource: parse_item("persistentvolumeclaims/app/data").unwrap(),
            operation_id: "copy-1".into(),
        });
        let caller = Some(opmon_client::Caller {
            uid: 1000,
            pid: 4242,
        });
        let list = [event(2, "Started", caller, "started in InProgress"), failed];
        assert_eq!(
            events(&list, 1, NOW),
            "\nEvents (the last 2; 1 earlier):\n\
             \x20 AGE    REASON           FROM               OPERATION                               MESSAGE\n\
             \x20 1m30s  Started          uid 1000 pid 4242  -                                       started in InProgress\n\
             \x20 1m30s  OperationFailed  agent              persistentvolumeclaims app/data copy-1  disk\\x1b[2J gone\n"
        );
        assert_eq!(events(&[], 0, NOW), "\nEvents:  <none>\n");
    }

    #[test]
    fn tables_align_columns() {
        let t = table(
            &["A", "LONG HEADER"],
            &[vec!["wide cell".into(), "x".into()]],
        );
        assert_eq!(t, "A          LONG HEADER\nwide cell  x\n");
    }

    fn owner(kind: opmon_client::OwnerKind, attempted: u64, completed: u64, failed: u64) -> Owner {
        Owner {
            kind,
            name: "nightly".into(),
            uid: "u-1".into(),
            phase: OwnerPhase::WaitingForPluginOperationsPartiallyFailed,
            item_operation_timeout: GoDuration::from_secs(4 * 3600),
            stall_timeout: None,
            start_timeout: None,
            finalize: true,
            errors: 1,
            warnings: 0,
            operations_attempted: attempted,
            operations_completed: completed,
            operations_failed: failed,
            post_operation_items: None,
            server: None,
            failure_reason: None,
            created: datetime!(2026-01-01 0:00 UTC),
            updated: datetime!(2026-01-01 0:00:30.5 UTC),
            completed: None,
            progress: None,
            retired: None,
        }
    }

    #[test]
    fn describe_without_details_prints_veleros_summary_line() {
        let text = describe(&owner(opmon_client::OwnerKind::Backup, 6, 3, 3), None, NOW);
        assert_eq!(
            text,
            "Name:                  nightly\n\
             Kind:                  backup\n\
             UID:                   u-1\n\
             Phase:                 WaitingForPluginOperationsPartiallyFailed\n\
             Errors:                1\n\
             Warnings:              0\n\
             ItemOperationTimeout:  4h0m0s\n\
             Created:               2026-01-01 00:00:00 +0000 UTC\n\
             Updated:               2026-01-01 00:00:30 +0000 UTC\n\
             \n\
             Backup Item Operations:  3 of 6 completed successfully, 3 failed (specify --details for more information)\n"
        );
    }

    #[test]
    fn describe_details_prints_operations_as_velero_then_the_rate() {
        let mut copying = op(50_000_000, 100_000_000);
        copying.description = "copying".into();
        copying.post_operation_items =
            vec![parse_item("volumesnapshotbackups.velero.io/app/vsb-1").unwrap()];
        let mut failed = op(0, 0);
        failed.operation_id = "copy-2".into();
        failed.resource = parse_item("persistentvolumes/pv-1").unwrap();
        failed.phase = OperationPhase::Failed;
        failed.error = Some("disk\u{1b}[2J gone\nforged".into());
        failed.started = None;
        failed.plugin_updated = None;
        let text = describe(
            &owner(opmon_client::OwnerKind::Backup, 2, 0, 1),
            Some(&[copying, failed]),
            NOW,
        );
        let operations = text.split_once("\n\n").unwrap().1;
        assert_eq!(
            operations,
            "Backup Item Operations:\n\
             \x20 Operation for persistentvolumeclaims app/data:\n\
             \x20   Backup Item Action Plugin:  example.io/copier\n\
             \x20   Operation ID:               copy-1\n\
             \x20   Items to Update:\n\
             \x20                          volumesnapshotbackups.velero.io app/vsb-1\n\
             \x20   Phase:                 InProgress\n\
             \x20   Progress:              50000000 of 100000000 complete (bytes)\n\
             \x20   Progress description:  copying\n\
             \x20   Created:               2026-01-01 00:00:00 +0000 UTC\n\
             \x20   Started:               2026-01-01 00:00:00 +0000 UTC\n\
             \x20   Updated:               2026-01-01 00:00:10 +0000 UTC\n\
             \x20   Rate:                  4.77 MiB/s, about 10s left\n\
             \x20 Operation for persistentvolumes /pv-1:\n\
             \x20   Backup Item Action Plugin:  example.io/copier\n\
             \x20   Operation ID:               copy-2\n\
             \x20   Phase:                      Failed\n\
             \x20   Operation Error:            disk\\x1b[2J gone\\nforged\n\
             \x20   Created:                    2026-01-01 00:00:00 +0000 UTC\n"
        );
    }

    #[test]
    fn describe_details_say_why_a_snapshotter_could_not_be_reached() {
        let mut waiting = op(10, 100);
        waiting.last_error =
            Some("snapshotter example.io/x at /run/x.sock: Connection refused".into());
        let text = describe(
            &owner(opmon_client::OwnerKind::Backup, 1, 0, 0),
            Some(&[waiting]),
            NOW,
        );
        assert_eq!(
            text.lines().last(),
            Some("    Last error:                 snapshotter example.io/x at /run/x.sock: Connection refused"),
            "{text}"
        );
    }

    #[test]
    fn describe_details_say_what_an_operation_is_waiting_for() {
        let mut retrying = op(10, 100);
        retrying.attempts = 2;
        retrying.last_error = Some("snapshotter busy\u{1b}[2J".into());
        retrying.next_attempt_at = Some(datetime!(2026-01-01 0:00:14 UTC));
        retrying.cancel_requested = true;
        let text = describe(
            &owner(opmon_client::OwnerKind::Backup, 1, 0, 0),
            Some(&[retrying]),
            NOW,
        );
        let tail: Vec<&str> = text.lines().rev().take(3).collect();
        assert_eq!(
            tail,
            [
                "    Cancel:                     sent, not yet answered by the snapshotter",
                "    Next attempt:               2026-01-01 00:00:14 +0000 UTC",
                "    Transient errors:           2 retried, the last: snapshotter busy\\x1b[2J",
            ]
        );
        // An operation without any shows none of the three.
        let plain = describe(
            &owner(opmon_client::OwnerKind::Backup, 1, 0, 0),
            Some(&[op(10, 100)]),
            NOW,
        );
        assert!(
            !plain.contains("Transient")
                && !plain.contains("Next attempt")
                && !plain.contains("Cancel:"),
            "{plain}"
        );
    }

    #[test]
    fn restores_describe_with_their_own_words() {
        let mut restoring = op(10, 100);
        restoring.plugin.kind = PluginKind::RestoreItemAction;
        restoring.operation_units = String::new();
        restoring.started = None;
        restoring.plugin_updated = None;
        (restoring.rate, restoring.eta) = (None, None);
        let summary = describe(&owner(opmon_client::OwnerKind::Restore, 1, 0, 0), None, NOW);
        assert!(summary.ends_with(
            "\nRestore Item Operations:  0 of 1 completed successfully, 0 failed (specify --details for more information)\n"
        ), "{summary}");
        let details = describe(
            &owner(opmon_client::OwnerKind::Restore, 1, 0, 0),
            Some(&[restoring]),
            NOW,
        );
        assert!(
            details.ends_with(
                "\nRestore Item Operations:\n\
             \x20 Operation for persistentvolumeclaims app/data:\n\
             \x20   Restore Item Action Plugin:  example.io/copier\n\
             \x20   Operation ID:                copy-1\n\
             \x20   Phase:                       InProgress\n\
             \x20   Progress:                    10 of 100 complete ()\n\
             \x20   Created:                     2026-01-01 00:00:00 +0000 UTC\n"
            ),
            "{details}"
        );
        // No operations, no operations section (as Velero).
        assert!(!describe(
            &owner(opmon_client::OwnerKind::Restore, 0, 0, 0),
            Some(&[]),
            NOW
        )
        .contains("Item Operations"));
    }

    #[test]
    fn tabwrite_pads_each_run_of_lines_sharing_a_column() {
        // Go: tabwriter.NewWriter(w, 0, 8, 2, ' ', 0) on the same input.
        assert_eq!(
            tabwrite("a:\tx\nlonger:\ty\nno tabs\nb:\tz\n"),
            "a:       x\nlonger:  y\nno tabs\nb:  z\n"
        );
        assert_eq!(tabwrite("\tin\n\t\tk:\tv\n"), "  in\n    k:  v\n");
    }

    #[test]
    fn cells_from_outside_cannot_drive_the_terminal() {
        let mut evil = op(1, 2);
        evil.operation_id = "id\u{1b}]0;title\u{7}".into();
        evil.error = Some("line\r\nforged\tcell".into());
        let table = operations(&[evil]);
        assert!(
            !table.chars().any(|c| c.is_control() && c != '\n'),
            "{table:?}"
        );
        assert!(table.contains("id\\x1b]0;title\\x07"), "{table}");
        assert!(table.contains("line\\r\\nforged\\tcell"), "{table}");
        assert_eq!(table.lines().count(), 2);
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
