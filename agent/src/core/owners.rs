//! The `backup.*` / `restore.*` requests, one implementation parameterised by kind.
//! Each checks the owner's phase inside the write transaction that changes it, so two
//! racing requests cannot both act on the same phase.

use std::sync::Arc;
use std::time::Duration;

use opmon_client::{
    AddOperationsParams, AddOperationsResult, Caller, DeleteResult, EndInProgressParams, EventList,
    EventReason, EventsParams, ItemOperation, ListParams, Operation, OperationsParams, Owner,
    OwnerKind, OwnerList, OwnerParams, OwnerPhase, StartParams, WaitParams, WaitResult,
};
use rusqlite::Connection;
use tokio::sync::broadcast::error::RecvError;

use super::poll::{apply_changes, record_owner_phase, settle_owner, Ended, Settle};
use super::{require, require_owner, Core};
use crate::changes::Urgency;
use crate::clock::UnixMs;
use crate::error::{Error, NotFound, Taken, WrongPhase};
use crate::phase;
use crate::store::events::{self, NewEvent};
use crate::store::queries::{self, NewOwner, OwnerRow, PollTarget, Targets};

/// Default `wait` timeout, as the API reference gives it (docs/architecture.md, "The API").
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);
/// Default and largest `list` page.
pub const DEFAULT_PAGE: u32 = 100;
/// The most owners `history` lists for one name.
pub const HISTORY_LIMIT: u32 = 1000;

fn require_in_progress(row: &OwnerRow, verb: &'static str) -> Result<(), Error> {
    require_phase_in_progress(row.owner.kind, &row.owner.name, row.owner.phase, verb)
}

fn require_phase_in_progress(
    kind: OwnerKind,
    name: &str,
    phase: OwnerPhase,
    verb: &'static str,
) -> Result<(), Error> {
    if phase == OwnerPhase::InProgress {
        Ok(())
    } else {
        Err(Error::WrongPhase(WrongPhase::NotInProgress {
            kind,
            name: name.to_string(),
            phase,
            request: verb,
        }))
    }
}

/// Fails an InProgress owner inside the caller's transaction: its unfinished operations
/// fail (Cancel is called for them after the commit: the returned targets), the owner
/// goes to Failed saying `reason`, and its item-operations file is marked due. Every
/// path to Failed goes through here, so none lacks a reason.
pub(super) fn fail_owner(
    conn: &Connection,
    row: &mut OwnerRow,
    reason: &str,
    caller: Option<Caller>,
    now: UnixMs,
) -> Result<Vec<PollTarget>, Error> {
    let targets = queries::poll_targets(conn, Targets::Owner(row.id))?;
    let cancelled =
        queries::fail_unfinished(conn, row.id, &phase::cancelled_with(row.owner.kind), now)?;
    let was = row.owner.phase;
    row.owner.phase = phase::leave_in_progress(row.owner.finalize, true, row.owner.errors, 0);
    row.owner.failure_reason = Some(reason.to_string());
    queries::update_owner(conn, row, now)?;
    queries::mark_records_due(conn, row.id)?;
    let mut recorded = row.clone();
    if cancelled > 0 {
        recorded.owner.failure_reason = Some(format!(
            "{reason} ({} failed and canceled)",
            super::counted(cancelled as u64, "unfinished operation")
        ));
    }
    record_owner_phase(conn, &recorded, was, caller, now)?;
    Ok(targets)
}

/// Reloads an owner after a change, with fresh counts and its aggregate progress.
fn reload(conn: &Connection, id: i64) -> Result<Owner, Error> {
    let row = queries::owner_by_id(conn, id)?.ok_or(Error::NotFound(NotFound::Vanished(id)))?;
    with_progress(conn, row)
}

/// The owner of `row` with its aggregate progress, as single-owner answers give it.
pub(super) fn with_progress(conn: &Connection, row: OwnerRow) -> Result<Owner, Error> {
    let mut owner = row.owner;
    owner.progress = Some(queries::owner_progress(conn, row.id)?);
    Ok(owner)
}

