//! `*.cancel`: cancelling a whole owner, or chosen operations of it, on request.
//!
//! The decision commits first: the chosen operations become Canceled (error
//! `canceled: <reason>`) with `cancelRequested` set, and an owner cancelled whole goes
//! to Failed with that reason, in one transaction. Cancel is then sent like every other
//! Cancel (batched per snapshotter, all at once, within one call deadline), and
//! `cancelRequested` is cleared when the calls are over, answered or abandoned. So a
//! snapshotter that never answers holds the request one call deadline at most and the
//! owner not at all; an agent that stops in between sends the Cancel calls again when
//! it starts ([`Core::resend_cancels`]).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use opmon_client::{
    Caller, CancelParams, CancelResult, EventReason, OperationSelector, OwnerKind, OwnerPhase,
    ResourceIdentifier,
};
use rusqlite::Connection;

use super::poll::{record_owner_phase, settle_owner, Cancels, Settle};
use super::{require, Core};
use crate::changes::Urgency;
use crate::clock::UnixMs;
use crate::error::{Error, NotFound, WrongPhase};
use crate::phase;
use crate::store::events::{self, NewEvent};
use crate::store::queries::{self, OperationKey, OwnerRow, PollTarget, Targets};

/// Up to this many operations named by one cancel are looked up one by one.
const LOOKUPS_ONE_BY_ONE: usize = 16;

/// Operations whose interrupted Cancel is sent again per step at a restart.
const RESEND_PAGE: i64 = 4096;

/// An item as messages name it: `persistentvolumeclaims ns/name` (with `.group` when
/// not the core group; without `ns/` when cluster-scoped).
pub(crate) fn item_text(r: &ResourceIdentifier) -> String {
    let resource = if r.group.is_empty() {
        r.resource.clone()
    } else {
        format!("{}.{}", r.resource, r.group)
    };
    if r.namespace.is_empty() {
        format!("{resource} {}", r.name)
    } else {
        format!("{resource} {}/{}", r.namespace, r.name)
    }
}

/// The rows `selectors` name among the owner's operations, each checked: it exists,
/// names one operation, and that operation is unfinished.
fn chosen_rows(
    conn: &Connection,
    row: &OwnerRow,
    selectors: &[OperationSelector],
) -> Result<BTreeSet<i64>, Error> {
    let (kind, name) = (row.owner.kind, row.owner.name.as_str());
    // Operation IDs have no index of their own: a few are looked up one by one (the
    // owner's index narrows each to its operations), many in one scan of them.
    let by_id: Option<HashMap<String, Vec<OperationKey>>> = if selectors.len() > LOOKUPS_ONE_BY_ONE
    {
        let mut map: HashMap<String, Vec<OperationKey>> = HashMap::new();
        for key in queries::operation_keys(conn, row.id, None)? {
            map.entry(key.operation_id.clone()).or_default().push(key);
        }
        Some(map)
    } else {
        None
    };
    let mut rows = BTreeSet::new();
    for (index, selector) in selectors.iter().enumerate() {
        let id = selector.operation_id();
        let mut found = match &by_id {
            Some(map) => map.get(id).cloned().unwrap_or_default(),
            None => queries::operation_keys(conn, row.id, Some(id))?,
        };
        if let OperationSelector::Item(o) = selector {
            found.retain(|k| k.resource == o.resource);
        }
        let key = match found.as_slice() {
            [] => {
                return Err(Error::NotFound(NotFound::Operation {
                    index,
                    kind,
                    name: name.to_string(),
                    operation: match selector {
                        OperationSelector::Id(id) => format!("{id:?}"),
                        OperationSelector::Item(o) => {
                            format!("{:?} of item {}", o.operation_id, item_text(&o.resource))
                        }
                    },
                }))
            }
            [one] => one,
            many => {
                let items: Vec<String> = many.iter().map(|k| item_text(&k.resource)).collect();
                return Err(Error::InvalidParams(format!(
                    "operations[{index}]: operation ID {id:?} names {} operations of {kind} \
                     {name} (items {}); give it as {{operationId, resource}} to say which",
                    many.len(),
                    items.join(", ")
                )));
            }
        };
        if !key.phase.is_unfinished() {
            return Err(Error::WrongPhase(WrongPhase::OperationFinished {
                index,
                kind,
                name: name.to_string(),
                operation_id: key.operation_id.clone(),
                item: item_text(&key.resource),
                phase: key.phase,
            }));
        }
        rows.insert(key.row);
    }
    Ok(rows)
}

/// Whether `*.cancel` may act on an owner in `phase`: while operations may still run
/// or be added. Finalizing owners have none left, terminal ones nothing at all.
fn cancelable(phase: OwnerPhase) -> bool {
    phase == OwnerPhase::InProgress || phase.is_waiting()
}

