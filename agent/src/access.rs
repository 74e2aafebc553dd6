//! Who may talk to the agent: every connection's peer credentials (SO_PEERCRED) are
//! checked against the allowed uids and gids before a byte of it is read. The socket's
//! file mode and group are the first gate; this is the second, and the one that holds
//! when the socket must be reachable by more than one user.

use std::collections::HashSet;
use std::sync::Arc;

use opmon_client::server::Admission;
use tokio::net::UnixStream;

use crate::metrics::Metrics;

pub struct PeerCheck {
    uids: HashSet<u32>,
    gids: HashSet<u32>,
    metrics: Arc<Metrics>,
}

impl PeerCheck {
    pub fn new(uids: &[u32], gids: &[u32], metrics: Arc<Metrics>) -> PeerCheck {
        PeerCheck {
            uids: uids.iter().copied().collect(),
            gids: gids.iter().copied().collect(),
            metrics,
        }
    }
}

impl Admission for PeerCheck {
    fn admit(&self, stream: &UnixStream) -> bool {
        match stream.peer_cred() {
            Ok(cred) if self.uids.contains(&cred.uid()) || self.gids.contains(&cred.gid()) => true,
            Ok(cred) => {
                self.metrics.refused();
                tracing::warn!(
                    uid = cred.uid(),
                    gid = cred.gid(),
                    pid = cred.pid(),
                    "refused a connection: its uid and gid are not allowed"
                );
                false
            }
            Err(e) => {
                self.metrics.refused();
                tracing::warn!(error = %e, "refused a connection: no peer credentials");
                false
            }
        }
    }
}