impl Core {
    /// `start`: creates the owner in InProgress. The same name and uid again returns the
    /// existing owner, so a backup server may retry safely. An owner is its backup
    /// server's object, name and uid: a new uid of a name retires the name's owner if
    /// that has ended (a server reuses a name once the object of that name is gone),
    /// and is refused while it has not (its operations are still monitored).
    pub async fn start(
        &self,
        kind: OwnerKind,
        p: StartParams,
        caller: Option<Caller>,
    ) -> Result<Owner, Error> {
        let timeout = p
            .item_operation_timeout
            .unwrap_or(self.settings.default_item_operation_timeout);
        let finalize = match kind {
            // A backup server that writes its own files (Velero, through
            // opmon-velero-plugin) starts its backups with `finalize: false`.
            OwnerKind::Backup => p.finalize.unwrap_or(true),
            OwnerKind::Restore => p.finalize.unwrap_or(self.settings.restore_finalize),
        };
        let now = UnixMs::now();
        // Serialized once here; the store keeps the text and polls parse it per owner.
        let object = p.object.as_ref().map(|o| o.to_string());
        let (owner, replaced) = self
            .store
            .write(move |conn| {
                let current = queries::owner_by_name(conn, kind, &p.name)?;
                if let Some(row) = current.as_ref().filter(|r| r.owner.uid == p.uid) {
                    // A repeated start is a call about the owner (a heartbeat for
                    // the idle timeout); nothing else changes.
                    queries::touch_owner(conn, row.id, now)?;
                    return Ok((with_progress(conn, row.clone())?, false));
                }
                if queries::owner_by_uid(conn, kind, &p.name, &p.uid)?.is_some() {
                    return Err(Error::AlreadyExists(Taken::Retired {
                        kind,
                        name: p.name,
                        uid: p.uid,
                    }));
                }
                let replaced = match current {
                    Some(row) if !row.owner.phase.is_terminal() => {
                        return Err(Error::AlreadyExists(Taken::NotEnded {
                            kind,
                            name: p.name,
                            uid: row.owner.uid,
                            phase: row.owner.phase,
                        }))
                    }
                    Some(row) => {
                        queries::retire_owner(conn, row.id, now)?;
                        let message =
                            format!("retired: {kind} {} was started with uid {}", p.name, p.uid);
                        let event = NewEvent::new(EventReason::Retired, caller, &message);
                        events::record(conn, row.id, &event, now)?;
                        Some(row.owner.uid)
                    }
                    None => None,
                };
                let new = NewOwner {
                    kind,
                    name: &p.name,
                    uid: &p.uid,
                    timeout,
                    finalize,
                    server: p.server.as_ref(),
                    object: object.as_deref(),
                    stall_timeout: p.stall_timeout,
                    start_timeout: p.start_timeout,
                };
                let id = queries::insert_owner(conn, &new, now)?;
                let mut message = format!(
                    "started in {} (itemOperationTimeout {timeout}, finalize {finalize})",
                    OwnerPhase::InProgress
                );
                if let Some(server) = &p.server {
                    message.push_str(&format!(
                        " by server {} instance {}",
                        server.name, server.instance
                    ));
                }
                if let Some(uid) = &replaced {
                    message.push_str(&format!(", taking the name from the ended uid {uid}"));
                    // The name's files were the retired owner's: this one's replace them.
                    queries::mark_records_due(conn, id)?;
                }
                let event = NewEvent::new(EventReason::Started, caller, &message);
                events::record(conn, id, &event, now)?;
                Ok((reload(conn, id)?, replaced.is_some()))
            })
            .await?;
        if replaced {
            tracing::info!(%kind, owner = %owner.name, uid = %owner.uid,
                "started, retiring the ended owner of its name");
            self.refresh_records([(kind, owner.name.clone())]).await;
        }
        self.changes
            .notify(kind, &owner.name, Vec::new(), Urgency::Now);
        Ok(owner)
    }