impl Core {
    /// `cancel`: see the module's doc.
    pub async fn cancel(
        self: &Arc<Self>,
        kind: OwnerKind,
        p: CancelParams,
        caller: Option<Caller>,
    ) -> Result<CancelResult, Error> {
        let reason = p
            .reason
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| phase::DEFAULT_CANCEL_REASON.to_string());
        let error = phase::canceled_because(&reason);
        let now = UnixMs::now();
        let name = p.name.clone();
        let whole = p.operations.is_none();
        let asked = reason.clone();
        let (owner_id, targets, canceled) = self
            .store
            .write(move |conn| {
                let mut row = require(conn, kind, &p.name)?;
                if !cancelable(row.owner.phase) {
                    return Err(Error::WrongPhase(WrongPhase::NotCancelable {
                        kind,
                        name: p.name,
                        phase: row.owner.phase,
                    }));
                }
                queries::touch_owner(conn, row.id, now)?;
                let unfinished = queries::poll_targets(conn, Targets::Owner(row.id))?;
                let chosen: BTreeSet<i64> = match &p.operations {
                    None => unfinished.iter().map(|t| t.row).collect(),
                    Some(selectors) => chosen_rows(conn, &row, selectors)?,
                };
                let rows: Vec<i64> = chosen.iter().copied().collect();
                let canceled = queries::cancel_operations(conn, row.id, &rows, &error, now)?;
                let set: HashSet<i64> = canceled.iter().copied().collect();
                let targets: Vec<PollTarget> = unfinished
                    .into_iter()
                    .filter(|t| set.contains(&t.row))
                    .collect();
                // The request, then what it changed, each an event of the owner.
                let what = if p.operations.is_none() {
                    format!("the whole {kind}")
                } else {
                    format!("{} of its operations", canceled.len())
                };
                let message = format!("cancel of {what} asked for: {asked}");
                let event = NewEvent::new(EventReason::CancelRequested, caller, &message);
                events::record(conn, row.id, &event, now)?;
                for t in &targets {
                    let message = format!(
                        "{} → {}: {error}",
                        t.state.phase,
                        opmon_client::OperationPhase::Canceled
                    );
                    let event = NewEvent::new(EventReason::OperationPhaseChanged, caller, &message);
                    events::record(conn, row.id, &event.about(t.row), now)?;
                }
                if p.operations.is_none() {
                    let was = row.owner.phase;
                    row.owner.phase = OwnerPhase::Failed;
                    row.owner.failure_reason = Some(error.clone());
                    queries::update_owner(conn, &row, now)?;
                    queries::mark_records_due(conn, row.id)?;
                    record_owner_phase(conn, &row, was, caller, now)?;
                } else if row.owner.phase.is_waiting() {
                    // Canceled operations count as failed ones: the owner moves on as
                    // after a poll that failed them.
                    let newly = u32::try_from(canceled.len()).unwrap_or(u32::MAX);
                    settle_owner(conn, row.id, newly, Settle::Poll, now)?;
                }
                // An InProgress owner counts them when it leaves InProgress.
                Ok::<_, Error>((row.id, targets, canceled))
            })
            .await?;
        tracing::info!(%kind, owner = %name, %reason, canceled = canceled.len(), whole,
            "cancel requested");
        for t in &targets {
            self.metrics
                .ended(&t.plugin.name, crate::metrics::Outcome::Canceled);
            tracing::warn!(owner = %name, plugin = %t.plugin.name, operation = %t.operation_id,
                %reason, "operation canceled");
        }
        self.changes
            .notify(kind, &name, canceled.clone(), Urgency::Now);
        // The file is marked due in the transaction; writing it need not hold up the
        // Cancel calls.
        let (_, cancels) = tokio::join!(
            self.refresh_records([(kind, name.clone())]),
            self.poller.cancel_each(&targets)
        );
        let unconfirmed = canceled
            .iter()
            .filter(|r| !cancels.confirmed.contains(r))
            .count() as u64;
        let (rows, gone) = (canceled.clone(), name.clone());
        let owner = self
            .store
            .write(move |conn| {
                queries::clear_cancel_requested(conn, &rows)?;
                // Deleted meanwhile: say so, as any request about a gone owner does.
                let row = queries::owner_by_id(conn, owner_id)?
                    .ok_or(Error::NotFound(NotFound::Deleted(kind, gone)))?;
                let message = CancelsOutcome::of(&rows, &cancels).message(("operation", ""));
                let event = NewEvent::new(EventReason::CancelSent, None, &message);
                events::record(conn, owner_id, &event, now)?;
                Ok::<_, Error>(row.owner)
            })
            .await?;
        tracing::info!(%kind, owner = %name, canceled = canceled.len(), unconfirmed,
            "cancel calls over");
        self.changes
            .notify(kind, &name, canceled.clone(), Urgency::Now);
        Ok(CancelResult {
            owner,
            canceled: canceled.len() as u64,
            unconfirmed,
        })
    }

    /// Sends Cancel for the unfinished operations of owners that just failed (their
    /// timeout, or the server's `endInProgress {failed: true}`), then records per owner
    /// how many the snapshotters confirmed. An owner deleted meanwhile has no history
    /// left to add to.
    pub(super) async fn cancel_failed(&self, targets: &[PollTarget]) {
        if targets.is_empty() {
            return;
        }
        let cancels = self.poller.cancel_each(targets).await;
        let mut per_owner: std::collections::BTreeMap<i64, Vec<i64>> = Default::default();
        for t in targets {
            per_owner.entry(t.owner_row).or_default().push(t.row);
        }
        let now = UnixMs::now();
        let written = self
            .store
            .write(move |conn| {
                for (owner, rows) in per_owner {
                    if queries::owner_by_id(conn, owner)?.is_none() {
                        continue;
                    }
                    let what = ("unfinished operation", " of the failed owner");
                    let message = CancelsOutcome::of(&rows, &cancels).message(what);
                    let event = NewEvent::new(EventReason::CancelSent, None, &message);
                    events::record(conn, owner, &event, now)?;
                }
                Ok::<_, Error>(())
            })
            .await;
        if let Err(e) = written {
            tracing::warn!(error = %e, "recording the cancels of failed owners");
        }
    }

    /// After a restart: sends Cancel again for the operations whose calls were out
    /// when the agent stopped, then clears their mark, a page at a time. In the
    /// background, so the agent answers at once.
    pub(super) fn resend_cancels(self: &Arc<Self>) {
        let core = self.clone();
        self.sweeps.spawn(async move {
            loop {
                let page = core
                    .store
                    .read(|conn| {
                        let which = Targets::CancelRequested { limit: RESEND_PAGE };
                        queries::poll_targets(conn, which).map_err(Error::from)
                    })
                    .await;
                let targets = match page {
                    Ok(targets) if targets.is_empty() => return,
                    Ok(targets) => targets,
                    Err(e) => {
                        tracing::warn!(error = %e, "finding interrupted cancels failed");
                        return;
                    }
                };
                tracing::info!(
                    operations = targets.len(),
                    "sending Cancel again for cancels interrupted by a stop"
                );
                tokio::select! {
                    _ = core.stopping.cancelled() => return,
                    _ = core.poller.cancel_each(&targets) => {}
                }
                let rows: Vec<i64> = targets.iter().map(|t| t.row).collect();
                let cleared = core
                    .store
                    .write(move |conn| {
                        queries::clear_cancel_requested(conn, &rows).map_err(Error::from)
                    })
                    .await;
                if let Err(e) = cleared {
                    // Left marked: the next start sends them again.
                    tracing::warn!(error = %e, "clearing cancelRequested failed");
                    return;
                }
            }
        });
    }
}

