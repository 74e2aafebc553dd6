//! What the agent does about backup servers that went away: `server.started`, by which
//! a restarted server fails the InProgress owners its earlier instances left (as Velero
//! does at start-up, in its words), and the optional idle timeout, which fails an
//! InProgress owner its server has not called about for too long.
//!
//! Both commit the failures in one transaction, then call Cancel on the unfinished
//! operations and write the files in the background (the files are marked due in that
//! transaction, so a crash loses none). Owners of other servers, and owners in any other
//! phase, are never touched.

use std::sync::Arc;

use opmon_client::{FailedOwner, GoDuration, OwnerKind, ServerStartedParams, ServerStartedResult};
use time::format_description::well_known::Rfc3339;

use super::owners::fail_owner;
use super::Core;
use crate::clock::UnixMs;
use crate::error::Error;
use crate::phase;
use crate::store::queries::{self, PollTarget};

impl Core {
    /// `server.started`: fails every InProgress owner of server `name` that an instance
    /// other than `instance` started. Idempotent: a second call finds none.
    pub async fn server_started(
        self: &Arc<Self>,
        p: ServerStartedParams,
        caller: Option<opmon_client::Caller>,
    ) -> Result<ServerStartedResult, Error> {
        let now = UnixMs::now();
        let (failed, owners, targets) = self
            .store
            .write(move |conn| {
                let (mut failed, mut owners, mut targets) = (Vec::new(), Vec::new(), Vec::new());
                for id in queries::in_progress_of_other_instances(conn, &p.name, &p.instance)? {
                    let Some(mut row) = queries::owner_by_id(conn, id)? else {
                        continue;
                    };
                    let reason = phase::server_restarted_reason(row.owner.kind);
                    targets.extend(fail_owner(conn, &mut row, &reason, caller, now)?);
                    let o = row.owner;
                    failed.push((o.kind, o.name.clone(), reason));
                    owners.push(FailedOwner {
                        kind: o.kind,
                        name: o.name,
                        uid: o.uid,
                    });
                }
                Ok::<_, Error>((failed, owners, targets))
            })
            .await?;
        self.finish_failing(failed, targets);
        Ok(ServerStartedResult { failed: owners })
    }

    /// Fails the InProgress owners no call has touched for `in_progress_idle_timeout`
    /// (when set). Time before this agent started does not count: while it was down, a
    /// server could not call.
    pub(super) async fn fail_idle(self: &Arc<Self>) {
        let Some(timeout) = self.settings.in_progress_idle_timeout else {
            return;
        };
        let now = UnixMs::now();
        let before = now.before(timeout);
        if before <= self.started_at {
            return;
        }
        let idle = self
            .store
            .read(move |conn| queries::idle_in_progress(conn, before).map_err(Error::from))
            .await;
        match idle {
            Ok(idle) if idle.is_empty() => return,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "looking for idle InProgress owners failed");
                return;
            }
        }
        let limit = GoDuration(timeout);
        let committed = self
            .store
            .write(move |conn| {
                let mut failed = Vec::new();
                let mut targets = Vec::new();
                // Read again in the transaction: a call may have come meanwhile.
                for (id, last_call) in queries::idle_in_progress(conn, before)? {
                    let Some(mut row) = queries::owner_by_id(conn, id)? else {
                        continue;
                    };
                    let since = last_call
                        .time()
                        .format(&Rfc3339)
                        .unwrap_or_else(|_| last_call.ms().to_string());
                    let reason = phase::idle_reason(&since, limit);
                    targets.extend(fail_owner(conn, &mut row, &reason, None, now)?);
                    failed.push((row.owner.kind, row.owner.name, reason));
                }
                Ok::<_, Error>((failed, targets))
            })
            .await;
        match committed {
            Ok((failed, targets)) => self.finish_failing(failed, targets),
            Err(e) => tracing::warn!(error = %e, "failing idle InProgress owners failed"),
        }
    }

    /// After the commit that failed `failed`: logs and announces them, then calls Cancel
    /// and writes their files in the background.
    fn finish_failing(
        self: &Arc<Self>,
        failed: Vec<(OwnerKind, String, String)>,
        targets: Vec<PollTarget>,
    ) {
        if failed.is_empty() {
            return;
        }
        self.announce_failed(&failed, &targets);
        let core = self.clone();
        self.sweeps.spawn(async move {
            core.cancel_failed(&targets).await;
            core.refresh_records(failed.into_iter().map(|(kind, name, _)| (kind, name)))
                .await;
        });
    }
}