    /// `addOperations`: only while InProgress; idempotent on (plugin, operationId, item).
    pub async fn add_operations(
        &self,
        kind: OwnerKind,
        p: AddOperationsParams,
        caller: Option<Caller>,
    ) -> Result<AddOperationsResult, Error> {
        let now = UnixMs::now();
        let name = p.name.clone();
        let requested = p.operations.len() as u64;
        let added = self
            .store
            .write(move |conn| {
                let (id, phase, attempted) = queries::owner_phase_by_name(conn, kind, &p.name)?
                    .ok_or_else(|| Error::NotFound(NotFound::Owner(kind, p.name.clone())))?;
                require_phase_in_progress(kind, &p.name, phase, "addOperations")?;
                // Touches the owner too: one write of its row.
                let added = queries::insert_operations(conn, id, &p.operations, now)?;
                // A repeat that adds nothing changes nothing worth a line of history.
                if !added.is_empty() {
                    let message = format!(
                        "{} added ({} already known); {} in all",
                        super::counted(added.len() as u64, "operation"),
                        p.operations.len() - added.len(),
                        attempted + added.len() as u64
                    );
                    let event = NewEvent::new(EventReason::OperationsAdded, caller, &message);
                    events::record(conn, id, &event, now)?;
                }
                Ok::<_, Error>(added)
            })
            .await?;
        let count = added.len() as u64;
        if count > 0 {
            self.changes.notify(kind, &name, added, Urgency::Now);
        }
        Ok(AddOperationsResult {
            added: count,
            already_known: requested - count,
        })
    }

    /// `endInProgress`: fails the owner outright, or polls every operation once right
    /// then and settles the owner by the result.
    pub async fn end_in_progress(
        self: &Arc<Self>,
        kind: OwnerKind,
        p: EndInProgressParams,
        caller: Option<Caller>,
    ) -> Result<Owner, Error> {
        if p.failed {
            return self.fail(kind, p, caller).await;
        }
        let name = p.name.clone();
        let (row, targets) = self
            .store
            .read(move |conn| {
                let row = require(conn, kind, &name)?;
                require_in_progress(&row, "endInProgress")?;
                let targets = queries::poll_targets(conn, Targets::Owner(row.id))?;
                Ok::<_, Error>((row, targets))
            })
            .await?;
        // One call deadline in all: a snapshotter that does not answer leaves its
        // operations unfinished, saying so in `lastError`, for the sweep to poll on;
        // it never holds the owner in InProgress.
        let deadline = tokio::time::Instant::now() + self.poller.calls.deadline;
        let changes = self.poller.poll(targets, Some(deadline)).await;
        let changed: Vec<i64> = changes.iter().map(|c| c.target.row).collect();
        let now = UnixMs::now();
        let (owner, ended) = self
            .store
            .write(move |conn| {
                let current = require(conn, kind, &p.name)?;
                if current.id != row.id {
                    return Err(Error::WrongPhase(WrongPhase::ReplacedDuringEndInProgress {
                        kind,
                        name: p.name,
                    }));
                }
                require_in_progress(&current, "endInProgress")?;
                let mut ended = Vec::new();
                let newly_failed = apply_changes(conn, &changes, now, &mut ended)?
                    .get(&current.id)
                    .copied()
                    .unwrap_or(0);
                let how = Settle::EndInProgress {
                    errors: p.errors,
                    warnings: p.warnings,
                    caller,
                };
                settle_owner(conn, current.id, newly_failed, how, now)?;
                Ok::<_, Error>((reload(conn, current.id)?, ended))
            })
            .await?;
        Ended::report(&ended, &self.metrics);
        tracing::info!(%kind, owner = %owner.name, phase = %owner.phase, "left InProgress");
        self.refresh_records([(kind, owner.name.clone())]).await;
        self.changes
            .notify(kind, &owner.name, changed, Urgency::Now);
        Ok(owner)
    }

