//! Who may talk to the agent, and how much of it one peer may take.
//!
//! Every connection's peer credentials (SO_PEERCRED, and SO_PEERGROUPS for the
//! supplementary groups) are checked before a byte of it is read. The socket's file
//! mode and group are the first gate; this is the second, and the one that holds when
//! the socket must be reachable by more than one user.
//!
//! Invariants:
//! - The agent's own uid and root are always admitted: `allowed_uids`/`allowed_gids`
//!   only add peers, so no setting locks the operator (and the probes run as the
//!   agent's user) out.
//! - A peer is admitted if its uid is allowed, or its primary or any supplementary
//!   group is in `allowed_gids`. The groups are those the peer had when it connected.
//! - No uid holds more than `max_connections_per_uid` connections at once (the one
//!   per-uid bound, as systemd's varlink has), and uids other than root and the agent's
//!   own hold at most [`crate::caps::CONNECTIONS`] together: the operator can always connect.
//! - A refused peer gets HTTP 403 (not allowed) or 429 (over a limit) with a JSON-RPC
//!   error naming the rule (answered by the server within a bounded time), and the
//!   refusal is counted and logged within a [`LogLimit`], so a refused peer cannot
//!   flood the log.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use tokio::net::UnixStream;

use super::server::{Admission, Refusal};
use crate::caps::{Cap, Held};
use crate::log_limit::LogLimit;
use crate::metrics::Metrics;

/// Whether `uid` is root or the agent's own: the operator.
pub fn is_operator(uid: u32) -> bool {
    uid == 0 || uid == nix::unistd::geteuid().as_raw()
}

/// JSON-RPC error code of a refused connection (the implementation-defined server
/// error range of JSON-RPC 2.0).
pub const REFUSED: i32 = -32003;

/// `SO_PEERGROUPS` (Linux ≥ 4.13); the libc crate does not export it for every target.
#[cfg(target_arch = "sparc64")]
const SO_PEERGROUPS: nix::libc::c_int = 0x003d;
#[cfg(not(target_arch = "sparc64"))]
const SO_PEERGROUPS: nix::libc::c_int = 59;

/// The supplementary groups the peer of `stream` had when it connected.
fn peer_groups(stream: &UnixStream) -> std::io::Result<Vec<u32>> {
    let fd = stream.as_raw_fd();
    let mut groups: Vec<nix::libc::gid_t> = vec![0; 64];
    // Twice at most: the first answer says how big the list is if it did not fit.
    for _ in 0..2 {
        let mut len =
            (groups.len() * std::mem::size_of::<nix::libc::gid_t>()) as nix::libc::socklen_t;
        // SAFETY: `groups` is a live buffer of `len` bytes; the kernel writes at most
        // `len` bytes into it and sets `len` to the size it wrote (or needs).
        let rc = unsafe {
            nix::libc::getsockopt(
                fd,
                nix::libc::SOL_SOCKET,
                SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let count = len as usize / std::mem::size_of::<nix::libc::gid_t>();
        if rc == 0 {
            groups.truncate(count);
            return Ok(groups);
        }
        let error = std::io::Error::last_os_error();
        // NGROUPS_MAX is 65536: the size the kernel asks for is bounded.
        if error.raw_os_error() == Some(nix::libc::ERANGE) && count > groups.len() {
            groups.resize(count.min(65536), 0);
            continue;
        }
        return Err(error);
    }
    Err(std::io::Error::other("the peer's group list kept growing"))
}

/// A connection's places (its uid's and, unless the operator's, the total's), given
/// back when the connection ends.
pub struct Slot {
    uid: u32,
    held: Arc<Mutex<HashMap<u32, u32>>>,
    _total: Option<Held>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.uid);
            }
        }
    }
}

pub struct PeerCheck {
    uids: HashSet<u32>,
    gids: HashSet<u32>,
    per_uid: u32,
    /// Connections held, by uid.
    held: Arc<Mutex<HashMap<u32, u32>>>,
    total: Cap,
    metrics: Arc<Metrics>,
}

static REFUSALS: std::sync::LazyLock<LogLimit> =
    std::sync::LazyLock::new(|| LogLimit::new("refused connections"));

impl PeerCheck {
    /// Admits the agent's uid, root, `uids` and members of `gids`; at most `per_uid`
    /// connections per uid, and `total` in all for uids other than the operator's.
    pub fn new(
        uids: &[u32],
        gids: &[u32],
        per_uid: u32,
        total: usize,
        metrics: Arc<Metrics>,
    ) -> PeerCheck {
        PeerCheck {
            uids: uids.iter().copied().collect(),
            gids: gids.iter().copied().collect(),
            per_uid,
            held: Arc::default(),
            total: Cap::new("connections", total),
            metrics,
        }
    }

    /// Counts a refusal and logs it within the log's limit.
    fn refused(&self, line: impl FnOnce()) {
        self.metrics.refused();
        REFUSALS.log(line);
    }

