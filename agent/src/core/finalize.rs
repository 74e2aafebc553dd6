//! `finalize`: the last step of a backup (or an opted-in restore). With `contents`, the
//! backup tarball is rewritten with the updated items; then the item-operations file is
//! written, and only then does the owner move to its terminal phase. A failure at any
//! step leaves the owner in its Finalizing phase and no partial output behind, so the
//! backup server can simply call again. A repeated call after success returns the same
//! result.

use std::fs::File;
use std::path::PathBuf;

use opmon_client::{FinalizeParams, FinalizeResult, OwnerKind};
use serde::{Deserialize, Serialize};

use super::{now_ms, Core};
use crate::changes::Urgency;
use crate::error::Error;
use crate::phase;
use crate::storage::write_atomically;
use crate::store::queries;
use crate::tarball::{self, Updates};

/// What is stored of a finalize to answer a repeated one.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Stored {
    contents_file: Option<PathBuf>,
    replaced: u64,
    added: u64,
}

impl Core {
    pub async fn finalize(
        &self,
        kind: OwnerKind,
        p: FinalizeParams,
    ) -> Result<FinalizeResult, Error> {
        let name = p.name.clone();
        let (row, stored) = self
            .store
            .read(move |conn| {
                let row = queries::owner_by_name(conn, kind, &name)?
                    .ok_or_else(|| Error::NotFound(format!("{kind} {name} not found")))?;
                let stored = queries::finalize_result(conn, row.id)?;
                Ok::<_, Error>((row, stored))
            })
            .await?;
        let records_file = self.storage.item_operations_file(kind, &p.name);
        if let Some(text) = stored {
            let stored: Stored = serde_json::from_str(&text).map_err(|e| {
                Error::Finalize(format!(
                    "the stored result of {kind} {} is unreadable: {e}",
                    p.name
                ))
            })?;
            return Ok(FinalizeResult {
                owner: row.owner,
                item_operations_file: records_file,
                contents_file: stored.contents_file,
                replaced: stored.replaced,
                added: stored.added,
            });
        }
        if !row.owner.finalize || !row.owner.phase.is_finalizing() {
            return Err(Error::WrongPhase(format!(
                "{kind} {} is {}; finalize needs Finalizing or FinalizingPartiallyFailed",
                p.name, row.owner.phase
            )));
        }

        let mut stored = Stored {
            contents_file: None,
            replaced: 0,
            added: 0,
        };
        if let Some(contents) = &p.contents {
            let input = self
                .storage
                .resolve(&contents.input)
                .map_err(|e| Error::InvalidParams(format!("contents.input: {e}")))?;
            let output = self
                .storage
                .resolve(&contents.output)
                .map_err(|e| Error::InvalidParams(format!("contents.output: {e}")))?;
            if input == output {
                return Err(Error::InvalidParams(
                    "contents.output: must differ from contents.input".into(),
                ));
            }
            let updates = Updates::new(&p.updated_items).map_err(Error::InvalidParams)?;
            let limit = self.settings.max_decompressed_size;
            let target = output.clone();
            let outcome =
                tokio::task::spawn_blocking(move || rewrite_file(&input, &target, &updates, limit))
                    .await
                    .map_err(|e| Error::Finalize(format!("the rewrite stopped: {e}")))??;
            stored = Stored {
                contents_file: Some(output),
                replaced: outcome.replaced,
                added: outcome.added,
            };
        }
        let records_file = self.write_records(kind, &p.name).await?;

        let text = serde_json::to_string(&stored)
            .map_err(|e| Error::Finalize(format!("recording the result: {e}")))?;
        let now = now_ms();
        let name = p.name.clone();
        let (errors, warnings) = (p.errors, p.warnings);
        let owner = self
            .write(move |conn| {
                let mut current = queries::owner_by_name(conn, kind, &name)?
                    .ok_or_else(|| Error::NotFound(format!("{kind} {name} not found")))?;
                let next = phase::finalized(current.owner.phase, errors).ok_or_else(|| {
                    Error::WrongPhase(format!(
                        "{kind} {name} became {} during finalize",
                        current.owner.phase
                    ))
                })?;
                current.owner.phase = next;
                current.owner.errors = current.owner.errors.saturating_add(errors);
                current.owner.warnings = current.owner.warnings.saturating_add(warnings);
                queries::update_owner(conn, &current, now)?;
                queries::set_finalize_result(conn, current.id, &text)?;
                Ok::<_, Error>(queries::owner_by_id(conn, current.id)?.map(|r| r.owner))
            })
            .await?
            .ok_or_else(|| Error::NotFound(format!("{kind} {} not found", p.name)))?;
        tracing::info!(%kind, owner = %owner.name, phase = %owner.phase,
            replaced = stored.replaced, added = stored.added, "finalized");
        self.changes
            .notify(kind, &owner.name, Vec::new(), Urgency::Now);
        Ok(FinalizeResult {
            owner,
            item_operations_file: records_file,
            contents_file: stored.contents_file,
            replaced: stored.replaced,
            added: stored.added,
        })
    }
}

/// Rewrites `input` into `output` atomically.
fn rewrite_file(
    input: &std::path::Path,
    output: &std::path::Path,
    updates: &Updates,
    limit: u64,
) -> Result<tarball::Outcome, Error> {
    let source = File::open(input)
        .map_err(|e| Error::Finalize(format!("opening {}: {e}", input.display())))?;
    let mut outcome = None;
    let mut failure = None;
    let written = write_atomically(output, |out| {
        match tarball::rewrite(source, out, updates, limit) {
            Ok(o) => {
                outcome = Some(o);
                Ok(())
            }
            Err(e) => {
                let message = format!("{}: {e}", input.display());
                failure = Some(message.clone());
                Err(std::io::Error::other(message))
            }
        }
    });
    match (written, failure, outcome) {
        (_, Some(message), _) => Err(Error::Finalize(message)),
        (Err(e), None, _) => Err(Error::Finalize(e.to_string())),
        (Ok(()), None, Some(o)) => Ok(o),
        (Ok(()), None, None) => Err(Error::Finalize("the rewrite produced no result".into())),
    }
}
