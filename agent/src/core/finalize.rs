//! `finalize`: the last step of a backup (or an opted-in restore). With `contents`, the
//! backup tarball is rewritten with the updated items; then the item-operations file is
//! written, and only then does the owner move to its terminal phase. A failure at any
//! step leaves the owner in its Finalizing phase and no partial output behind, so the
//! backup server can simply call again. A repeated call after success returns the same
//! result.
//!
//! Invariants:
//! - finalizes of one owner run one at a time (a second waits for the first, then
//!   returns its stored result), so two concurrent calls never both write;
//! - a finalize is bound to the owner it started for, by row and uid: if the owner is
//!   deleted and re-created (another uid) meanwhile, the output is not renamed into
//!   place and the new owner is not completed;
//! - an output is never another owner's finalized output: finalizes naming one output
//!   hold its lock from that check until the result is stored;
//! - a finalize is admitted (one of `caps::FINALIZES` over all peers) before
//!   it waits for its turn, or refused at once; its file work (open, rewrite, rename)
//!   runs on the [`FileWork`] pool under the `finalize_deadline`, confined by
//!   [`Confinement`]; shutdown stops it.

use std::io::BufWriter;
use std::path::PathBuf;
use std::time::Duration;

use opmon_client::{EventReason, FinalizeParams, FinalizeResult, OwnerKind};
use serde::{Deserialize, Serialize};

use super::name_locks::{KeyedLocks, NameLocks};
use super::{require, Core};
use crate::changes::Urgency;
use crate::clock::UnixMs;
use crate::confine::Confinement;
use crate::error::{Error, NotFound, WrongPhase};
use crate::filework::{Admitted, FileWork};
use crate::phase;
use crate::store::events::{self, NewEvent};
use crate::store::queries;
use crate::tarball::{self, RewriteError, Updates};

/// What the core needs to know to finalize with contents.
#[derive(Clone, Debug)]
pub struct FinalizeSettings {
    /// Directories besides the storage directory finalize may read and write in
    /// (absolute).
    pub dirs: Vec<PathBuf>,
    /// How long one finalize's file work may take.
    pub deadline: Duration,
    /// The agent's own places, which finalize never touches.
    pub state_dir: Option<PathBuf>,
    pub socket: Option<PathBuf>,
}

impl Default for FinalizeSettings {
    fn default() -> Self {
        FinalizeSettings {
            dirs: Vec::new(),
            deadline: Duration::from_secs(3600),
            state_dir: None,
            socket: None,
        }
    }
}

/// Finalize's share of the core: where it may write, the threads it writes on, whose
/// turn it is per owner, and which outputs are being put in place.
pub struct Finalizer {
    confinement: Confinement,
    pool: FileWork,
    deadline: Duration,
    turns: NameLocks,
    /// Held by output path from the check that no other owner's result names it until
    /// this owner's result is stored: finalizes of two owners naming one output take
    /// turns there, and the later is refused.
    outputs: KeyedLocks<PathBuf>,
}

impl Finalizer {
    pub fn new(storage: &std::path::Path, settings: &FinalizeSettings) -> Finalizer {
        Finalizer {
            confinement: Confinement::new(
                storage,
                &settings.dirs,
                settings.state_dir.as_deref(),
                settings.socket.as_deref(),
            ),
            pool: FileWork::start(crate::caps::FINALIZES),
            deadline: settings.deadline,
            turns: NameLocks::default(),
            outputs: KeyedLocks::default(),
        }
    }

    /// Where finalize writes: the storage directory and `finalize_dirs`.
    pub fn write_roots(&self) -> Vec<std::path::PathBuf> {
        self.confinement.write_roots()
    }

    /// Shutdown: running rewrites stop and their temporary outputs go.
    pub fn stop(&self) {
        self.pool.stop();
    }
}

/// What is stored of a finalize to answer a repeated one.
#[derive(Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Stored {
    contents_file: Option<PathBuf>,
    replaced: u64,
    added: u64,
}

impl Stored {
    fn result(self, owner: opmon_client::Owner, records_file: PathBuf) -> FinalizeResult {
        FinalizeResult {
            owner,
            item_operations_file: records_file,
            contents_file: self.contents_file,
            replaced: self.replaced,
            added: self.added,
        }
    }
}

/// The owner a finalize started for.
#[derive(Clone)]
struct Bound {
    id: i64,
    uid: String,
}

impl Bound {
    /// The owner named `name` (`row`, as read), refused when it is no longer the one
    /// bound.
    fn check(
        &self,
        kind: OwnerKind,
        name: &str,
        row: Option<queries::OwnerRow>,
    ) -> Result<queries::OwnerRow, Error> {
        match row {
            Some(row) if row.id == self.id && row.owner.uid == self.uid => Ok(row),
            Some(row) => Err(Error::Finalize(format!(
                "{kind} {name} was deleted and started again (uid {}) during this finalize of \
                 uid {}; nothing of it was kept",
                row.owner.uid, self.uid
            ))),
            None => Err(Error::NotFound(NotFound::DeletedDuringFinalize(
                kind,
                name.to_string(),
            ))),
        }
    }
}