    /// `endInProgress {failed: true}`: Failed at once, then Cancel on every unfinished
    /// operation (which the agent stops monitoring).
    async fn fail(
        &self,
        kind: OwnerKind,
        p: EndInProgressParams,
        caller: Option<Caller>,
    ) -> Result<Owner, Error> {
        let now = UnixMs::now();
        let (owner, targets) = self
            .store
            .write(move |conn| {
                let mut row = require(conn, kind, &p.name)?;
                require_in_progress(&row, "endInProgress")?;
                row.owner.errors = p.errors;
                row.owner.warnings = p.warnings;
                let targets = fail_owner(conn, &mut row, phase::FAILED_BY_SERVER, caller, now)?;
                Ok::<_, Error>((reload(conn, row.id)?, targets))
            })
            .await?;
        let failed = vec![(
            kind,
            owner.name.clone(),
            owner.failure_reason.clone().unwrap_or_default(),
        )];
        self.announce_failed(&failed, &targets);
        self.cancel_failed(&targets).await;
        self.refresh_records([(kind, owner.name.clone())]).await;
        Ok(owner)
    }

    /// After the commit that failed `failed` (kind, name, reason): logs why and tells
    /// waiters. Cancel for `targets` and the files are the caller's to do next.
    pub(super) fn announce_failed(
        &self,
        failed: &[(OwnerKind, String, String)],
        targets: &[PollTarget],
    ) {
        for (kind, name, reason) in failed {
            let rows: Vec<i64> = targets
                .iter()
                .filter(|t| t.owner.kind == *kind && t.owner.name == *name)
                .map(|t| t.row)
                .collect();
            tracing::warn!(%kind, owner = %name, %reason, cancelling = rows.len(), "failed");
            self.changes.notify(*kind, name, rows, Urgency::Now);
        }
    }

    /// `get`: the owner with its aggregate progress.
    pub async fn get(&self, kind: OwnerKind, p: OwnerParams) -> Result<Owner, Error> {
        self.store
            .read(move |conn| {
                with_progress(conn, require_owner(conn, kind, &p.name, p.uid.as_deref())?)
            })
            .await
    }

    /// `history`: every owner that had the name, the current one first.
    pub async fn history(&self, kind: OwnerKind, name: String) -> Result<Vec<Owner>, Error> {
        self.store
            .read(move |conn| {
                let rows = queries::owners_of_name(conn, kind, &name, HISTORY_LIMIT)?;
                Ok(rows.into_iter().map(|r| r.owner).collect())
            })
            .await
    }

    /// `events`: a page of the owner's history, oldest first.
    pub async fn events(&self, kind: OwnerKind, p: EventsParams) -> Result<EventList, Error> {
        let limit = p.limit.unwrap_or(events::DEFAULT_PAGE);
        let mut items = self
            .store
            .read(move |conn| {
                let row = require_owner(conn, kind, &p.name, p.uid.as_deref())?;
                Ok::<_, Error>(events::page(conn, row.id, p.after.unwrap_or(0), limit + 1)?)
            })
            .await?;
        let more = items.len() > limit as usize;
        items.truncate(limit as usize);
        let next = items.last().filter(|_| more).map(|e| e.seq);
        Ok(EventList { items, next })
    }

    /// `list`: a page of owners by name, `next` set when more follow.
    pub async fn list(&self, kind: OwnerKind, p: ListParams) -> Result<OwnerList, Error> {
        let limit = p.limit.unwrap_or(DEFAULT_PAGE);
        let mut rows = self
            .store
            .read(move |conn| {
                queries::list_owners(
                    conn,
                    kind,
                    p.phases.as_deref(),
                    p.after.as_deref(),
                    limit + 1,
                )
                .map_err(Error::from)
            })
            .await?;
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let next = rows.last().filter(|_| more).map(|r| r.owner.name.clone());
        Ok(OwnerList {
            items: rows.into_iter().map(|r| r.owner).collect(),
            next,
        })
    }

