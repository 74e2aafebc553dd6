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
//! - Connections are a [`Budget`]: no uid holds more than `max_connections_per_uid` at
//!   once, and uids other than the agent's own and root together hold at most three
//!   quarters of them, so other users cannot take every connection from the operator.
//! - A refused peer gets HTTP 403 (not allowed) or 429 (over a limit) with a JSON-RPC
//!   error naming the rule (answered by the server within a bounded time), and the
//!   refusal is counted and logged within a [`LogThrottle`], so a refused peer cannot
//!   flood the log.

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use opmon_snapshotter::server::{Admission, LogThrottle, Refusal};
use tokio::net::UnixStream;

use crate::budget::{is_operator, Budget, Held};
use crate::metrics::Metrics;

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

/// A connection's slot in the connections' budget, given back when the connection ends.
pub type Slot = Held;

pub struct PeerCheck {
    uids: HashSet<u32>,
    gids: HashSet<u32>,
    connections: Budget,
    log: LogThrottle,
    metrics: Arc<Metrics>,
}

impl PeerCheck {
    /// Admits the agent's uid, root, `uids` and members of `gids`; at most `per_uid`
    /// connections per uid, of `max_connections` in all.
    pub fn new(
        uids: &[u32],
        gids: &[u32],
        per_uid: u32,
        max_connections: u32,
        metrics: Arc<Metrics>,
    ) -> PeerCheck {
        PeerCheck {
            uids: uids.iter().copied().collect(),
            gids: gids.iter().copied().collect(),
            connections: Budget::new(
                "max_connections_per_uid",
                "connections",
                per_uid,
                max_connections as usize,
            ),
            log: LogThrottle::new(|unlogged, window| {
                tracing::warn!(
                    unlogged,
                    ?window,
                    "refused connections: more than are logged one by one"
                )
            }),
            metrics,
        }
    }

    /// Counts a refusal and logs it within the log's budget.
    fn refused(&self, line: impl FnOnce()) {
        self.metrics.refused();
        self.log.log(line);
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
        self.connections
            .take(Some(uid))
            .map_err(|message| refused(hyper::StatusCode::TOO_MANY_REQUESTS, message))
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

    fn check(uids: &[u32], gids: &[u32], per_uid: u32, max: u32) -> PeerCheck {
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
    fn refusals_past_the_budget_are_summed_up_once_the_window_ends() {
        let start = tokio::time::Instant::now();
        let log = LogThrottle::starting(start, |_, _| {});
        let own_lines = (0..LogThrottle::PER_WINDOW + 5)
            .filter(|_| log.note(start).0)
            .count();
        assert_eq!(own_lines, LogThrottle::PER_WINDOW as usize);
        // The next window opens with the sum of the last one's unlogged refusals.
        assert_eq!(log.note(start + LogThrottle::WINDOW), (true, 5));
        assert_eq!(log.note(start + LogThrottle::WINDOW), (true, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_windows_count_is_written_when_it_ends_though_no_refusal_follows() {
        use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
        static SAID: AtomicU32 = AtomicU32::new(0);
        static AT_DROP: AtomicU32 = AtomicU32::new(0);
        let log = LogThrottle::new(|unlogged, _| {
            SAID.fetch_add(unlogged, SeqCst);
        });
        for _ in 0..LogThrottle::PER_WINDOW + 7 {
            log.log(|| {});
        }
        assert_eq!(SAID.load(SeqCst), 0, "said before the window ended");
        // The paused clock runs the window's timer, then this.
        tokio::time::sleep(LogThrottle::WINDOW * 2).await;
        assert_eq!(SAID.load(SeqCst), 7);

        let log = LogThrottle::new(|unlogged, _| {
            AT_DROP.fetch_add(unlogged, SeqCst);
        });
        for _ in 0..LogThrottle::PER_WINDOW + 3 {
            log.log(|| {});
        }
        drop(log);
        assert_eq!(AT_DROP.load(SeqCst), 3, "said when the throttle is dropped");
        tokio::time::sleep(LogThrottle::WINDOW * 2).await;
        assert_eq!(AT_DROP.load(SeqCst), 3, "and only once");
    }

    #[test]
    fn other_uids_leave_the_reserve_to_the_operator() {
        let c = check(&[], &[], 10, 8);
        let _held: Vec<Slot> = (0..6).map(|i| c.take_slot(1000 + i).unwrap()).collect();
        let over = c.take_slot(1006).err().unwrap();
        assert_eq!(
            over.message,
            "other uids hold 6 connections, all the agent takes from uids other than its own \
             and root; try again later"
        );
        assert!(c.take_slot(0).is_ok(), "root still gets in");
    }
}