impl Core {
    pub async fn finalize(
        &self,
        kind: OwnerKind,
        p: FinalizeParams,
        caller: Option<opmon_client::Caller>,
    ) -> Result<FinalizeResult, Error> {
        let admitted = self.finalizer.pool.admit()?;
        let name = p.name.clone();
        let mut bound = None;
        let began = std::time::Instant::now();
        let result = self
            .finalize_once(kind, p, caller, &admitted, &mut bound)
            .await;
        self.metrics.finalized(began.elapsed());
        if let Err(Error::Finalize(message)) = &result {
            // Only the caller hears the error: the log and the owner's history keep it
            // for whoever looks later.
            tracing::warn!(%kind, owner = %name, error = %message, "finalize failed");
            let message = phase::bounded(message.clone(), phase::MAX_ERROR);
            let recorded = self
                .store
                .write(move |conn| {
                    // The owner this finalize was for, not one started again under its
                    // name meanwhile.
                    let Some(bound) = bound else {
                        return Ok(());
                    };
                    let Ok(row) = bound.check(kind, &name, queries::owner_by_id(conn, bound.id)?)
                    else {
                        return Ok(());
                    };
                    let event = NewEvent {
                        reason: EventReason::FinalizeFailed,
                        operation: None,
                        caller,
                        message: &message,
                    };
                    events::record(conn, row.id, &event, UnixMs::now()).map_err(Error::from)
                })
                .await;
            if let Err(e) = recorded {
                tracing::warn!(error = %e, "recording a failed finalize");
            }
        }
        result
    }

    async fn finalize_once(
        &self,
        kind: OwnerKind,
        p: FinalizeParams,
        caller: Option<opmon_client::Caller>,
        admitted: &Admitted,
        bound_to: &mut Option<Bound>,
    ) -> Result<FinalizeResult, Error> {
        let _turn = self.finalizer.turns.lock(kind, &p.name).await;
        let name = p.name.clone();
        let (row, stored) = self
            .store
            .read(move |conn| {
                let row = require(conn, kind, &name)?;
                let stored = queries::finalize_result(conn, row.id)?;
                Ok::<_, Error>((row, stored))
            })
            .await?;
        let bound = Bound {
            id: row.id,
            uid: row.owner.uid.clone(),
        };
        *bound_to = Some(bound.clone());
        let records_file = self.storage.item_operations_file(kind, &p.name);
        if let Some(text) = stored {
            let stored: Stored = serde_json::from_str(&text).map_err(|e| {
                Error::Finalize(format!(
                    "the stored result of {kind} {} is unreadable: {e}",
                    p.name
                ))
            })?;
            return Ok(stored.result(row.owner, records_file));
        }
        if !row.owner.finalize || !row.owner.phase.is_finalizing() {
            return Err(Error::WrongPhase(WrongPhase::NotFinalizing {
                kind,
                name: p.name.clone(),
                phase: row.owner.phase,
            }));
        }

        let mut stored = Stored::default();
        let mut _output = None;
        if let Some(contents) = &p.contents {
            let updates = Updates::new(&p.updated_items).map_err(Error::InvalidParams)?;
            let (source, target) = self.resolve(admitted, contents).await?;
            // Refused before the input is read if another owner's result already names
            // it; checked again below, under the output's lock, for one finalized
            // meanwhile.
            self.check_output(kind, &p.name, &bound, &target.path, &contents.output)
                .await?;
            let (temp, outcome) = self
                .rewrite(admitted, contents, source, target, updates)
                .await?;
            let claim = self.finalizer.outputs.lock_key(temp.path().to_path_buf());
            _output = Some(claim.await);
            // Still the owner this started for? Otherwise the output never appears. Nor
            // does it over another owner's finalized output.
            self.check_output(kind, &p.name, &bound, temp.path(), &contents.output)
                .await?;
            let shown = temp.path().display().to_string();
            let output = self
                .finalizer
                .pool
                .run(
                    admitted,
                    &format!("renaming {shown} into place"),
                    self.finalizer.deadline,
                    move |_| {
                        temp.persist().map_err(|e| {
                            Error::Finalize(format!("renaming {shown} into place: {e}"))
                        })
                    },
                )
                .await?;
            stored = Stored {
                contents_file: Some(output),
                replaced: outcome.replaced,
                added: outcome.added,
            };
        }
        let records_file = self.write_records(kind, &p.name).await?;

        let text = serde_json::to_string(&stored)
            .map_err(|e| Error::Finalize(format!("recording the result: {e}")))?;
        let now = UnixMs::now();
        let name = p.name.clone();
        let (errors, warnings) = (p.errors, p.warnings);
        let owner = self
            .store
            .write(move |conn| {
                let mut current =
                    bound.check(kind, &name, queries::owner_by_name(conn, kind, &name)?)?;
                let next = phase::finalized(current.owner.phase, errors).ok_or_else(|| {
                    Error::WrongPhase(WrongPhase::ChangedDuringFinalize {
                        kind,
                        name: name.clone(),
                        phase: current.owner.phase,
                    })
                })?;
                let was = current.owner.phase;
                current.owner.phase = next;
                current.owner.errors = current.owner.errors.saturating_add(errors);
                current.owner.warnings = current.owner.warnings.saturating_add(warnings);
                queries::update_owner(conn, &current, now)?;
                queries::set_finalize_result(conn, current.id, &text)?;
                super::poll::record_owner_phase(conn, &current, was, caller, now)?;
                Ok::<_, Error>(queries::owner_by_id(conn, current.id)?.map(|r| r.owner))
            })
            .await?
            .ok_or_else(|| Error::NotFound(NotFound::Owner(kind, p.name.clone())))?;
        tracing::info!(%kind, owner = %owner.name, phase = %owner.phase,
            replaced = stored.replaced, added = stored.added, "finalized");
        self.changes
            .notify(kind, &owner.name, Vec::new(), Urgency::Now);
        Ok(stored.result(owner, records_file))
    }