    /// `operations`.
    pub async fn operations(
        &self,
        kind: OwnerKind,
        p: OperationsParams,
    ) -> Result<Vec<Operation>, Error> {
        self.store
            .read(move |conn| {
                let row = require_owner(conn, kind, &p.name, p.uid.as_deref())?;
                Ok(queries::operations(conn, row.id, p.phases.as_deref())?)
            })
            .await
    }

    /// `itemOperations`: the records of `-itemoperations.json.gz`.
    pub async fn item_operations(
        &self,
        kind: OwnerKind,
        p: OwnerParams,
    ) -> Result<Vec<ItemOperation>, Error> {
        self.store
            .read(move |conn| {
                let row = require_owner(conn, kind, &p.name, p.uid.as_deref())?;
                let ops = queries::operations(conn, row.id, None)?;
                Ok(ops
                    .iter()
                    .map(|op| ItemOperation::from_operation(&row.owner, op))
                    .collect())
            })
            .await
    }

    /// `wait`: until the owner reaches `until` or the timeout passes.
    pub async fn wait(&self, kind: OwnerKind, p: WaitParams) -> Result<WaitResult, Error> {
        // Subscribe before the first read, so no change can slip between them.
        let mut changed = self.changes.subscribe(kind, &p.name);
        let deadline = tokio::time::Instant::now() + p.timeout.map(|t| t.0).unwrap_or(DEFAULT_WAIT);
        loop {
            let owner = self.get(kind, OwnerParams::current(&p.name)).await?;
            if p.until.is_reached(owner.phase) {
                return Ok(WaitResult {
                    owner,
                    timed_out: false,
                });
            }
            let change = tokio::select! {
                change = tokio::time::timeout_at(deadline, changed.recv()) => change.map_err(|_| ()),
                // The agent is stopping: the wait ends now, as its timeout would.
                () = self.requests_stopping.cancelled() => Err(()),
            };
            match change {
                Err(()) => {
                    return Ok(WaitResult {
                        owner,
                        timed_out: true,
                    })
                }
                Ok(Ok(_)) | Ok(Err(RecvError::Lagged(_))) => {}
                Ok(Err(RecvError::Closed)) => changed = self.changes.subscribe(kind, &p.name),
            }
        }
    }

    /// `delete`: cancels the unfinished operations, then removes the owner (the one of
    /// `uid`, when given, current or retired).
    pub async fn delete(&self, kind: OwnerKind, p: OwnerParams) -> Result<DeleteResult, Error> {
        let key = p.clone();
        let (id, targets) = self
            .store
            .read(move |conn| {
                let row = require_owner(conn, kind, &key.name, key.uid.as_deref())?;
                let targets = queries::poll_targets(conn, Targets::Owner(row.id))?;
                Ok::<_, Error>((row.id, targets))
            })
            .await?;
        self.poller.cancel_each(&targets).await;
        let cancelled = targets.len() as u64;
        let key = p.clone();
        let removal = self
            .store
            .write(move |conn| {
                // The owner read above, though its name went to a new uid meanwhile.
                if queries::owner_by_id(conn, id)?.is_none() {
                    return Err(Error::NotFound(NotFound::Owner(kind, key.name)));
                }
                Ok::<_, Error>(queries::delete_owner(conn, id, kind, &key.name)?)
            })
            .await?;
        tracing::info!(%kind, owner = %p.name, cancelled, "deleted");
        self.remove_files(removal.into_iter().collect()).await;
        self.changes.notify(kind, &p.name, Vec::new(), Urgency::Now);
        Ok(DeleteResult::new(cancelled))
    }
}