/// How an owner's Cancel calls came out: confirmed by their snapshotters, sent and not
/// confirmed, and not sent for want of a registered snapshotter (with its plugins).
#[derive(Debug, PartialEq)]
struct CancelsOutcome {
    confirmed: u64,
    unconfirmed: u64,
    not_sent: u64,
    unregistered: Vec<String>,
}

impl CancelsOutcome {
    /// The outcome for `rows`, out of all that `cancels` covered.
    fn of(rows: &[i64], cancels: &Cancels) -> CancelsOutcome {
        let confirmed = rows
            .iter()
            .filter(|r| cancels.confirmed.contains(r))
            .count() as u64;
        let missing: Vec<&String> = rows
            .iter()
            .filter_map(|r| cancels.not_sent.get(r))
            .collect();
        let not_sent = missing.len() as u64;
        let unregistered: BTreeSet<&String> = missing.into_iter().collect();
        CancelsOutcome {
            confirmed,
            unconfirmed: rows.len() as u64 - confirmed - not_sent,
            not_sent,
            unregistered: unregistered.into_iter().cloned().collect(),
        }
    }

    /// The `CancelSent` message, counting Cancel calls about `noun`s (`of` after the
    /// count): those sent in the subject, those not sent after them.
    fn message(&self, (noun, of): (&str, &str)) -> String {
        let sent_count = self.confirmed + self.unconfirmed;
        let sent = format!(
            "{} confirmed by their snapshotters, {} not",
            self.confirmed, self.unconfirmed
        );
        let nobody = format!(
            "no snapshotter registered for {}",
            self.unregistered.join(", ")
        );
        let what = |n| format!("{}{of}", super::counted(n, noun));
        match (sent_count, self.not_sent) {
            (n, 0) => format!("Cancel sent for {}: {sent}", what(n)),
            (0, n) => format!("Cancel not sent for {}: {nobody}", what(n)),
            (n, m) => format!(
                "Cancel sent for {}: {sent}; not sent for {m} more: {nobody}",
                what(n)
            ),
        }
    }
}