    /// Whether a peer with `uid`, primary `gid` and supplementary groups (read only if
    /// needed) is allowed.
    fn allowed(
        &self,
        uid: u32,
        gid: u32,
        groups: impl FnOnce() -> std::io::Result<Vec<u32>>,
    ) -> bool {
        if is_operator(uid) || self.uids.contains(&uid) || self.gids.contains(&gid) {
            return true;
        }
        if self.gids.is_empty() {
            return false;
        }
        match groups() {
            Ok(groups) => groups.iter().any(|g| self.gids.contains(g)),
            Err(e) => {
                tracing::warn!(uid, error = %e, "reading the peer's supplementary groups failed");
                false
            }
        }
    }

    /// Takes a connection slot for `uid`, or says which limit it is over.
    fn take_slot(&self, uid: u32) -> Result<Slot, Refusal> {
        let over = |message| refused(hyper::StatusCode::TOO_MANY_REQUESTS, message);
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let n = held.entry(uid).or_insert(0);
        if *n >= self.per_uid {
            return Err(over(format!(
                "uid {uid} already holds {n} connections, the most max_connections_per_uid \
                 allows"
            )));
        }
        let total = match is_operator(uid) {
            true => None,
            false => Some(self.total.take().map_err(over)?),
        };
        *n += 1;
        Ok(Slot {
            uid,
            held: self.held.clone(),
            _total: total,
        })
    }
}

fn refused(status: hyper::StatusCode, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        code: REFUSED,
        message: message.into(),
    }
}

impl Admission for PeerCheck {
    type Ticket = Slot;

    fn admit(&self, stream: &UnixStream) -> Result<Slot, Refusal> {
        let cred = match stream.peer_cred() {
            Ok(cred) => cred,
            Err(e) => {
                self.refused(
                    || tracing::warn!(error = %e, "refused a connection: no peer credentials"),
                );
                return Err(refused(
                    hyper::StatusCode::FORBIDDEN,
                    format!("the agent could not read the connection's peer credentials: {e}"),
                ));
            }
        };
        let (uid, gid) = (cred.uid(), cred.gid());
        let refusal = if self.allowed(uid, gid, || peer_groups(stream)) {
            match self.take_slot(uid) {
                Ok(slot) => return Ok(slot),
                Err(refusal) => refusal,
            }
        } else {
            refused(
                hyper::StatusCode::FORBIDDEN,
                format!("uid {uid} is not in allowed_uids or allowed_gids"),
            )
        };
        self.refused(|| {
            tracing::warn!(
                uid,
                gid,
                pid = cred.pid(),
                reason = %refusal.message,
                "refused a connection"
            )
        });
        Err(refusal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(uids: &[u32], gids: &[u32], per_uid: u32, max: usize) -> PeerCheck {
        PeerCheck::new(uids, gids, per_uid, max, Metrics::new())
    }

    #[test]
    fn the_agents_uid_and_root_are_allowed_whatever_is_configured() {
        let own = nix::unistd::geteuid().as_raw();
        let c = check(&[1000], &[], 8, 4096);
        for uid in [own, 0, 1000] {
            assert!(c.allowed(uid, 12345, || Ok(vec![])), "uid {uid}");
        }
        assert!(!c.allowed(1001, 12345, || Ok(vec![])));
    }

    #[test]
    fn a_supplementary_group_admits_and_is_read_only_when_needed() {
        let c = check(&[], &[500], 8, 4096);
        assert!(c.allowed(2000, 2000, || Ok(vec![7, 500])));
        assert!(c.allowed(2000, 500, || panic!("the primary group was enough")));
        assert!(!c.allowed(2000, 2000, || Ok(vec![7, 501])));
        let none = check(&[], &[], 8, 4096);
        assert!(!none.allowed(2000, 2000, || panic!("no gids: groups are not read")));
    }

    #[test]
    fn one_uid_is_held_to_its_limit_and_gets_slots_back() {
        let c = check(&[1000], &[], 2, 4096);
        let a = c.take_slot(1000).unwrap();
        let _b = c.take_slot(1000).unwrap();
        let over = c.take_slot(1000).err().unwrap();
        assert_eq!(over.status, hyper::StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            over.message,
            "uid 1000 already holds 2 connections, the most max_connections_per_uid allows"
        );
        // Another uid is not affected; a closed connection frees its slot.
        assert!(c.take_slot(1001).is_ok());
        drop(a);
        assert!(c.take_slot(1000).is_ok());
    }

    #[test]
    fn other_uids_share_the_total_and_the_operator_is_not_counted_in_it() {
        let c = check(&[1000, 1001], &[], 8, 3);
        let held: Vec<Slot> = (0..3).map(|_| c.take_slot(1000).unwrap()).collect();
        let over = c.take_slot(1001).err().unwrap();
        assert_eq!(
            over.message,
            "3 of the 3 connections the agent holds at once for all its peers are held; try \
             again later"
        );
        assert!(c.take_slot(0).is_ok(), "root connects whatever others hold");
        drop(held);
        assert!(c.take_slot(1001).is_ok());
        assert!(c.held.lock().unwrap().is_empty(), "no uid is left counted");
    }
}