    /// Whether `bound` is still the owner `name`, and `path` is no other owner's
    /// finalized output.
    async fn check_output(
        &self,
        kind: OwnerKind,
        name: &str,
        bound: &Bound,
        path: &std::path::Path,
        given: &std::path::Path,
    ) -> Result<(), Error> {
        let name = name.to_string();
        let check = bound.clone();
        let path = path.to_path_buf();
        let given = given.to_path_buf();
        self.store
            .read(move |conn| {
                let row = queries::owner_by_name(conn, kind, &name)?;
                check.check(kind, &name, row)?;
                match queries::owner_with_contents_file(conn, &path, check.id)? {
                    None => Ok(()),
                    Some((other_kind, other)) => Err(Error::Finalize(format!(
                        "contents.output {}: the finalized output of {other_kind} {other}; \
                         choose another path",
                        given.display()
                    ))),
                }
            })
            .await
    }

    /// Opens `contents.input` and finds where `contents.output` goes, refusing outputs
    /// the agent's own files or temporary names would clash with.
    async fn resolve(
        &self,
        admitted: &Admitted,
        contents: &opmon_client::Contents,
    ) -> Result<(std::fs::File, crate::confine::OutputTarget), Error> {
        let confinement = self.finalizer.confinement.clone();
        let storage = self.storage.clone();
        let (input, output) = (contents.input.clone(), contents.output.clone());
        let what = format!("opening {}", input.display());
        self.finalizer
            .pool
            .run(admitted, &what, self.finalizer.deadline, move |_| {
                let (source, _) = confinement.open_input("contents.input", &input)?;
                let target = confinement.output("contents.output", &output)?;
                let named = target.path.file_name().map(|n| n.to_string_lossy());
                if named.is_some_and(|n| crate::storage_dir::is_temp_name(&n)) {
                    return Err(Error::Finalize(format!(
                        "contents.output {}: named like the agent's temporary files \
                         ({}*{}), which it removes when it starts; choose another name",
                        output.display(),
                        crate::storage_dir::TEMP_PREFIX,
                        crate::storage_dir::TEMP_SUFFIX
                    )));
                }
                if let Some((kind, name)) = storage.item_operations_owner(&target.path) {
                    return Err(Error::Finalize(format!(
                        "contents.output {}: the item operations file of {kind} {name}, \
                         which the agent writes; choose another path",
                        output.display()
                    )));
                }
                Ok((source, target))
            })
            .await
    }

    /// Rewrites `contents.input` into a temporary file beside `contents.output`, on the
    /// file-work pool; the caller renames it into place.
    async fn rewrite(
        &self,
        admitted: &Admitted,
        contents: &opmon_client::Contents,
        source: std::fs::File,
        target: crate::confine::OutputTarget,
        updates: Updates,
    ) -> Result<(crate::confine::TempOutput, tarball::Outcome), Error> {
        let (input, output) = (contents.input.clone(), contents.output.clone());
        let limit = self.settings.max_decompressed_size;
        let what = format!("the rewrite of {}", input.display());
        self.finalizer
            .pool
            .run(admitted, &what, self.finalizer.deadline, move |job| {
                let mut temp = target.create_temp().map_err(|e| {
                    Error::Finalize(format!(
                        "contents.output {}: creating a temporary file beside it: {e}",
                        output.display()
                    ))
                })?;
                job.register(&temp);
                let written = {
                    let file = temp.file().map_err(|e| Error::Finalize(e.to_string()))?;
                    let out = BufWriter::with_capacity(256 * 1024, file);
                    tarball::rewrite_until(source, out, &updates, limit, job.stop())
                };
                match written {
                    Ok(outcome) => Ok((temp, outcome)),
                    Err(RewriteError::Stopped) => Err(Error::Finalize(format!(
                        "the rewrite of {} was stopped at the finalize deadline",
                        input.display()
                    ))),
                    Err(e) => Err(Error::Finalize(format!("{}: {e}", input.display()))),
                }
            })
            .await
    }
}
